"""One benchmark worker process: ``pgque.Worker`` with a chosen handler, run until SIGTERM.

    python -m bench.worker_process DSN QUEUE CONSUMER OUT [--slots N] [--handler KIND]
        [--sleep-ms MS] [--max-events N] [--concurrency N]
        [--key-concurrency N] [--no-ticker] [--async]

Started by the ``partition`` and ``latency`` suites, so every worker is a real
OS process with its own interpreter (no GIL shared with the producer or with
the other workers). Options left out keep the Worker's defaults. With
``--async`` the process runs a ``pgque.AsyncWorker`` under ``asyncio.run``
instead, with ``async def`` handlers (``sleep`` awaits ``asyncio.sleep``).

Handlers:

* ``noop``: records the event id and returns;
* ``sleep``: records the event id, then sleeps ``--sleep-ms`` (releases the GIL,
  as a handler waiting on I/O would);
* ``record``: records the event id and ``time.time()`` as its first action
  (latency: the producer's commit acknowledgement is on the same clock);
* ``pickup``: ``record``, then sleeps ``--sleep-ms`` (a job of that length, the
  ``jobs`` suite's workload).

Every handler records the event id (a list append, ≈ 50 ns), so the suite can
check that each event sent was handled exactly once. After SIGTERM the Worker
finishes its batches in flight, releases its slots and returns; then this
process writes ``OUT``, a JSON object: ``pid``, ``handled`` and ``failed`` (the
Worker's counters), ``ids`` (in handling order) and, for ``record``,
``started`` (one ``time.time()`` per id, same order).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pgque

__all__ = ["main"]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_process")
    parser.add_argument("dsn")
    parser.add_argument("queue")
    parser.add_argument("consumer")
    parser.add_argument("out", type=Path, help="JSON file written at exit")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--handler", choices=("noop", "sleep", "record", "pickup"), default="noop")
    parser.add_argument("--sleep-ms", type=float, default=1.0)
    parser.add_argument("--max-events", type=int, help="default: the Worker's")
    parser.add_argument("--concurrency", type=int, help="default: the Worker's (= slots)")
    parser.add_argument("--key-concurrency", type=int, help="default: the Worker's (1)")
    parser.add_argument("--no-ticker", action="store_true",
                        help="run no Ticker: the suite makes the ticks itself")
    parser.add_argument("--async", dest="use_async", action="store_true",
                        help="a pgque.AsyncWorker with async handlers (asyncio.sleep)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    ids: list[int] = []
    started: list[float] = []
    # Bound methods looked up once: the handlers stay a few hundred nanoseconds.
    add_id = ids.append
    add_start = started.append
    now = time.time
    pause = time.sleep
    seconds = args.sleep_ms / 1000

    # list.append is atomic under the GIL, so the Worker's handler threads can
    # share these lists without a lock.
    def noop(message: pgque.Message[Any]) -> None:
        add_id(message.id)

    def sleep(message: pgque.Message[Any]) -> None:
        add_id(message.id)
        pause(seconds)

    def record(message: pgque.Message[Any]) -> None:
        add_start(now())  # first: the latency ends where the handler starts
        add_id(message.id)

    def pickup(message: pgque.Message[Any]) -> None:
        add_start(now())
        add_id(message.id)
        pause(seconds)

    async def anoop(message: pgque.Message[Any]) -> None:
        add_id(message.id)

    async def asleep(message: pgque.Message[Any]) -> None:
        add_id(message.id)
        await asyncio.sleep(seconds)

    async def arecord(message: pgque.Message[Any]) -> None:
        add_start(now())
        add_id(message.id)

    async def apickup(message: pgque.Message[Any]) -> None:
        add_start(now())
        add_id(message.id)
        await asyncio.sleep(seconds)

    handlers = {"noop": noop, "sleep": sleep, "record": record, "pickup": pickup}
    async_handlers = {"noop": anoop, "sleep": asleep, "record": arecord, "pickup": apickup}
    options: dict[str, Any] = {}
    if args.max_events is not None:
        options["max_events"] = args.max_events
    if args.concurrency is not None:
        options["concurrency"] = args.concurrency
    if args.key_concurrency is not None:
        options["key_concurrency"] = args.key_concurrency
    if args.no_ticker:
        options["ticker"] = False

    logging.basicConfig(level=logging.WARNING,
                        format=f"[bench worker {os.getpid()}] %(levelname)s %(message)s")
    worker: pgque.Worker[Any] | pgque.AsyncWorker[Any]
    if args.use_async:
        worker = pgque.AsyncWorker(
            args.dsn, queue=args.queue, consumer=args.consumer, slots=args.slots,
            handler=async_handlers[args.handler], name=f"bench-worker-{os.getpid()}",
            **options)
        asyncio.run(worker.run())  # until SIGTERM, as below
    else:
        worker = pgque.Worker(
            args.dsn, queue=args.queue, consumer=args.consumer, slots=args.slots,
            handler=handlers[args.handler], name=f"bench-worker-{os.getpid()}", **options)
        worker.run()  # until SIGTERM; returns with every batch in flight acked

    result: dict[str, Any] = {"pid": os.getpid(), "handled": worker.handled,
                              "failed": worker.failed, "ids": ids}
    if args.handler in ("record", "pickup"):
        result["started"] = started
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, args.out)  # the suite reads it only once complete
    return 0


if __name__ == "__main__":
    sys.exit(main())
