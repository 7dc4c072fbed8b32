"""A worker by lease in a process of its own, for tests/test_lease_worker.py:

    python tests/lease_worker_process.py DSN NAME SLOTS LEASE DELAY_MS

runs pgque.Worker(ownership="lease") on queue q, group g, until SIGTERM, with a
handler that records each call in the table ``handled`` (event id, pid, the
worker's name, start and end on the database's clock) over a connection of
its own (through the same DSN) and takes DELAY_MS milliseconds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import psycopg

import pgque


def main() -> int:
    dsn, name, slots, lease, delay_ms = sys.argv[1:6]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    local = threading.local()

    def handle(message: pgque.Message[Any]) -> None:
        conn = getattr(local, "conn", None)
        if conn is None or conn.closed:
            conn = local.conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        row = conn.execute("insert into handled (ev_id, pid, worker) values (%s, %s, %s) "
                           "returning ctid::text", (message.id, os.getpid(), name)).fetchone()
        assert row is not None
        threading.Event().wait(int(delay_ms) / 1000)
        conn.execute("update handled set ended = clock_timestamp() where ctid = %s::tid",
                     (row[0],))

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=int(slots), handler=handle,
                          ticker=False, poll_interval=0.05, rebalance_interval=0.2,
                          ownership="lease", lease=float(lease), name=name)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
