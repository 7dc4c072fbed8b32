"""Slot indexes (pgque/sql/code/generated/slot_index.sql): a slot of a group reads only
its own events, through an index on the routing formula that exists exactly
while a group of that slot count does, and that never changes which events
a slot gets (G1 stays pgque.slot_of), nor holds up producers while it is made.

And the idle-slot probe (_slot_has_nothing) and pending_slots: a slot with
nothing in its ticks is told so without reading its events, yet finds what
transactions in progress at a tick and retries bring it, and still moves its
cursor, so that it neither pins rotation nor lags behind a queue that stopped
ticking."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import scalar, slot_cursor, slot_keys, wait_for
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


def test_an_idle_slot_moves_its_cursor_after_a_second_when_ticking_stops(
        client: pgque.Client) -> None:
    """An idle slot's poll writes nothing while its last tick is under a second
    old, and moves its cursor to the newest tick once it is older, although
    the queue ticks no more; the other slot still gets its events."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    [key] = slot_keys(client.conn, 0, 4)
    client.send_batch("q", [("e", n, key) for n in range(5)])
    newest = client.tick("q")
    assert client.claim_slot("q", "g", 1)
    before = slot_cursor(client, "g#1/4")
    assert before[0] < newest
    assert client.receive_partitioned("q", "g", slot=1, slots=4) is None
    assert slot_cursor(client, "g#1/4") == before  # idle: nothing written
    assert client.pending_slots("q", "g") == {0}
    time.sleep(1.1)  # the queue ticks no more
    assert client.receive_partitioned("q", "g", slot=1, slots=4) is None
    assert slot_cursor(client, "g#1/4") == (newest, None)
    # And slot 0 still gets its five.
    assert client.claim_slot("q", "g", 0)
    batch = client.receive_partitioned("q", "g", slot=0, slots=4)
    assert batch is not None and len(batch) == 5


def _slot_of(conn: psycopg.Connection[Any], key: str | None, slots: int) -> int:
    return int(scalar(conn, "select pgque.slot_of(%s, %s)", (key, slots)))


def _drain_slot(client: pgque.Client, slot: int, slots: int, group: str = "g") -> list[int]:
    got: list[int] = []
    while (batch := client.receive_partitioned("q", group, slot=slot, slots=slots)) is not None:
        got.extend(m.id for m in batch)
        client.ack(batch)
    return got


def test_receive_partitioned_with_a_null_slot_count_gets_only_its_slot(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """receive_partitioned returns only its hash class, filtered server-side,
    also for a NULL slot count (the group's count then): a buggy client never
    reaches another slot's events."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    other = slot_keys(conn, 1, 4, 3)
    mine = slot_keys(conn, 0, 4, 2)
    client.send_batch("q", [("e", None, k) for k in other + mine])
    client.tick("q")
    assert client.claim_slot("q", "g", 0)
    rows = client.conn.execute(
        "select ev_extra1 from pgque.receive_partitioned('q', 'g', 0, null)").fetchall()
    keys = [r[0] for r in rows]
    assert sorted(keys) == sorted(mine), f"slot 0 received {keys}"


def test_concurrent_producers_in_progress_at_tick_time_reach_their_slot(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The xip arm of the slot filter with the slot index: producers whose
    transactions are open across several ticks (so their txids are in the
    ticks' xip lists, and the idle probe says "nothing" meanwhile) commit in
    an order unlike their txids; every slot gets exactly its events."""
    slots = 4
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    expected: dict[int, set[int]] = {s: set() for s in range(slots)}
    producers = [psycopg.connect(dsn) for _ in range(6)]
    try:
        for n, producer in enumerate(producers):
            producer.execute("select pg_current_xact_id()")  # a txid now, in order
            key = f"p{n}"
            ev = pgque.Client(producer).send("q", "e", n, partition_key=key, conn=producer)
            expected[_slot_of(conn, key, slots)].add(ev)
        got: dict[int, set[int]] = {s: set() for s in range(slots)}
        # Commit in reverse txid order, with ticks and receives in between.
        for producer in reversed(producers):
            client.tick("q")
            for slot in range(slots):
                got[slot].update(_drain_slot(client, slot, slots))
            producer.commit()
        client.tick("q")
        for slot in range(slots):
            got[slot].update(_drain_slot(client, slot, slots))
        assert got == expected
    finally:
        for producer in producers:
            producer.close()


def test_idle_probe_finds_an_event_committed_after_a_tick_that_saw_it_in_progress(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A slot whose cursor moved to a tick that had the producer's transaction in
    progress (xip), probed within the second after: the probe finds the event
    through the xip arm, it does not say "nothing"."""
    slots = 4
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    assert client.claim_slot("q", "g", 1)
    [key] = slot_keys(conn, 1, slots, 1)
    with psycopg.connect(dsn) as producer:
        ev = client.send("q", "e", None, partition_key=key, conn=producer)
        # Make the slot's cursor move past a tick with the producer in progress:
        # the probe only lets a cursor move when >= 1 s of ticks lie ahead.
        client.tick("q")
        client.conn.execute("update pgque.tick set tick_time = tick_time - interval '5 s'"
                            " where tick_id < (select max(tick_id) from pgque.tick)")
        client.tick("q")
        assert client.receive_partitioned("q", "g", slot=1, slots=slots) is None
        last = scalar(conn, "select last_tick_id from pgque.consumer_info"
                            " where consumer_name = 'g#1/4'")
        xip = scalar(conn, "select array(select pg_snapshot_xip(tick_snapshot))::text"
                           " from pgque.tick where tick_id = %s", (last,))
        assert xip != "{}", "the slot's last tick should have the producer in progress"
        producer.commit()
    client.tick("q")  # < 1 s after the slot's last tick: the probe is asked
    assert _drain_slot(client, 1, slots) == [ev]


def test_idle_probe_finds_a_retry_meant_for_the_slot(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A retry re-inserted by maintenance (ev_owner the slot's subscription, a
    new txid) in a tick less than a second after the slot's last one is found
    by the probe, and only by its own slot: a second group of the same N never
    sees it."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.subscribe_slots("q", "h", slots=4)
    [key] = slot_keys(conn, 2, 4, 1)
    [ev] = client.send_batch("q", [("e", None, key)])
    client.tick("q")
    assert client.claim_slot("q", "g", 2) and client.claim_slot("q", "h", 2)
    batch = client.receive_partitioned("q", "g", slot=2, slots=4)
    assert batch is not None and [m.id for m in batch] == [ev]
    client.ack(batch, nack={ev: "boom"}, retry_after=0)
    assert _drain_slot(client, 2, 4, "h") == [ev]
    client.maintenance("q")
    client.tick("q")
    batch = client.receive_partitioned("q", "g", slot=2, slots=4)
    assert batch is not None and [(m.id, m.retry_count) for m in batch] == [(ev, 1)]
    client.ack(batch)
    assert _drain_slot(client, 2, 4, "h") == []


def test_an_idle_slot_does_not_pin_rotation(client: pgque.Client,
                                            conn: psycopg.Connection[Any]) -> None:
    """A slot that never gets an event, polled as a worker polls it, still moves
    its cursor (at least once a second of ticks), so the queue's old tables are
    truncated while only the other slot has traffic."""
    client.create_queue("q", rotation_period=0)
    client.subscribe_slots("q", "g", slots=2)
    for slot in (0, 1):
        assert client.claim_slot("q", "g", slot)
    busy = slot_keys(conn, 0, 2, 5)

    switches: list[int] = []

    def rotated_through() -> bool:
        for key in busy:
            client.send("q", "e", None, partition_key=key)
        client.tick("q")
        _drain_slot(client, 0, 2)
        assert _drain_slot(client, 1, 2) == []
        client.maintenance("q")
        current = scalar(conn, "select current_table from pgque.queue_info")
        if not switches or switches[-1] != current:
            switches.append(current)
        # Three tables: a fifth current table means used tables were truncated.
        return len(switches) >= 5

    wait_for(rotated_through, timeout=15, interval=0.1, what=f"rotation ({switches})")


@pytest.mark.parametrize("call", ["subscribe_slots", "unsubscribe_slots"])
def test_subscribing_in_a_transaction_does_not_hold_the_producers(
        client: pgque.Client, dsn: str, call: str) -> None:
    """A group subscribed (or unsubscribed) inside a longer transaction, as a
    schema migration does, leaves the event tables free: a send meanwhile does
    not wait for that transaction (docs/operations.md, Sizing N: "no producer
    waits for an index build")."""
    client.create_queue("q")
    client.subscribe("q", "plain")
    if call == "unsubscribe_slots":
        client.subscribe_slots("q", "g", slots=4)
    with psycopg.connect(dsn) as migration, psycopg.connect(dsn, autocommit=True) as producer:
        if call == "subscribe_slots":
            migration.execute("select pgque.subscribe_slots('q', 'g', 4)")
        else:
            migration.execute("select pgque.unsubscribe_slots('q', 'g')")
        # ... the migration goes on with other work; meanwhile the application sends.
        producer.execute("set lock_timeout = '1s'")
        try:
            producer.execute("select pgque.send('q', 'e', '1', 'k')")
        finally:
            migration.rollback()


def test_concurrent_subscribes_with_producers_lose_and_misroute_nothing(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Two groups of different N subscribe at the same time (index syncs of one
    queue one at a time), a third unsubscribes, while producers send without
    pause; both new groups end with their indexes (made by maintenance), and
    each slot of each gets exactly the events committed after its group
    existed, routed by slot_of."""
    queue_id = client.create_queue("q")
    client.subscribe_slots("q", "old", slots=3)
    stop = threading.Event()
    sent: list[tuple[int, str]] = []

    def produce(n: int) -> None:
        with pgque.connect(dsn) as producer:
            i = 0
            while not stop.is_set():
                key = f"p{n}-{i}"
                sent.append((producer.send("q", "e", None, partition_key=key), key))
                i += 1

    producers = [threading.Thread(target=produce, args=(n,)) for n in range(2)]
    for thread in producers:
        thread.start()
    try:
        wait_for(lambda: len(sent) > 50, what="producers running")
        barrier = threading.Barrier(3)
        errors: list[BaseException] = []

        def act(call: str, *args: Any) -> None:
            try:
                with pgque.connect(dsn) as other:
                    barrier.wait(5)
                    if call == "subscribe_slots":
                        other.subscribe_slots("q", args[0], slots=args[1])
                    else:
                        other.unsubscribe_slots("q", *args)
            except BaseException as exc:
                errors.append(exc)

        actors = [threading.Thread(target=act, args=("subscribe_slots", "a", 4)),
                  threading.Thread(target=act, args=("subscribe_slots", "b", 8)),
                  threading.Thread(target=act, args=("unsubscribe_slots", "old"))]
        for thread in actors:
            thread.start()
        for thread in actors:
            thread.join(30)
        assert errors == []
        after = len(sent)  # sent once both groups existed: each must get all of them
        wait_for(lambda: len(sent) > after + 200, what="more events")
    finally:
        stop.set()
        for thread in producers:
            thread.join(10)
    client.maintenance()  # where the slot indexes are made
    names = {r[0] for r in conn.execute(
        "select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace"
        " where n.nspname = 'pgque' and c.relkind = 'i' and c.relname ~ %s",
        (f"^event_{queue_id}_[0-9]+_slots[0-9]+$",))}
    # A table busy beyond 50 ms may lack its index; the rest must have them.
    assert any(name.endswith("_slots4") for name in names)
    assert any(name.endswith("_slots8") for name in names)
    client.tick("q")
    for group, slots in (("a", 4), ("b", 8)):
        got: dict[int, int] = {}
        for slot in range(slots):
            assert client.claim_slot("q", group, slot)
            while (batch := client.receive_partitioned("q", group, slot=slot,
                                                       slots=slots)) is not None:
                for m in batch:
                    assert m.id not in got
                    got[m.id] = slot
                client.ack(batch)
        for ev, key in sent:
            if ev in got:
                assert got[ev] == _slot_of(conn, key, slots), f"event {ev} misrouted"
        assert set(got) <= {ev for ev, _ in sent}
        missing = [ev for ev, _ in sent[after:] if ev not in got]
        assert missing == [], f"group {group} lost {len(missing)} events"
