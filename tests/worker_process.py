"""A worker process for the multi-process tests: runs pgque.Worker (or, with
``PGQUE_TEST_WORKER=async``, pgque.AsyncWorker) with a handler that records,
in the database, when it starts and ends each event.

    python tests/worker_process.py DSN QUEUE CONSUMER SLOTS MAX_DELAY_MS SEED

Table ``handled`` (created by the test) gets one row per handler call; start
and end times come from the database clock. Exits 0 after SIGTERM. Tests know
a worker is up when it has joined the group (its signal handlers are in place
by then).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import random
import signal
import sys
import threading
from typing import Any

import psycopg

import pgque


def main() -> int:
    dsn, queue, consumer, slots, max_delay_ms, seed = sys.argv[1:7]
    rng = random.Random(int(seed))
    local = threading.local()

    def recorder() -> psycopg.Connection[Any]:
        if not hasattr(local, "conn") or local.conn.closed:
            local.conn = psycopg.connect(dsn, autocommit=True)
        conn: psycopg.Connection[Any] = local.conn
        return conn

    def handler(message: pgque.Message[Any]) -> None:
        conn = recorder()
        row = conn.execute(
            "insert into handled (ev_id, key, producer, seq, pid, retry, started) "
            "values (%s, %s, %s, %s, %s, %s, clock_timestamp()) returning id",
            (message.id, message.partition_key, message.payload["p"], message.payload["s"],
             os.getpid(), message.retry_count)).fetchone()
        assert row is not None
        threading.Event().wait(rng.uniform(0, int(max_delay_ms)) / 1000)
        conn.execute("update handled set ended = clock_timestamp() where id = %s", (row[0],))

    conns: dict[object, psycopg.AsyncConnection[Any]] = {}  # one per lane's task

    async def async_handler(message: pgque.Message[Any]) -> None:
        lane = asyncio.current_task()
        if lane not in conns or conns[lane].closed:
            conns[lane] = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        conn = conns[lane]
        cur = await conn.execute(
            "insert into handled (ev_id, key, producer, seq, pid, retry, started) "
            "values (%s, %s, %s, %s, %s, %s, clock_timestamp()) returning id",
            (message.id, message.partition_key, message.payload["p"], message.payload["s"],
             os.getpid(), message.retry_count))
        row = await cur.fetchone()
        assert row is not None
        await asyncio.sleep(rng.uniform(0, int(max_delay_ms)) / 1000)
        await conn.execute("update handled set ended = clock_timestamp() where id = %s",
                           (row[0],))

    faulthandler.register(signal.SIGUSR1)  # the tests dump our stacks if we hang
    logging.basicConfig(level=logging.WARNING, format=f"[worker {os.getpid()}] %(message)s")
    options: dict[str, Any] = {"queue": queue, "consumer": consumer, "slots": int(slots),
                               "max_events": 20, "poll_interval": 0.05,
                               "rebalance_interval": 0.2}
    # Returns after SIGTERM, having released everything.
    if os.environ.get("PGQUE_TEST_WORKER") == "async":  # the AsyncWorker (conftest.py)
        asyncio.run(pgque.AsyncWorker(dsn, handler=async_handler, **options).run())
    else:
        pgque.Worker(dsn, handler=handler, **options).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
