"""Metadata must not bloat: a transaction that holds back the xmin horizon must not
make consumers slower and slower.

The proxy for "slower" is deterministic: the shared buffers one receive call
touches (EXPLAIN ANALYZE BUFFERS counts those of the queries inside the
function). With a hot-updated cursor row, every cycle under a held horizon
adds a row version that later lookups walk: measured on the first design of
this engine, 81 buffers per receive after 1,000 cycles, 127 after 2,000 and
219 after 4,000, growing without bound. With the append-only cursor log it was
38, 47 and 47: only index depth grows, as it does with no horizon held.

The thousands of cycles that build the history run inside the server (the
same pgque calls the client makes, each in a transaction of its own): from
Python each costs four round trips, about three times the server's work.
The cycles that measure go through the client.
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


def measured_cycle(client: pgque.Client, conn: psycopg.Connection[Any]) -> int:
    """Send, tick, receive through EXPLAIN ANALYZE and ack; returns the receive's buffers."""
    client.send("q", "e", 1)
    client.tick("q")
    buffers = receive_buffers(conn)
    batch_id = scalar(conn, "select open_batch_id from pgque.consumer_info")
    assert client.ack(pgque.Batch("q", "c", batch_id)) is True
    return buffers


def cycles(conn: psycopg.Connection[Any], count: int) -> None:
    """``count`` times what a producer, the ticker and a consumer do for one event:
    client.send, client.tick, client.receive and client.ack's SQL, each committed
    on its own (a DO block outside a transaction may commit; the autocommit
    connection runs it so). Fails on a receive without a batch or a refused ack."""
    conn.execute(f"""
        do $$
        declare
            v_batch bigint;
        begin
            for i in 1..{int(count)} loop
                perform pgque.send('q', 'e', '1', null);
                commit;
                perform pgque.tick('q');
                commit;
                select batch_id into v_batch from pgque.receive('q', 'c', null) limit 1;
                commit;
                if v_batch is null then
                    raise 'cycle %: no batch to receive', i;
                end if;
                if not pgque.ack('q', 'c', v_batch) then
                    raise 'cycle %: batch % not acked', i, v_batch;
                end if;
                commit;
            end loop;
        end
        $$""")


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
        cycles(conn, 1000)
        early = sorted(measured_cycle(client, conn) for _ in range(5))[2]
        cycles(conn, 3000)
        late = sorted(measured_cycle(client, conn) for _ in range(5))[2]
        horizon_held = scalar(conn, "select count(*) from pg_stat_activity "
                                    "where backend_xmin is not null and pid = %s",
                              (holder.info.backend_pid,))
    finally:
        holder.close()
    assert horizon_held == 1
    # Four times the cycles may deepen an index by a level; it must not multiply the work.
    assert late <= early * 1.5, f"a receive touched {early} buffers after 1,000 cycles " \
                                f"and {late} after 4,000"
