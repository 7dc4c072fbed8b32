"""The reference consumer of the ``jobs`` suite: one PgQ consumer, as PgQ's own
clients run it, with handlers run concurrently, until SIGTERM.

    python -m bench.pgq_consumer DSN QUEUE CONSUMER OUT [--sleep-ms MS] [--handlers N]

One asyncio process: a ticker task calls ``pgq.ticker()`` every 5 ms on its
own connection (as pgqd would, at pgque's Ticker's shortest interval), and the
consumer loops ``next_batch`` → ``get_batch_events`` → the batch's events
handled up to ``--handlers`` at a time (``asyncio.sleep`` of ``--sleep-ms``,
the job) → ``finish_batch``, polling every 5 ms while there is no batch. PgQ
has no keys: its events are handled in any order within a batch. The
handler records ``time.time()`` as its first action and the event id, like
bench.worker_process's ``pickup``; OUT gets the same JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["main"]

POLL_S = 0.005  # the consumer's poll and the ticker's period


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    ids: list[int] = []
    started: list[float] = []
    seconds = args.sleep_ms / 1000
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    gate = asyncio.Semaphore(args.handlers)

    async def handle(event_id: int) -> None:
        async with gate:
            started.append(time.time())
            ids.append(event_id)
            await asyncio.sleep(seconds)

    async def tick(conn: psycopg.AsyncConnection[Any]) -> None:
        while not stop.is_set():
            await conn.execute("select pgq.ticker()")
            await asyncio.sleep(POLL_S)

    async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn, \
            await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as ticker_conn:
        ticking = asyncio.create_task(tick(ticker_conn))
        while not stop.is_set():
            cur = await conn.execute("select pgq.next_batch(%s, %s)", (args.queue, args.consumer))
            row = await cur.fetchone()
            batch_id = row[0] if row is not None else None
            if batch_id is None:
                await asyncio.sleep(POLL_S)
                continue
            cur = await conn.execute("select ev_id from pgq.get_batch_events(%s)", (batch_id,))
            await asyncio.gather(*(handle(r[0]) for r in await cur.fetchall()))
            await conn.execute("select pgq.finish_batch(%s)", (batch_id,))
        await ticking
    return {"pid": os.getpid(), "handled": len(ids), "failed": 0, "ids": ids,
            "started": started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pgq_consumer")
    parser.add_argument("dsn")
    parser.add_argument("queue")
    parser.add_argument("consumer")
    parser.add_argument("out", type=Path)
    parser.add_argument("--sleep-ms", type=float, default=1.0)
    parser.add_argument("--handlers", type=int, default=32)
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
