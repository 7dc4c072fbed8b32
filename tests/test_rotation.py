"""Zero bloat: event tables are only inserted into and reclaimed by TRUNCATE once
every subscription has moved past them, even with lagging consumers and long
transactions."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import drain, long_variant, scalar, wait_for

import pgque


def event_tables(conn: psycopg.Connection[Any], queue: str) -> list[str]:
    qid = scalar(conn, "select queue_id from pgque.queue where queue_name = %s", (queue,))
    rows = conn.execute(
        "select c.relname from pg_class c join pg_inherits i on i.inhrelid = c.oid "
        "where i.inhparent = %s::regclass order by c.relname", (f"pgque.event_{qid}",)).fetchall()
    return [r[0] for r in rows]


def row_counts(conn: psycopg.Connection[Any], tables: list[str]) -> dict[str, int]:
    return {t: scalar(conn, f"select count(*) from pgque.{t}") for t in tables}


def current_table(conn: psycopg.Connection[Any], queue: str) -> int:
    return int(scalar(conn, "select current_table from pgque.queue_info where queue_name = %s",
                      (queue,)))


def flush_stats(conn: psycopg.Connection[Any]) -> None:
    if scalar(conn, "select current_setting('server_version_num')::int") >= 150000:
        conn.execute("select pg_stat_force_next_flush()")


def used_tables(conn: psycopg.Connection[Any], queue: str) -> int:
    """The queue's record of the event tables besides the current one that may
    hold events (bit n: table n)."""
    return int(scalar(conn, "select queue_used_tables from pgque.queue where queue_name = %s",
                      (queue,)))


def looked_at(conn: psycopg.Connection[Any]) -> set[str]:
    """The queues a maintenance pass over every queue looks at closely."""
    return {row[0] for row in conn.execute(
        "select q.queue_name from pgque._maint_look() l join pgque.queue q on q.queue_id = l")}


def event_reads(conn: psycopg.Connection[Any]) -> int:
    """The scans of event tables by this session (compare two taken in one
    transaction: the counts may include earlier ones not sent yet)."""
    return int(scalar(conn, "select coalesce(sum(coalesce(idx_scan, 0) + seq_scan), 0)"
                            " from pg_stat_xact_user_tables"
                            " where schemaname = 'pgque' and relname ~ '^event_[0-9]+'"))


def test_a_pass_over_every_queue_reads_no_event_table_of_a_queue_with_nothing_to_do(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Maintenance every second over thousands of queues probed every table of
    every queue. A pass over all of them now looks, in one statement over the
    queue rows and the catalog, for the queues with something to do, and reads
    no event table of the others."""
    client.create_queue("q", rotation_period=3600)
    client.create_queue("idle", rotation_period=3600)
    client.subscribe("q", "c")
    client.subscribe_slots("q", "g", slots=4)
    client.send_batch("q", [("e", i, f"k{i}") for i in range(20)])
    assert len(drain(client, "q", "c")) == 20
    for _ in range(3):
        client.maintenance()
    assert looked_at(conn) == set()
    with conn.transaction():
        reads = event_reads(conn)
        for _ in range(3):
            assert conn.execute("select * from pgque.maint() where queue_name is not null"
                                ).fetchall() == []
        assert event_reads(conn) == reads
    # A group added: its reader and slot indexes are due, and the queue looked at.
    client.subscribe_slots("idle", "g", slots=8)
    assert looked_at(conn) == {"idle"}
    client.maintenance()
    assert looked_at(conn) == set()


def test_a_table_a_switch_leaves_is_marked_in_use_until_maintenance_empties_it(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """The table a switch leaves is marked in use and looked at by every pass until
    its events are consumed and it is truncated. A mark lost (a producer that read
    the old current table before the switch inserted after the table was found
    empty) costs only time: the next switch due looks at every table."""
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "c")
    tables = event_tables(conn, "q")
    client.send_batch("q", [("e", i) for i in range(10)])
    client.maintenance()  # switches away from table 0
    assert current_table(conn, "q") == 1 and used_tables(conn, "q") == 0b1
    client.set_queue_config("q", rotation_period=3600)
    client.maintenance()
    assert row_counts(conn, tables)[tables[0]] == 10  # not consumed: kept, and marked
    assert used_tables(conn, "q") == 0b1 and looked_at(conn) == {"q"}
    assert len(drain(client, "q", "c")) == 10
    client.maintenance()
    assert row_counts(conn, tables)[tables[0]] == 0 and used_tables(conn, "q") == 0
    assert looked_at(conn) == set()
    # The mark lost: table 1 keeps its consumed events until a switch is due.
    client.set_queue_config("q", rotation_period=0)
    client.send_batch("q", [("e", i) for i in range(10)])
    client.maintenance()  # switches away from table 1
    assert current_table(conn, "q") == 2 and used_tables(conn, "q") == 0b10
    assert len(drain(client, "q", "c")) == 10
    client.set_queue_config("q", rotation_period=3600)
    conn.execute("update pgque.queue set queue_used_tables = 0 where queue_name = 'q'")
    client.maintenance()
    assert row_counts(conn, tables)[tables[1]] == 10 and looked_at(conn) == set()
    client.set_queue_config("q", rotation_period=0)
    client.maintenance()
    assert row_counts(conn, tables)[tables[1]] == 0


def test_an_insert_in_flight_keeps_the_table_it_goes_to_marked_in_use(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A producer that read the queue row before a switch inserts into the table
    the switch left; while its transaction is open the table looks empty. The
    pass must keep the table marked (it tries a SHARE lock without waiting, which
    the insert holds off), or the event would sit there unlooked-at until the next
    switch is due."""
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "c")
    client.maintenance()  # switches away from table 0, empty
    client.set_queue_config("q", rotation_period=3600)
    assert current_table(conn, "q") == 1 and used_tables(conn, "q") == 0b1
    qid = scalar(conn, "select queue_id from pgque.queue where queue_name = 'q'")
    with psycopg.connect(dsn) as late:
        late.execute("select pgque.send('q', 'e', '{}')")  # a producer: table 1, current
        late.execute(f"insert into pgque.event_{int(qid)}_0 (ev_type, ev_data)"
                     " values ('e', '{}')")
        client.maintenance()
        assert used_tables(conn, "q") == 0b1
        late.commit()
    assert len(drain(client, "q", "c")) == 2
    client.maintenance()
    assert used_tables(conn, "q") == 0 and looked_at(conn) == set()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1000, long_variant(5000, id="200k-long")],
                         ids=lambda chunk: f"{40 * chunk // 1000}k")
def test_events_through_three_rotations_leave_no_dead_tuples(
        client: pgque.Client, conn: psycopg.Connection[Any], chunk: int) -> None:
    """40 chunks of events (40,000; 200,000 in the long variant), two consumers
    of which one lags; maintenance after each chunk rotates as soon as it may."""
    client.create_queue("q", rotation_period=0, ticker_max_count=100000)
    client.subscribe("q", "fast")
    client.subscribe("q", "lagging")
    tables = event_tables(conn, "q")
    assert len(tables) == 3

    sent: list[int] = []
    got: dict[str, list[int]] = {"fast": [], "lagging": []}
    switches = truncations = 0
    previous = current_table(conn, "q")
    total = 40 * chunk
    for n in range(40):
        sent += client.send_batch("q", [("e", {"n": i}, f"k{i % 97}") for i in range(chunk)])
        got["fast"] += [m.id for m in drain(client, "q", "fast")]
        if n % 8 == 7:  # the lagging consumer catches up only now and then
            got["lagging"] += [m.id for m in drain(client, "q", "lagging",
                                                   max_events=3 * chunk // 5)]
        for _, step, _amount in client.maintenance("q"):
            assert step in ("rotate", "rotate_cursors", "rotate_ticks")
        now = current_table(conn, "q")
        if now != previous:
            switches += 1
            previous = now
    got["lagging"] += [m.id for m in drain(client, "q", "lagging")]
    # Everyone has consumed everything: every table but the current one can go.
    for _, step, amount in client.maintenance("q"):
        if step == "rotate":
            truncations += amount

    assert got["fast"] == sent
    assert got["lagging"] == sent
    assert len(sent) == total
    assert switches >= 3, f"only {switches} rotations"
    counts = row_counts(conn, tables)
    current = tables[current_table(conn, "q")]
    assert all(n == 0 for t, n in counts.items() if t != current), counts

    # The sends went through the client's producer pool: a session that is
    # still open holds back its last second of statistics until it has idled
    # for 10 s, and one that ends reports them as it exits.
    client.close()
    flush_stats(conn)

    def stats() -> list[tuple[str, int, int]] | None:
        rows = conn.execute(
            "select relname, n_tup_ins, n_dead_tup from pg_stat_user_tables "
            "where schemaname = 'pgque' and relname = any(%s)", (tables,)).fetchall()
        # Stats reach the view asynchronously on old servers: wait until the
        # inserts show, so n_dead_tup below is read from live counters.
        return rows if sum(r[1] for r in rows) >= total else None

    rows = wait_for(stats, timeout=15, what="insert statistics")
    assert all(dead == 0 for _, _, dead in rows), rows


@pytest.mark.both_clients  # not the 200k test: its rotation is the engine's
def test_lagging_consumer_pins_truncation_until_it_catches_up(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "fast")
    client.subscribe("q", "slow")
    tables = event_tables(conn, "q")
    first = client.send_batch("q", [("e", i) for i in range(100)])
    drain(client, "q", "fast")
    client.maintenance("q")  # switches away from table 0
    second = client.send_batch("q", [("e", i) for i in range(100)])
    drain(client, "q", "fast")
    client.maintenance("q")
    # "slow" has not read table 0: it must still be there.
    assert row_counts(conn, tables)[tables[0]] == 100
    assert [m.id for m in drain(client, "q", "slow")] == first + second
    client.maintenance("q")
    assert row_counts(conn, tables)[tables[0]] == 0


@pytest.mark.both_clients  # not the 200k test: its rotation is the engine's
def test_unsubscribe_releases_rotation_floor(client: pgque.Client,
                                             conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "reader")
    client.subscribe("q", "abandoned")
    tables = event_tables(conn, "q")
    client.send_batch("q", [("e", i) for i in range(10)])
    drain(client, "q", "reader")
    client.maintenance("q")
    client.maintenance("q")
    assert row_counts(conn, tables)[tables[0]] == 10  # pinned by "abandoned"
    assert client.unsubscribe("q", "abandoned") is True
    client.maintenance("q")
    assert row_counts(conn, tables)[tables[0]] == 0


@pytest.mark.both_clients  # not the 200k test: its rotation is the engine's
def test_long_transaction_holding_txid_blocks_truncation_not_delivery(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """A producer transaction still open in the old table across a switch keeps
    that table from being truncated; its event is delivered once it commits."""
    client.create_queue("q", rotation_period=0)
    client.subscribe("q", "c")
    tables = event_tables(conn, "q")
    early = client.send("q", "early", 0)
    long_tx = psycopg.connect(dsn)
    try:
        late = pgque.Client(long_tx).send("q", "late", 1)  # into table 0, uncommitted
        client.maintenance("q")  # switch: table 1 is current now
        assert current_table(conn, "q") == 1
        after = client.send_batch("q", [("e", i) for i in range(5)])
        got = [m.id for m in drain(client, "q", "c")]
        assert got == [early, *after]
        client.maintenance("q")  # table 0 is locked by the open writer: not truncated
        client.maintenance("q")
        assert scalar(conn, f"select count(*) from pgque.{tables[0]}") == 1
        long_tx.commit()
    finally:
        long_tx.close()
    assert [m.id for m in drain(client, "q", "c")] == [late]
    client.maintenance("q")
    assert row_counts(conn, tables)[tables[0]] == 0
