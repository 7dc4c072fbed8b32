"""Review of the batch readers (64_batch_reader.sql), the read-ahead of
receive_partitioned (65_partition.sql) and receive_slots / ack_slots
(69_slot_sets.sql): the attacks that broke something (each failed, as a strict
xfail, on the reviewed commit cb202bb; fixed since) and the probes that held."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import refused, scalar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

# -- defects ------------------------------------------------------------------------


def _install_while(dsn: str, during: Any) -> dict[str, str]:
    """Runs pgque.install in a thread; once it waits for a lock, calls during()
    (which may raise psycopg.Error: recorded as "during"); then waits for the
    install. Returns {"install": "ok" or its error, "during": ...}."""
    result: dict[str, str] = {}
    with psycopg.connect(dsn, autocommit=True) as installer, \
            psycopg.connect(dsn, autocommit=True) as watcher:
        pid = installer.info.backend_pid

        def install() -> None:
            try:
                pgque.install(installer)
                result["install"] = "ok"
            except psycopg.Error as exc:
                result["install"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

        t = threading.Thread(target=install)
        t.start()
        deadline = time.monotonic() + 30
        while not scalar(watcher, "select wait_event_type = 'Lock' from pg_stat_activity"
                                  " where pid = %s", (pid,)):
            assert time.monotonic() < deadline, "the install never waited"
            time.sleep(0.02)
        try:
            during()
        except psycopg.Error as exc:
            result["during"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        t.join(120)
        assert not t.is_alive()
    return result


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_does_not_deadlock_with_a_maintenance_pass_over_several_queues(
        dsn: str) -> None:
    """Severity medium. The Ticker's maint() takes the maintenance lock of each queue
    it works on and keeps it to its commit. An install drops every reader
    (05_drop_code.sql, holding no maintenance lock), then 97_batch_readers.sql
    waits for each queue's maintenance lock. A pass that holds q1's lock (rotating
    it) and then rewrites q2's reader (a group of a new count subscribed) waits for
    the install's uncommitted drop of that reader: a cycle, and the deadlock
    detector aborts the install (40P01, not among install()'s retried errors). In
    a realistic form (a Ticker's maint() of two queues while groups come and go,
    25 installs) 3 of 25 installs failed so. Docs (operations.md "Upgrading"):
    "the install itself waits for no worker". Fix: take every queue's maintenance
    lock (by queue id) before 05 drops anything, or leave the readers out of 05 and
    replace them in 97 under the lock; or make maint() share-lock install_lock."""
    with pgque.connect(dsn) as client:
        client.create_queue("q1", rotation_period=0)  # always something to rotate
        client.create_queue("q2")
        client.subscribe_slots("q2", "g", slots=4)  # q2's reader is due
    with psycopg.connect(dsn) as maint:  # one transaction, as one maint() of all queues
        assert [r[1] for r in maint.execute("select * from pgque.maint('q1')")] == ["rotate"]

        def rest_of_the_pass() -> None:
            maint.execute("select * from pgque.maint('q2')").fetchall()
            maint.commit()

        result = _install_while(dsn, rest_of_the_pass)
        maint.rollback()
    assert result.get("install") == "ok", result


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_waits_for_a_maintenance_that_rewrote_a_reader(dsn: str) -> None:
    """Held: the other order (the reader rewritten, uncommitted, before the install
    drops it): the install waits, then succeeds."""
    with pgque.connect(dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=4)
    with psycopg.connect(dsn) as maint:
        assert "batch_reader" in [r[1] for r in maint.execute("select * from pgque.maint()")]
        result = _install_while(dsn, maint.commit)
    assert result == {"install": "ok"}, result


# -- probes ------------------------------------------------------------------------


@pytest.fixture
def roles(dsn: str) -> Iterator[dict[str, pgque.Client]]:
    """Login roles in each pgque role, and one in none, with a queue q whose group g
    (4 slots) belongs to the reader."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    names = {kind: f"rv_{kind}_{suffix}" for kind in ("reader", "other", "writer", "admin",
                                                     "nobody")}
    clients: dict[str, pgque.Client] = {}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, name in names.items():
            su.execute(f"create role {name} login")
            if kind in ("reader", "other", "writer", "admin"):
                su.execute(f"grant pgque_{'reader' if kind == 'other' else kind} to {name}")
        su.execute("select pgque.create_queue('q')")
        try:
            for kind, name in names.items():
                clients[kind] = pgque.connect(make_conninfo(**{**params, "user": name}))
            clients["reader"].subscribe_slots("q", "g", slots=4)
            yield clients
        finally:
            for client in clients.values():
                client.close()
            with psycopg.connect(dsn, autocommit=True) as su2:
                su2.execute("select pgque.drop_queue('q', true)")
                for name in names.values():
                    su2.execute(f"drop owned by {name} cascade")
                    su2.execute(f"drop role if exists {name}")


def _denied(call: Any) -> bool:
    """Whether call fails for want of a right: pgque's PQ014/PQ015, or 42501."""
    try:
        call()
    except pgque.AccessDenied:
        return True
    except psycopg.Error as exc:
        return exc.sqlstate == "42501"
    return False


INTERNALS = [
    "select pgque._batch_reader_{id}(null, null, null, null, null, 0, null, null, 0, null,"
    " null, null, null, null, false)",
    "select pgque._run_reader({id}, null, false, null, null, null, null, null, 0, null, null,"
    " 0, null, null, null, null)",
    "select pgque._batch_events({id}, 1, null, null, 0, null, null, null)",
    "select pgque._probe_slots({id}, null, null, array[0], array[1], array[null::pg_snapshot])",
    "select pgque._sync_batch_reader({id})",
    "select pgque._drop_batch_reader({id})",
    "select pgque._batch_reader_source({id}, '{{}}')",
]


@pytest.mark.parametrize("kind", ["reader", "writer", "admin", "nobody"])
def test_no_role_calls_a_reader_or_its_helpers(roles: dict[str, pgque.Client], dsn: str,
                                               kind: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as su:
        queue_id = scalar(su, "select queue_id from pgque.queue where queue_name = 'q'")
        su.execute("select pgque.maint()")
        before = su.execute("select p.prosrc from pg_proc p where p.proname = "
                            "pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    client = roles[kind]
    for statement in INTERNALS:
        assert refused(lambda s=statement: client.conn.execute(s.format(id=queue_id))), statement
    # Not through a search_path of its own either.
    client.conn.execute("set search_path = pgque, public")
    with pytest.raises((psycopg.errors.InsufficientPrivilege,
                        psycopg.errors.UndefinedFunction)):  # nobody: no usage on the schema
        client.conn.execute(
            f"select _batch_reader_{queue_id}(null, null, null, null, null, 0, null, null, 0,"
            " null, null, null, null, null, false)")
    with psycopg.connect(dsn, autocommit=True) as su:
        after = su.execute("select p.prosrc from pg_proc p where p.proname = "
                           "pgque._batch_reader_name(%s)", (queue_id,)).fetchone()
    assert after == before is not None


@pytest.mark.both_clients
def test_slot_sets_respect_roles(roles: dict[str, pgque.Client]) -> None:
    reader, other, writer, admin = (roles[k] for k in ("reader", "other", "writer", "admin"))
    admin.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
    admin.tick("q")
    for slot in range(4):
        assert reader.claim_slot("q", "g", slot)
    for client in (other, writer, roles["nobody"]):
        assert _denied(lambda c=client: c.receive_slots("q", "g", slots=4, owned=range(4)))
    batches = reader.receive_slots("q", "g", slots=4, owned=range(4))
    assert sum(len(b) for b in batches) == 20
    for client in (other, writer, roles["nobody"]):
        assert _denied(lambda c=client: c.ack_slots(batches))
        assert _denied(lambda c=client: c.pending_slots("q", "g"))
    assert reader.pending_slots("q", "g") == {b.slot for b in batches}
    assert all(reader.ack_slots(batches))
    assert reader.pending_slots("q", "g") == frozenset()
    # An admin may use the group (admins act for every role), but owns no slot.
    assert refused(lambda: admin.receive_slots("q", "g", slots=4, owned=[0]),
                   pgque.SlotNotOwned)


OPS = st.lists(st.one_of(
    st.tuples(st.just("send"), st.lists(st.one_of(st.none(), st.sampled_from(
        [f"k{n}" for n in range(12)])), min_size=1, max_size=15)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("maint")),
    st.tuples(st.just("regroup")),
    st.tuples(st.just("recv"), st.sets(st.integers(0, 7), min_size=1),
              st.sampled_from([None, 1, 3]), st.booleans()),
), min_size=1, max_size=25)


@given(ops=OPS, slots=st.sampled_from([1, 2, 3, 8]), max_count=st.sampled_from([1, 3, 500]))
@settings(max_examples=int(os.environ.get("RV_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_slot_sets_deliver_each_event_once_in_order_across_reader_changes(
        client: pgque.Client, ops: list[Any], slots: int, max_count: int) -> None:
    """Sends, ticks, maintenance (rotating: rotation_period 0, and writing the
    reader again as a second group comes and goes), receive_slots with pieces and
    nacks, in any order: every slot gets exactly its events, first deliveries in
    send order, nacked ones again as retries; pending_slots names exactly the
    slots that then receive something."""
    client.conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    client.create_queue("q", rotation_period=0, max_retries=100, ticker_max_count=max_count)
    client.subscribe_slots("q", "g", slots=slots)
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    expected: dict[int, list[int]] = {k: [] for k in range(slots)}
    first: dict[int, list[int]] = {k: [] for k in range(slots)}
    retried: list[int] = []
    owed: set[int] = set()  # nacked, not yet seen again
    grouped = False

    def slot_of(key: str | None) -> int:
        return int(scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, slots)))

    def receive(wanted: set[int], max_events: int | None, nack: bool) -> None:
        pending = client.pending_slots("q", "g")
        batches = client.receive_slots("q", "g", slots=slots, owned=sorted(wanted),
                                       max_events=max_events)
        assert {b.slot for b in batches} == pending & wanted
        failed = []
        for batch in batches:
            assert batch.slot is not None
            assert max_events is None or len(batch) <= max_events
            for m in batch:
                assert slot_of(m.partition_key) == batch.slot
                if m.retry_count:
                    assert m.id in owed, m
                    owed.discard(m.id)
                    retried.append(m.id)
                else:
                    first[batch.slot].append(m.id)
            if nack and batch.messages and batch.messages[0].retry_count == 0:
                failed.append(batch.messages[0])
        client.ack_slots(batches, nack=failed)
        owed.update(m.id for m in failed)

    for op in ops:
        if op[0] == "send":
            ids = client.send_batch("q", [("e", n, key) for n, key in enumerate(op[1])])
            for ev, key in zip(ids, op[1], strict=True):
                expected[slot_of(key)].append(ev)
        elif op[0] == "tick":
            client.tick("q")
        elif op[0] == "maint":
            client.maintenance()
        elif op[0] == "regroup":
            if grouped:
                client.unsubscribe_slots("q", "h")
            else:
                client.subscribe_slots("q", "h", slots=slots + 1)
            grouped = not grouped
        else:
            receive({k for k in op[1] if k < slots}, op[2], op[3])
    for _ in range(200):
        client.maintenance()
        client.tick("q")
        before = (sum(map(len, first.values())), len(retried))
        receive(set(range(slots)), None, False)
        if not owed and before == (sum(map(len, first.values())), len(retried)) \
                and not client.pending_slots("q", "g"):
            break
    assert first == expected
    assert not owed


def _key_of(client: pgque.Client, slot: int, slots: int) -> str:
    return next(k for k in (f"k{n}" for n in range(1000))
                if scalar(client.conn, "select pgque.slot_of(%s, %s)", (k, slots)) == slot)


def _cursor(client: pgque.Client, consumer: str) -> tuple[Any, ...]:
    row = client.conn.execute(
        "select c.cur_last_tick, c.cur_batch from pgque.subscription s"
        " cross join lateral pgque._current_cursor(s.sub_id) c"
        " where s.sub_consumer = %s", (consumer,)).fetchone()
    assert row is not None
    return tuple(row)


def test_an_idle_slot_moves_its_cursor_after_a_second_when_ticking_stops(
        client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    client.send_batch("q", [("e", n, _key_of(client, 0, 4)) for n in range(5)])
    newest = client.tick("q")
    assert client.claim_slot("q", "g", 1)
    before = _cursor(client, "g#1/4")
    assert before[0] < newest
    assert client.receive_partitioned("q", "g", slot=1, slots=4) is None
    assert _cursor(client, "g#1/4") == before  # idle: nothing written
    assert client.pending_slots("q", "g") == {0}
    time.sleep(1.1)  # the queue ticks no more
    assert client.receive_partitioned("q", "g", slot=1, slots=4) is None
    assert _cursor(client, "g#1/4") == (newest, None)
    # And slot 0 still gets its five.
    assert client.claim_slot("q", "g", 0)
    batch = client.receive_partitioned("q", "g", slot=0, slots=4)
    assert batch is not None and len(batch) == 5


def _receive_slot_with(client: pgque.Client, slot: int, slots: int,
                       cursor: str, max_events: int | None = None) -> list[Any]:
    """pgque._receive_slot of group g's slot with the cursor given (as text): a
    read ahead made from a cursor that has moved since."""
    return client.conn.execute(
        "select r.batch_id, r.ev_id from pgque._receive_slot("
        "  (select q from pgque.queue q where q.queue_name = 'q'),"
        "  (select g from pgque.consumer_group g where g.cg_consumer = 'g'), %s,"
        "  (select s from pgque.subscription s"
        "    where s.sub_consumer = pgque._slot_name('g', %s, %s)),"
        "  %s::pgque.cursor, %s) r", (slot, slot, slots, cursor, max_events)).fetchall()


def _cursor_text(client: pgque.Client, consumer: str) -> str:
    return str(scalar(client.conn, "select c::text from pgque.subscription s"
                                   " cross join lateral pgque._current_cursor(s.sub_id) c"
                                   " where s.sub_consumer = %s", (consumer,)))


def test_a_read_ahead_from_a_cursor_that_moved_is_not_used(client: pgque.Client) -> None:
    """The read-ahead is made without a lock: when the cursor moved before the
    lock (here: a cursor read before a receive and an ack, or before a receive
    that opened the batch), the events read ahead must not be handed out."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    key = _key_of(client, 0, 4)
    first = client.send_batch("q", [("e", n, key) for n in range(3)])
    client.tick("q")
    assert client.claim_slot("q", "g", 0)
    stale = _cursor_text(client, "g#0/4")
    batch = client.receive_partitioned("q", "g", slot=0, slots=4)
    assert batch is not None and [m.id for m in batch] == first
    client.ack(batch)
    second = client.send_batch("q", [("e", n, key) for n in range(2)])
    client.tick("q")
    rows = _receive_slot_with(client, 0, 4, stale)
    assert [ev for _, ev in rows] == second
    # The same, the cursor now in an open batch handed out in part.
    client.ack(client.receive_partitioned("q", "g", slot=0, slots=4) or batch)
    third = client.send_batch("q", [("e", n, key) for n in range(4)])
    client.tick("q")
    stale = _cursor_text(client, "g#0/4")
    piece = client.receive_partitioned("q", "g", slot=0, slots=4, max_events=1)
    assert piece is not None and [m.id for m in piece] == third[:1]
    client.ack(piece)
    rows = _receive_slot_with(client, 0, 4, stale, 2)
    assert rows and {b for b, _ in rows} == {piece.batch_id}
    assert [ev for _, ev in rows] == third[1:3]


def test_receive_slots_of_a_terminated_session_are_received_again(
        client: pgque.Client, dsn: str) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance()
    sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
    client.tick("q")
    with pgque.connect(dsn) as zombie:
        for slot in range(4):
            assert zombie.claim_slot("q", "g", slot)
        zombie.conn.autocommit = False
        got = zombie.receive_slots("q", "g", slots=4, owned=range(4), max_events=5)
        assert sum(len(b) for b in got) == 20
        client.conn.execute("select pg_terminate_backend(%s)", (zombie.conn.info.backend_pid,))
        with pytest.raises(Exception):  # noqa: B017 - any error: the session is gone
            zombie.ack_slots(got)
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
    received: list[int] = []
    while batches := client.receive_slots("q", "g", slots=4, owned=range(4), max_events=5):
        received += [m.id for b in batches for m in b]
        client.ack_slots(batches)
    assert sorted(received) == sorted(sent)


def test_ack_slots_refuses_odd_lists_and_acks_none(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.subscribe_slots("q", "h", slots=4)
    client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
    client.tick("q")
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
        assert client.claim_slot("q", "h", slot)
    g = {b.slot: b for b in client.receive_slots("q", "g", slots=4, owned=range(4))}
    h = {b.slot: b for b in client.receive_slots("q", "h", slots=4, owned=range(4))}
    assert sorted(g) == sorted(h) == [0, 1, 2, 3]
    conn = client.conn
    call = "select pgque.ack_slots('q', 'g', 4, %s::integer[], %s::bigint[])"
    cases: list[tuple[Any, Any, str]] = [
        ([0, 1], [g[0].batch_id], "22023"),
        ([0], [g[0].batch_id, g[1].batch_id], "22023"),
        ([0, None], [g[0].batch_id, g[1].batch_id], "PQ023"),
        ([0, 4], [g[0].batch_id, g[1].batch_id], "PQ023"),
        ([0, -1], [g[0].batch_id, g[1].batch_id], "PQ023"),
        ([1, 1], [g[1].batch_id, g[1].batch_id], "22023"),
        ([0, 1], [g[0].batch_id, None], "PQ003"),
        ([0, 1], [g[0].batch_id, h[1].batch_id], "PQ003"),  # another group's batch
        ([0, 1], [g[1].batch_id, g[0].batch_id], "PQ003"),  # swapped
    ]
    for slot_list, batch_ids, state in cases:
        try:
            result = conn.execute(call, (slot_list, batch_ids)).fetchone()
        except psycopg.Error as exc:
            assert exc.sqlstate == state, (slot_list, batch_ids, exc)
        else:
            raise AssertionError(f"{slot_list} {batch_ids}: {result}, not {state}")
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select pgque.ack_slots('q', 'g', 8, '{0}', %s::bigint[])",
                     ([g[0].batch_id],))
    assert info.value.sqlstate == "PQ020"
    # A slot lost: nothing acked, not even the slots before it.
    assert client.release_slot("q", "g", 3)
    with pytest.raises(pgque.SlotNotOwned):
        client.ack_slots(list(g.values()))
    assert all(_cursor(client, f"g#{k}/4")[1] == g[k].batch_id for k in range(4))
    assert client.claim_slot("q", "g", 3)
    assert client.ack_slots([g[2], g[0], g[1], g[3]]) == [True] * 4
    assert conn.execute("select pgque.ack_slots('q', 'g', 4, '{}', '{}')").fetchone() == ([],)


@pytest.mark.both_clients
def test_ack_slots_with_nacks_is_all_or_none(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
    client.tick("q")
    for slot in range(4):
        assert client.claim_slot("q", "g", slot)
    batches = client.receive_slots("q", "g", slots=4, owned=range(4))
    assert len(batches) == 4
    assert client.release_slot("q", "g", batches[-1].slot)
    with pytest.raises(pgque.SlotNotOwned):
        client.ack_slots(batches, nack=[batches[0].messages[0]])
    assert scalar(client.conn, "select count(*) from pgque.retry_queue") == 0
    assert scalar(client.conn, "select count(*) from pgque.batch_nack") == 0
    assert all(_cursor(client, f"g#{b.slot}/4")[1] == b.batch_id for b in batches)


def test_ack_slots_refuses_a_null_slot_list_as_receive_slots_does(
        conn: psycopg.Connection[Any]) -> None:
    """Severity low. _slot_subs (69_slot_sets.sql) raises 22023 for a null list,
    and receive_slots does, but ack_slots reads it in a join with
    unnest(slot_list, batch_ids): with both null (or null and '{}') the join is
    empty, _slot_subs is never run, and the call returns '{}' as if it acked.
    The length check passes too (coalesce(cardinality(null), 0) = 0). Fix: check
    p_slot_list is not null (and validate through _slot_subs before the join)."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select * from pgque.receive_slots('q', 'g', 4, null)")
    assert info.value.sqlstate == "22023"
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select pgque.ack_slots('q', 'g', 4, null, null)")
    assert info.value.sqlstate == "22023"


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_upgraded_0_1_install_gets_readers_for_its_groups(empty_dsn: str) -> None:
    from test_install import install_0_1
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe_slots("q", "g", slots=2)
        client.subscribe_slots("q", "h", slots=3)
        sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(30)])
        client.tick("q")
        queue_id = scalar(client.conn, "select queue_id from pgque.queue")
        assert pgque.install(client.conn) == "0.1.0"
        source = str(scalar(client.conn, "select prosrc from pg_proc where proname ="
                                         " pgque._batch_reader_name(%s)", (queue_id,)))
        assert [line.strip() for line in source.splitlines() if "if p_slots" in line] == [
            "if p_slots is null or p_slots = 1 then", "if p_slots = 2 then",
            "if p_slots = 3 then"]
        assert "batch_reader" not in [s for _, s, _ in client.maintenance()]
        pgque.install(client.conn)  # again: the same reader, nothing due
        assert scalar(client.conn, "select prosrc from pg_proc where proname ="
                                   " pgque._batch_reader_name(%s)", (queue_id,)) == source
        assert client.maintenance() == []
        for group, slots in (("g", 2), ("h", 3)):
            for slot in range(slots):
                assert client.claim_slot("q", group, slot)
            got: list[int] = []
            while batches := client.receive_slots("q", group, slots=slots,
                                                  owned=range(slots), max_events=4):
                got += [m.id for b in batches for m in b]
                client.ack_slots(batches)
            assert sorted(got) == sorted(sent)


def test_a_session_reads_a_queue_dropped_and_made_again_under_its_name(
        client: pgque.Client, dsn: str) -> None:
    with pgque.connect(dsn) as worker:
        for round_ in range(3):
            client.create_queue("q")
            client.subscribe_slots("q", "g", slots=4)
            if round_ != 1:
                client.maintenance()  # round 1 reads dynamically
            sent = client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
            client.tick("q")
            for slot in range(4):
                assert worker.claim_slot("q", "g", slot)
            got: list[int] = []
            while batches := worker.receive_slots("q", "g", slots=4, owned=range(4)):
                got += [m.id for b in batches for m in b]
                worker.ack_slots(batches)
            assert sorted(got) == sorted(sent)
            assert worker.pending_slots("q", "g") == frozenset()
            client.drop_queue("q", force=True)


@pytest.mark.superuser_install  # it installs again as the superuser
def test_concurrent_churn_loses_and_duplicates_nothing(dsn: str) -> None:
    """A consumer draining with receive_slots / ack_slots (and pending_slots)
    while another session sends, ticks, runs maintenance that rotates and
    rewrites the reader (a second group coming and going), and installs: every
    event once, each slot's in order. An install may fail a call once."""
    slots = 4
    with pgque.connect(dsn) as admin:
        admin.create_queue("q", rotation_period=0, event_tables=3)
        admin.subscribe_slots("q", "g", slots=slots)
    sent: list[tuple[int, str]] = []
    stop = threading.Event()
    errors: list[str] = []

    def churn() -> None:
        with pgque.connect(dsn) as c:
            n = 0
            while not stop.is_set():
                n += 1
                keys = [f"k{(n * 7 + i) % 23}" for i in range(9)]
                ids = c.send_batch("q", [("e", i, k) for i, k in enumerate(keys)])
                sent.extend(zip(ids, keys, strict=True))
                c.tick("q")
                if n % 3 == 0:
                    try:
                        if n % 6 == 0:
                            c.subscribe_slots("q", "h", slots=n % 5 + 2)
                        else:
                            c.unsubscribe_slots("q", "h")
                    except pgque.PgqueError:
                        pass
                try:
                    c.maintenance()
                except psycopg.Error as exc:
                    errors.append(f"maint: {exc}")
                if n % 10 == 0:
                    try:
                        c.install()
                    except (psycopg.Error, pgque.PgqueError) as exc:
                        errors.append(f"install: {type(exc).__name__}: {exc}")

    got: dict[int, list[int]] = {k: [] for k in range(slots)}
    t = threading.Thread(target=churn)
    with pgque.connect(dsn) as worker:
        for slot in range(slots):
            assert worker.claim_slot("q", "g", slot)
        t.start()
        deadline = time.monotonic() + 6
        failures = 0

        def step() -> bool:
            worker.pending_slots("q", "g")
            batches = worker.receive_slots("q", "g", slots=slots, owned=range(slots),
                                           max_events=5)
            for b in batches:
                assert b.slot is not None
                got[b.slot].extend(m.id for m in b)
            worker.ack_slots(batches)
            return bool(batches)

        try:
            while time.monotonic() < deadline:
                try:
                    step()
                except (psycopg.Error, pgque.PgqueError) as exc:
                    failures += 1
                    errors.append(f"worker: {type(exc).__name__}: {exc}")
        finally:
            stop.set()
            t.join(60)
        with pgque.connect(dsn) as admin:
            for _ in range(3):
                admin.tick("q")
                admin.maintenance()
        while step():
            pass
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    with psycopg.connect(dsn) as c:
        for ev, key in sent:
            by_slot[int(scalar(c, "select pgque.slot_of(%s, %s)", (key, slots)))].append(ev)
    assert got == by_slot
    assert not [e for e in errors if not e.startswith("worker")], errors


@pytest.mark.superuser_install  # it installs again as the superuser
def test_installing_again_with_queues_and_groups_changes_no_catalog_row(dsn: str) -> None:
    from test_install import catalog
    with pgque.connect(dsn) as client:
        for n, slots in enumerate((2, 5, 16)):
            client.create_queue(f"q{n}")
            client.subscribe_slots(f"q{n}", "g", slots=slots)
            client.subscribe_slots(f"q{n}", "h", slots=3)
        client.maintenance()
        assert client.maintenance() == []
        before = catalog(client.conn)
        client.install()
        assert catalog(client.conn) == before
        assert client.maintenance() == []
        client.install()
        assert catalog(client.conn) == before


def test_a_reader_role_cannot_pin_a_batch_reader_and_block_drop_queue(dsn: str) -> None:
    """Severity low. Calling the reader needs EXECUTE, which nobody has, but
    depending on it does not: a role with USAGE on schema pgque (pgque_reader)
    writes a SQL-standard function body that names the reader, and drop_queue,
    even with force, then fails with 2BP01 at `drop function if exists` in
    _drop_batch_reader (64_batch_reader.sql) until an admin finds and drops that
    object. (The queue's id sequence has the same weakness, from before this change:
    drop_queue's `drop sequence` has no cascade either, and a table default of
    nextval() on it blocks drop_queue the same way; event tables are dropped with
    cascade.) Fix: drop the reader with cascade, as the event tables are."""
    role = f"rv_pin_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
        su.execute(f"create schema {role} authorization {role}")
        queue_id = scalar(su, "select pgque.create_queue('q')")
        try:
            with psycopg.connect(make_conninfo(**{**params, "user": role}),
                                 autocommit=True) as r:
                r.execute(
                    f"create function {role}.pin() returns pgque.event_template[]"
                    f" language sql begin atomic select pgque._batch_reader_{queue_id}("
                    "null, null, null, null, null, 0, null, null, 0, null, null, null, null,"
                    " null, false); end")
            su.execute("select pgque.drop_queue('q', true)")
        finally:
            su.execute(f"drop schema if exists {role} cascade")
            su.execute(f"drop owned by {role} cascade")
            su.execute(f"drop role {role}")


DYNAMIC = """
create or replace function public.rv_dynamic(
    p_queue_id integer, p_slots integer, p_probe boolean, a xid8, b xid8, c xid8[],
    d pg_snapshot, e integer, f bigint, g bigint, h bigint[], i integer, j integer,
    k integer[], l integer[], m pg_snapshot[])
returns pgque.event_template[] language plpgsql as $$
declare v pgque.event_template[];
begin
    execute case when p_probe then pgque._probe_statement(p_queue_id, p_slots)
                 else pgque._read_statement(p_queue_id, p_slots) end
       into v using a, b, c, d, e, f, g, h, i, j, p_slots, k, l, m;
    return v;
end $$"""


@given(keys=st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d", "e", "f"])),
                     min_size=1, max_size=40),
       slots=st.sampled_from([1, 2, 3, 8]), after=st.integers(0, 30),
       upto=st.one_of(st.none(), st.integers(0, 40)), limit=st.sampled_from([None, 1, 5]),
       ids=st.one_of(st.none(), st.lists(st.integers(0, 45), max_size=6)),
       owner=st.booleans())
@settings(max_examples=int(os.environ.get("RV_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_reader_and_dynamic_sql_agree_on_every_parameter(
        conn: psycopg.Connection[Any], keys: list[str | None], slots: int, after: int,
        upto: int | None, limit: int | None, ids: list[int] | None, owner: bool) -> None:
    """The reader's branch against the dynamic statement, for reads with after, upto,
    ids and limit and for the probe, with retries owned by one slot's subscription
    among the events (ev_owner)."""
    conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    conn.execute(DYNAMIC)
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', %s)", (slots,))
    conn.execute("select pgque.maint()")
    subs = [r[0] for r in conn.execute(
        "select sub_id from pgque.subscription order by sub_id").fetchall()]
    base = int(scalar(conn, f"select coalesce(max(ev_id), 0) from pgque.event_{queue_id}"))
    first = conn.execute(
        "select t.tick_snapshot from pgque.tick t where t.tick_queue = %s"
        " order by tick_id desc limit 1", (queue_id,)).fetchone()
    assert first is not None
    for n, key in enumerate(keys):
        conn.execute(
            f"insert into pgque.event_{queue_id}_0 (ev_owner, ev_type, ev_data, ev_extra1)"
            " values (%s, 'e', %s, %s)",
            (subs[n % len(subs)] if owner and n % 3 == 0 else None, str(n), key))
    conn.execute("select pgque.tick('q')")
    prev = first[0]
    shifted = None if ids is None else [base + i for i in ids]
    for slot in range(slots):
        sub = subs[slot]
        params = (queue_id, slots, False, prev, prev, sub, base + after,
                  None if upto is None else base + upto, shifted, slot, limit)
        sql = ("select {fn}(%s, %s, %s, pg_snapshot_xmax(%s::pg_snapshot),"
               " pg_snapshot_xmax(n.s), array(select pg_snapshot_xip(%s::pg_snapshot)), n.s,"
               " %s, %s, %s, %s::bigint[], %s, %s, null, null, null)::text from"
               " (select tick_snapshot s from pgque.tick order by tick_id desc limit 1) n")
        static = scalar(conn, sql.format(fn="pgque._run_reader"), params)
        dynamic = scalar(conn, sql.format(fn="public.rv_dynamic"), params)
        assert static == dynamic
    probe = ("select coalesce(array_agg(distinct pgque.slot_of(e.ev_extra1, %s)), '{{}}')"
             " from (select tick_snapshot s from pgque.tick order by tick_id desc limit 1) n,"
             " unnest({fn}(%s, %s, true, null, pg_snapshot_xmax(n.s), null, n.s, null, null,"
             " null, null, null, null, %s::integer[], %s::integer[], %s::pg_snapshot[])) e")
    args = (slots, queue_id, slots, list(range(slots)), subs[:slots], [prev] * slots)
    assert scalar(conn, probe.format(fn="pgque._run_reader"), args) == scalar(
        conn, probe.format(fn="public.rv_dynamic"), args)
