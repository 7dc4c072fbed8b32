"""Batch readers (pgque/sql/code/64_batch_reader.sql): every queue has a generated
function holding its batch queries as static SQL, so a receive plans nothing.
It has a branch for each slot count its groups use, is rewritten by
maintenance when they change, goes with its queue, and never changes which
events a batch holds: the dynamic statement it replaces gives the same."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import scalar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque


def reader_source(conn: psycopg.Connection[Any], queue_id: int) -> str | None:
    row = conn.execute("select p.prosrc from pg_proc p"
                       " where p.pronamespace = 'pgque'::regnamespace"
                       "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    return None if row is None else str(row[0])


def branches(conn: psycopg.Connection[Any], queue_id: int) -> list[str]:
    source = reader_source(conn, queue_id)
    assert source is not None, "the queue has no batch reader"
    return [line.strip() for line in source.splitlines() if line.strip().startswith("if p_slots")]


def steps(client: pgque.Client) -> list[str]:
    return [str(step) for _, step, _ in
            client.conn.execute("select * from pgque.maint()").fetchall()]


def slot_batches(conn: psycopg.Connection[Any], queue_id: int, sub_id: int, slots: int,
                 limit: int | None) -> list[list[int]]:
    """Each slot's events between the queue's first and newest ticks, read by
    pgque._batch_events (the reader when it has the branch, else dynamic SQL)."""
    return [list(scalar(conn,
        "select coalesce(array_agg(e.ev_id order by n), '{}')"
        "  from unnest(pgque._batch_events(%s, %s,"
        "    (select tick_snapshot from pgque.tick where tick_queue = %s order by tick_id limit 1),"
        "    (select tick_snapshot from pgque.tick where tick_queue = %s"
        "      order by tick_id desc limit 1), 0, null, %s, null, %s, %s))"
        "       with ordinality as e(ev_id, ev_time, ev_txid, ev_owner, ev_retry, ev_type,"
        "                             ev_data, ev_extra1, n)",
        (queue_id, sub_id, queue_id, queue_id, limit, slot, slots)))
        for slot in range(slots)]


@pytest.mark.superuser_install  # it installs again as the superuser
def test_a_queue_has_a_reader_with_a_branch_per_slot_count_in_use(client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    assert branches(client.conn, queue_id) == ["if p_slots is null or p_slots = 1 then"]
    assert steps(client) == []  # nothing due: an idle queue's maintenance writes nothing
    client.subscribe_slots("q", "a", slots=4)
    client.subscribe_slots("q", "b", slots=16)
    assert steps(client) == ["slot_indexes", "batch_reader"]
    assert branches(client.conn, queue_id) == [
        "if p_slots is null or p_slots = 1 then", "if p_slots = 4 then", "if p_slots = 16 then"]
    assert steps(client) == []
    client.unsubscribe_slots("q", "a")
    assert steps(client) == ["slot_indexes", "batch_reader"]
    assert branches(client.conn, queue_id) == [
        "if p_slots is null or p_slots = 1 then", "if p_slots = 16 then"]
    # Installing again writes the same reader (and nothing is due after it).
    before = reader_source(client.conn, queue_id)
    client.install()
    assert reader_source(client.conn, queue_id) == before
    assert steps(client) == []
    client.unsubscribe_slots("q", "b")
    client.drop_queue("q")
    assert reader_source(client.conn, queue_id) is None


def test_the_reader_is_internal(client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    acl = scalar(client.conn, "select p.proacl::text from pg_proc p"
                              " where p.pronamespace = 'pgque'::regnamespace"
                              "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,))
    owner = scalar(client.conn, "select nspowner::regrole::text from pg_namespace"
                                " where nspname = 'pgque'")  # the installer
    assert acl == f"{{{owner}=X/{owner}}}"  # no PUBLIC, no pgque role
    # The point of the reader: its statements run on a plan made once per
    # session, not planned per call.
    config = scalar(client.conn, "select p.proconfig::text from pg_proc p"
                                 " where p.pronamespace = 'pgque'::regnamespace"
                                 "   and p.proname = pgque._batch_reader_name(%s)", (queue_id,))
    assert "plan_cache_mode=force_generic_plan" in config


@given(keys=st.lists(st.one_of(st.none(), st.text(st.characters(blacklist_categories=["Cs"],
                                                                   blacklist_characters="\x00"),
                                                    max_size=8)), min_size=1, max_size=60),
       slots=st.sampled_from([2, 3, 8]), limit=st.sampled_from([None, 1, 7]))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_reader_reads_what_the_dynamic_statement_reads(
        client: pgque.Client, keys: list[str | None], slots: int, limit: int | None) -> None:
    client.conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    queue_id = client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    client.send_batch("q", [("e", {"n": n}, key) for n, key in enumerate(keys)])
    client.tick("q")
    sub_id = scalar(client.conn, "select sub_id from pgque.subscription"
                                 " where sub_consumer = pgque._slot_name('g', 0, %s)", (slots,))
    assert branches(client.conn, queue_id)[-1] == "if p_slots is null or p_slots = 1 then"
    dynamic = slot_batches(client.conn, queue_id, sub_id, slots, limit)
    client.maintenance()
    assert branches(client.conn, queue_id)[-1] == f"if p_slots = {slots} then"
    static = slot_batches(client.conn, queue_id, sub_id, slots, limit)
    assert static == dynamic
    # And both are what routing says: each slot's keys, in send order.
    ids = client.conn.execute(
        "select ev_id, pgque.slot_of(ev_extra1, %s) from pgque.event_" + str(queue_id)
        + " order by ev_id", (slots,)).fetchall()
    wanted = [[ev for ev, slot in ids if slot == s][:limit] for s in range(slots)]
    assert static == wanted


def test_a_session_keeps_reading_right_across_rewrites_truncates_and_new_groups(
        client: pgque.Client, dsn: str) -> None:
    """A session's cached plans of the reader must follow what changed under
    them: the reader rewritten for a new group, a slot index built, an event
    table truncated by rotation."""
    client.create_queue("q", rotation_period=0)
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    with pgque.connect(dsn) as worker:
        sent: list[int] = []
        got: list[int] = []
        done: list[str] = []

        def drain_all(group: str, slots: int) -> None:
            for slot in range(slots):
                assert worker.claim_slot("q", group, slot)
                while (batch := worker.receive_partitioned("q", group, slot=slot, slots=slots)):
                    assert all(scalar(worker.conn, "select pgque.slot_of(%s, %s)",
                                      (m.partition_key, slots)) == slot for m in batch)
                    got.extend(m.id for m in batch if group == "g")
                    worker.ack(batch)

        for round_ in range(8):
            sent += client.send_batch("q", [("e", n, f"k{round_}-{n}") for n in range(30)])
            client.tick("q")
            drain_all("g", 4)
            if round_ == 2:
                client.subscribe_slots("q", "h", slots=8)  # a new branch, written below
            if round_ >= 2:
                drain_all("h", 8)
            done += steps(client)  # rotates and truncates (rotation_period 0)
        assert sorted(got) == sorted(sent)
    assert done.count("rotate") >= 3 and "batch_reader" in done


def test_a_reader_behind_the_groups_reads_dynamically(client: pgque.Client) -> None:
    """Between a subscribe and the next maintenance the reader has no branch
    for the new count: the slot still gets its events, by dynamic SQL."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=5)
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(50)])
    client.tick("q")
    got: list[int] = []
    for slot in range(5):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=5)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)


def scanned(conn: psycopg.Connection[Any], queue_id: int) -> int:
    """Rows read from the queue's event tables so far (sequential and by index)."""
    conn.execute("select pg_stat_force_next_flush()")
    return int(scalar(conn, "select coalesce(sum(seq_tup_read + coalesce(idx_tup_fetch, 0)), 0)"
                            "  from pg_stat_user_tables where schemaname = 'pgque'"
                            "   and relname ~ %s", (f"^event_{queue_id}_[0-9]+$",)))


def test_transactions_in_progress_at_a_tick_do_not_make_a_slot_read_the_table(
        client: pgque.Client, dsn: str) -> None:
    """The batch after a tick that saw transactions in progress reads them by
    their ids (prev's xip list) besides the txid range. Written as one "range
    or in list" condition, the readers' generic plan on PostgreSQL 15 used
    the slot index for the slot alone and read every row of the slot in the
    table at each receive; a hash join over the list did the same."""
    queue_id = client.create_queue("q", ticker_max_count=10_000)
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    for _ in range(4):  # a table with history: 4 batches already consumed
        client.send_batch("q", [("e", n, f"old-{n}") for n in range(500)])
        client.tick("q")
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            client.ack(batch)
    sent: list[int] = []
    with pgque.connect(dsn) as held:
        held.conn.execute("begin")
        sent += held.send_batch("q", [("e", n, f"held-{n}") for n in range(40)])
        client.tick("q")  # the held transaction is in progress: in this tick's xip
        sent += client.send_batch("q", [("e", n, f"new-{n}") for n in range(40)])
        held.conn.execute("commit")
    client.tick("q")
    before = scanned(client.conn, queue_id)
    got: list[int] = []
    for slot in range(4):
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)
    # The table holds 2,080 rows; the slots' reads of these 80 events may not
    # come near them (each slot reading its whole hash class would be 2,080).
    assert (scanned(client.conn, queue_id) - before) / len(sent) <= 2.5


def test_a_reader_dropped_by_hand_reads_dynamically_until_maintenance_writes_it(
        client: pgque.Client) -> None:
    queue_id = client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(30)])
    client.tick("q")
    client.conn.execute(f"drop function pgque._batch_reader_{queue_id}")
    got: list[int] = []
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        while (batch := client.receive_partitioned("q", "g", slot=slot, slots=4)):
            got.extend(m.id for m in batch)
            client.ack(batch)
    assert sorted(got) == sorted(sent)
    assert "batch_reader" in steps(client)  # among the ticks and cursors it cleans
    assert branches(client.conn, queue_id)[-1] == "if p_slots = 4 then"
