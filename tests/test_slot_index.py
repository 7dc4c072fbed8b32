"""Slot indexes (pgque/sql/code/62_slot_index.sql): a slot of a group reads only
its own events, through an index on the routing formula that exists exactly
while a group of that slot count does, and that never changes which events
a slot gets (G1 stays pgque.slot_of)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque


def slot_indexes(conn: psycopg.Connection[Any], queue_id: int) -> dict[str, list[str]]:
    """Each event table of the queue with the names of its slot indexes."""
    rows = conn.execute(
        "select t.relname, coalesce(array_agg(i.relname order by i.relname)"
        "                           filter (where i.relname ~ '_slots[0-9]+$'), '{}')"
        "  from pg_class t join pg_namespace n on n.oid = t.relnamespace"
        "  left join pg_index x on x.indrelid = t.oid"
        "  left join pg_class i on i.oid = x.indexrelid"
        " where n.nspname = 'pgque' and t.relname ~ %s and t.relkind = 'r'"
        " group by t.relname order by t.relname",
        (f"^event_{queue_id}_[0-9]+$",)).fetchall()
    return {table: list(names) for table, names in rows}


def scanned(conn: psycopg.Connection[Any], queue_id: int) -> int:
    """Rows read from the queue's event tables so far (sequential and by index)."""
    conn.execute("select pg_stat_force_next_flush()")
    return int(scalar(conn, "select coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)"
                            "  from pg_stat_user_tables where schemaname = 'pgque'"
                            "   and relname ~ %s", (f"^event_{queue_id}_[0-9]+$",)))


def test_the_index_formula_is_the_routing_formula(conn: psycopg.Connection[Any]) -> None:
    # The index expression is SQL text of its own; it must route every key
    # exactly as pgque.slot_of does, NULL included.
    keys = [None, "", "tenant-1", "acme", "ünïcode", "x" * 500, "\t", "a'b\"c"]
    for slots in (2, 3, 8, 16, 1024):
        expr = scalar(conn, "select pgque._slot_expr(%s)", (slots,)).replace("%", "%%")
        rows = conn.execute(
            f"select k.ev_extra1, {expr}, pgque.slot_of(k.ev_extra1, %s)"
            "  from unnest(%s::text[]) k(ev_extra1)", (slots, keys)).fetchall()
        assert [(key, a) for key, a, _ in rows] == [(key, b) for key, _, b in rows]


@given(keys=st.lists(st.text(st.characters(blacklist_categories=["Cs"],
                                           blacklist_characters="\x00"),
                             max_size=40), min_size=1, max_size=40),
       slots=st.integers(2, 64))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_index_formula_routes_any_key_like_slot_of(conn: psycopg.Connection[Any],
                                                       keys: list[str], slots: int) -> None:
    expr = scalar(conn, "select pgque._slot_expr(%s)", (slots,)).replace("%", "%%")
    differ = scalar(conn, f"select count(*) from unnest(%s::text[]) k(ev_extra1)"
                          f" where {expr} <> pgque.slot_of(k.ev_extra1, %s)", (keys, slots))
    assert differ == 0


@pytest.mark.superuser_install  # it installs again as the superuser
def test_a_group_gives_every_event_table_an_index_for_its_slot_count(
        client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    tables = slot_indexes(client.conn, queue_id)
    assert tables and all(names == [] for names in tables.values())
    client.subscribe_slots("q", "one", slots=1)  # one slot: no filter, no index
    client.maintenance()
    assert all(names == [] for names in slot_indexes(client.conn, queue_id).values())
    client.subscribe_slots("q", "a", slots=4)
    client.subscribe_slots("q", "b", slots=4)  # the same count: the same index
    client.subscribe_slots("q", "c", slots=16)
    # Subscribing touches no event table; maintenance makes the indexes.
    assert all(names == [] for names in slot_indexes(client.conn, queue_id).values())
    client.maintenance()
    assert slot_indexes(client.conn, queue_id) == {
        table: [f"{table}_slots16", f"{table}_slots4"] for table in tables}
    client.unsubscribe_slots("q", "a")  # b still counts 4
    client.maintenance()
    assert all(len(names) == 2 for names in slot_indexes(client.conn, queue_id).values())
    client.unsubscribe_slots("q", "b")
    client.maintenance()
    assert slot_indexes(client.conn, queue_id) == {
        table: [f"{table}_slots16"] for table in tables}
    client.unsubscribe_slots("q", "c")
    client.maintenance()
    assert all(names == [] for names in slot_indexes(client.conn, queue_id).values())
    # In line with the groups, a queue needs no maintenance for them (an idle
    # queue's maintenance takes no lock), and installing again changes nothing.
    client.subscribe_slots("q", "c", slots=16)
    client.maintenance()
    assert not scalar(client.conn, "select pgque._slot_indexes_due(%s)", (queue_id,))
    client.install()
    assert slot_indexes(client.conn, queue_id) == {
        table: [f"{table}_slots16"] for table in tables}


@pytest.mark.parametrize("slots", [4, 16])
def test_a_slot_reads_only_its_own_events(client: pgque.Client, slots: int) -> None:
    queue_id = client.create_queue("q", ticker_max_count=500)
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    for _ in range(4):
        client.send_batch("q", [("e", {"n": n}, f"key-{n}") for n in range(500)])
        client.tick("q")
    before = scanned(client.conn, queue_id)
    delivered = 0
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=slots)):
            delivered += len(batch)
            client.ack(batch)
    assert delivered == 2_000
    # Without the index every slot would read all 2,000 (slots times as many).
    assert (scanned(client.conn, queue_id) - before) / delivered <= 1.5


def test_a_busy_table_is_not_waited_for_and_reads_the_same(
        client: pgque.Client, dsn: str) -> None:
    """A table that a long transaction holds is not waited for: maintenance
    indexes the others, the group's slots read that table without the index
    (the same events), and a later pass indexes it once it is free."""
    queue_id = client.create_queue("q")
    current = scalar(client.conn, "select queue_cur_table from pgque.queue where queue_id = %s",
                     (queue_id,))
    busy = f"event_{queue_id}_{current}"
    with psycopg.connect(dsn) as holder:  # not autocommit: the lock stays
        holder.execute(f"lock table pgque.{busy} in row exclusive mode")
        client.subscribe_slots("q", "g", slots=4)  # touches no event table: no wait
        done = threading.Event()

        def maintain() -> None:
            with pgque.connect(dsn) as other:
                other.maintenance()
            done.set()

        thread = threading.Thread(target=maintain)
        thread.start()
        assert done.wait(10), "maintenance waited for the busy table"
        thread.join()
        indexes = slot_indexes(client.conn, queue_id)
        assert indexes[busy] == []
        assert all(names == [f"{t}_slots4"] for t, names in indexes.items() if t != busy)
        holder.rollback()
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
    client.tick("q")
    got: list[int] = []
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            assert all(scalar(client.conn, "select pgque.slot_of(%s, 4)",
                              (m.partition_key,)) == slot for m in batch)
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)
    client.maintenance()  # free now, and small
    assert slot_indexes(client.conn, queue_id)[busy] == [f"{busy}_slots4"]


def test_a_large_table_is_indexed_at_its_truncate_and_reads_the_same(
        client: pgque.Client) -> None:
    """Building an index holds the table's inserts: maintenance builds none on
    a table larger than _slot_index_build_limit(), which gets its index when
    maintenance truncates it; meanwhile its slots get exactly their events."""
    queue_id = client.create_queue("q", rotation_period=0)
    client.subscribe("q", "plain")
    limit = scalar(client.conn, "select pgque._slot_index_build_limit()")
    current = scalar(client.conn, "select queue_cur_table from pgque.queue where queue_id = %s",
                     (queue_id,))
    big = f"event_{queue_id}_{current}"
    payload = "x" * 2000
    while scalar(client.conn, f"select pg_relation_size('pgque.{big}')") <= limit:
        client.send_batch("q", [("e", payload, f"k{n}") for n in range(500)])
    client.subscribe_slots("q", "g", slots=2)
    client.maintenance()
    indexes = slot_indexes(client.conn, queue_id)
    assert indexes[big] == []
    assert all(names == [f"{t}_slots2"] for t, names in indexes.items() if t != big)
    client.tick("q")
    counts = []
    for slot in range(2):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=2)):
            assert all(scalar(client.conn, "select pgque.slot_of(%s, 2)",
                              (m.partition_key,)) == slot for m in batch.messages[:5])
            counts.append(len(batch))
            client.ack(batch)
    sent = scalar(client.conn, f"select count(*) from pgque.{big}")
    assert sum(counts) == sent
    # Everyone past it: rotation moves on, truncates it, and indexes it empty.
    while (batch := client.receive("q", "plain")):
        client.ack(batch)
    for _ in range(6):
        client.tick("q")
        for slot in range(2):
            while (batch := client.receive_partitioned("q", "g", slot=slot, slots=2)):
                client.ack(batch)
        client.maintenance()
        if slot_indexes(client.conn, queue_id)[big]:
            break
    assert slot_indexes(client.conn, queue_id)[big] == [f"{big}_slots2"]


def test_an_index_made_by_hand_with_the_same_name_pattern_is_not_ours_to_keep(
        client: pgque.Client) -> None:
    """The sync drops a slot index of a count no group uses, as found on the table."""
    queue_id = client.create_queue("q")
    table = f"event_{queue_id}_0"
    client.conn.execute(f"create index {table}_slots7 on pgque.{table} (ev_id)")
    client.subscribe_slots("q", "g", slots=3)
    client.maintenance()
    assert slot_indexes(client.conn, queue_id)[table] == [f"{table}_slots3"]


def receivable(client: pgque.Client, slots: int) -> frozenset[int]:
    """The slots whose receive_partitioned returns a batch now (each batch is
    left open, so receiving changes nothing that pending_slots looks at)."""
    found = set()
    for slot in range(slots):
        if client.receive_partitioned("q", "g", slot=slot, slots=slots) is not None:
            found.add(slot)
    return frozenset(found)


@given(keys=st.lists(st.sampled_from([None, "a", "b", "c", "d", "e", "f", "g", "h"]),
                     max_size=12),
       acked=st.sets(st.integers(0, 7)), later=st.lists(st.sampled_from(["a", "x"]),
                                                         max_size=3),
       slots=st.sampled_from([1, 2, 8]))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=15)
def test_pending_slots_names_exactly_the_slots_that_receive_a_batch(
        dsn: str, keys: list[str | None], acked: set[int], later: list[str],
        slots: int) -> None:
    with pgque.connect(dsn) as client:
        client.create_queue("q", exist_ok=True)
        client.subscribe_slots("q", "g", slots=slots)
        try:
            for slot in range(slots):
                assert client.claim_slot("q", "g", slot)
            client.send_batch("q", [("e", None, key) for key in keys])
            client.tick("q")
            # Some slots consume their batch; events sent after the tick are in
            # no batch yet; then a second tick covers them for some slots only.
            for slot in acked & set(range(slots)):
                while (batch := client.receive_partitioned("q", "g", slot=slot,
                                                           slots=slots)):
                    client.ack(batch)
            for key in later:
                client.send("q", "e", None, partition_key=key)
            assert client.pending_slots("q", "g") == receivable(client, slots)
            client.tick("q")
            assert client.pending_slots("q", "g") == receivable(client, slots)
        finally:
            client.unsubscribe_slots("q", "g")


def test_pending_slots_is_refused_to_a_role_that_may_not_use_the_group(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    conn.execute("drop role if exists pgque_test_stranger")
    conn.execute("create role pgque_test_stranger login")
    conn.execute("grant pgque_reader to pgque_test_stranger")
    try:
        stranger_dsn = psycopg.conninfo.make_conninfo(dsn, user="pgque_test_stranger")
        with pgque.connect(stranger_dsn) as stranger, pytest.raises(pgque.PgqueError) as caught:
            stranger.pending_slots("q", "g")
        assert caught.value.sqlstate == "PQ014"
    finally:
        conn.execute("drop owned by pgque_test_stranger")
        conn.execute("drop role pgque_test_stranger")


def test_an_idle_slot_catches_up_on_a_queue_that_stopped_ticking(client: pgque.Client) -> None:
    """A slot with nothing in its ticks skips moving its cursor only while its
    last tick is under a second old (by the database clock), so on a queue
    that went quiet its cursor still reaches the newest tick: rotation and
    monitoring see it caught up, not one tick behind until the next idle tick."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    key = next(k for k in (f"k{n}" for n in range(100))
               if scalar(client.conn, "select pgque.slot_of(%s, 2)", (k,)) == 0)
    for slot in (0, 1):
        assert client.claim_slot("q", "g", slot)
    client.send("q", "e", None, partition_key=key)
    client.tick("q")
    batch = client.receive_partitioned("q", "g", slot=0, slots=2)
    assert batch is not None
    client.ack(batch)

    def slot1_behind() -> int:
        assert client.receive_partitioned("q", "g", slot=1, slots=2) is None
        (status,) = [s for s in client.partition_slot_status("q") if s.slot == 1]
        return status.ticks_behind

    assert slot1_behind() == 1  # skipped: its last tick is fresh
    wait_for(lambda: slot1_behind() == 0, timeout=10, interval=0.2,
             what="the idle slot's cursor to reach the newest tick")
