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
    # The Worker's key_concurrency (PGQUE_TEST_KEY_CONCURRENCY, default 1).
    key_concurrency = int(os.environ.get("PGQUE_TEST_KEY_CONCURRENCY", "1"))
    rng = random.Random(int(seed))
    # Recording connections, one per handler running at once (a free list:
    # with key_concurrency the handlers of a lane run on several threads or tasks).
    free: list[psycopg.Connection[Any]] = []
    free_lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        with free_lock:
            conn = free.pop() if free else None
        if conn is None or conn.closed:
            conn = psycopg.connect(dsn, autocommit=True)
        try:
            record(conn, message)
        finally:
            with free_lock:
                free.append(conn)

    def record(conn: psycopg.Connection[Any], message: pgque.Message[Any]) -> None:
        row = conn.execute(
            "insert into handled (ev_id, key, producer, seq, pid, retry, started) "
            "values (%s, %s, %s, %s, %s, %s, clock_timestamp()) returning id",
            (message.id, message.partition_key, message.payload["p"], message.payload["s"],
             os.getpid(), message.retry_count)).fetchone()
        assert row is not None
        threading.Event().wait(rng.uniform(0, int(max_delay_ms)) / 1000)
        conn.execute("update handled set ended = clock_timestamp() where id = %s", (row[0],))

    async_free: list[psycopg.AsyncConnection[Any]] = []

    async def async_handler(message: pgque.Message[Any]) -> None:
        conn = async_free.pop() if async_free else None
        if conn is None or conn.closed:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            await async_record(conn, message)
        finally:
            async_free.append(conn)

    async def async_record(conn: psycopg.AsyncConnection[Any],
                           message: pgque.Message[Any]) -> None:
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
                               "key_concurrency": key_concurrency,
                               "rebalance_interval": 0.2}
    # Returns after SIGTERM, having released everything.
    if os.environ.get("PGQUE_TEST_WORKER") == "async":  # the AsyncWorker (conftest.py)
        asyncio.run(pgque.AsyncWorker(dsn, handler=async_handler, **options).run())
    else:
        pgque.Worker(dsn, handler=handler, **options).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
