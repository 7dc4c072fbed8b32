"""Metadata must not bloat: a transaction that holds back the xmin horizon must not
make consumers slower and slower.

The proxy for "slower" is deterministic: the shared buffers one receive call
touches (EXPLAIN ANALYZE BUFFERS counts those of the queries inside the
function). With a hot-updated cursor row, every cycle under a held horizon
adds a row version that later lookups walk: measured on the first design of
this engine, 81 buffers per receive after 1,000 cycles, 127 after 2,000 and
219 after 4,000, growing without bound. With the append-only cursor log it was
38, 47 and 47: only index depth grows, as it does with no horizon held.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from helpers import scalar

import pgque


def receive_buffers(conn: psycopg.Connection[Any]) -> int:
    """Receive once through EXPLAIN ANALYZE; returns the shared buffers it touched."""
    row = conn.execute("explain (analyze, buffers, format json) "
                       "select * from pgque.receive('q', 'c')").fetchone()
    assert row is not None
    plan = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def cycle(client: pgque.Client, conn: psycopg.Connection[Any], measure: bool) -> int:
    client.send("q", "e", 1)
    client.tick("q")
    buffers = receive_buffers(conn) if measure else 0
    batch_id = scalar(conn, "select open_batch_id from pgque.consumer_info")
    if not measure:
        batch = client.receive("q", "c")
        assert batch is not None
        batch_id = batch.batch_id
    assert client.ack(pgque.Batch("q", "c", batch_id)) is True
    return buffers


@pytest.mark.slow
def test_held_xmin_horizon_does_not_slow_consumers(client: pgque.Client, dsn: str,
                                                   conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    holder = psycopg.connect(dsn)
    try:
        # A REPEATABLE READ transaction with an xid: nothing newer can be vacuumed.
        holder.execute("begin isolation level repeatable read")
        holder.execute("select pg_current_xact_id()")
        for _ in range(1000):
            cycle(client, conn, measure=False)
        early = sorted(cycle(client, conn, measure=True) for _ in range(5))[2]
        for _ in range(3000):
            cycle(client, conn, measure=False)
        late = sorted(cycle(client, conn, measure=True) for _ in range(5))[2]
        horizon_held = scalar(conn, "select count(*) from pg_stat_activity "
                                    "where backend_xmin is not null and pid = %s",
                              (holder.info.backend_pid,))
    finally:
        holder.close()
    assert horizon_held == 1
    # Four times the cycles may deepen an index by a level; it must not multiply the work.
    assert late <= early * 1.5, f"a receive touched {early} buffers after 1,000 cycles " \
                                f"and {late} after 4,000"
