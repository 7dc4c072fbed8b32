"""Several slots in one call (pgque/sql/code/slots/sets.sql): receive_slots gives
each owned slot exactly the piece receive_partitioned would, ack_slots acks
them all or none, and neither lets a session touch a slot it does not own, nor
a role that may not use the group. Both take the slots' locks in ascending slot
order, and refuse bad lists with specific SQLSTATEs, changing nothing.

The tests marked both_clients run with the Client and the AsyncClient (conftest.py)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import LONG, refused, scalar, slot_cursor, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque


def fill(client: pgque.Client, slots: int, events: int) -> dict[int, list[int]]:
    """A queue q with a group g of ``slots`` slots, all owned by ``client``, and
    ``events`` events over 40 keys in one tick; returns each slot's ids in order."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    ids = client.send_batch("q", [("e", {"n": n}, f"k{n % 40}") for n in range(events)])
    client.tick("q")
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    for n, ev in enumerate(ids):
        slot = scalar(client.conn, "select pgque.slot_of(%s, %s)", (f"k{n % 40}", slots))
        by_slot[slot].append(ev)
    return by_slot


@pytest.mark.both_clients
def test_every_slot_gets_its_own_events_in_order_in_pieces(client: pgque.Client) -> None:
    expected = fill(client, 4, 200)
    got: dict[int, list[int]] = {k: [] for k in range(4)}
    calls = 0
    while batches := client.receive_slots("q", "g", slots=4, owned=[3, 0, 1, 2], max_events=7):
        calls += 1
        assert [b.slot for b in batches] == sorted(b.slot for b in batches)  # ascending
        for batch in batches:
            assert batch.slots == 4 and len(batch) <= 7 and batch.fence is not None
            got[batch.slot].extend(m.id for m in batch)
        finished = client.ack_slots(batches)
        assert len(finished) == len(batches)
    assert got == expected
    assert calls >= max(len(ids) for ids in expected.values()) // 7
    # Nothing left for anyone.
    for slot in range(4):
        assert client.receive_partitioned("q", "g", slot=slot, slots=4) is None


@pytest.mark.both_clients
def test_it_is_what_receive_partitioned_returns_slot_by_slot(client: pgque.Client,
                                                             dsn: str) -> None:
    expected = fill(client, 4, 60)
    batches = client.receive_slots("q", "g", slots=4, owned=range(4))
    assert {b.slot: [m.id for m in b] for b in batches} == {
        k: ids for k, ids in expected.items() if ids}
    # Received, not acked: each slot's open batch is what receive_partitioned
    # gives again, the same batch.
    for batch in batches:
        again = client.receive_partitioned("q", "g", slot=batch.slot, slots=4)
        assert again is not None and again.batch_id == batch.batch_id
    assert client.ack_slots(batches) == [True] * len(batches)


@pytest.mark.both_clients
def test_a_slot_not_owned_receives_nothing_at_all(client: pgque.Client, dsn: str) -> None:
    fill(client, 4, 60)
    assert client.release_slot("q", "g", 2)
    with pgque.connect(dsn) as other:
        assert other.claim_slot("q", "g", 2)
        with pytest.raises(pgque.SlotNotOwned):
            client.receive_slots("q", "g", slots=4, owned=[0, 1, 2])
        # Nothing was opened for 0 and 1 by the failed call.
        cursors = client.conn.execute(
            "select count(*) from pgque.subscription s"
            " cross join lateral pgque._current_cursor(s.sub_id) c"
            " where s.sub_consumer like 'g#%%' and c.cur_batch is not null").fetchone()
        assert cursors == (0,)
        mine = client.receive_slots("q", "g", slots=4, owned=[0, 1])
        assert [b.slot for b in mine] == [0, 1]
        with pytest.raises(pgque.SlotNotOwned):
            other.ack_slots(mine)
        # Slot 2 is acked after 0 and 1 (ascending) and refused: so are they.
        theirs = pgque.Batch(queue="q", consumer="g", batch_id=0, messages=[], slot=2, slots=4)
        with pytest.raises(pgque.SlotNotOwned):
            client.ack_slots([*mine, theirs])
        # The failed ack acked none of mine: they are still open.
        for batch in mine:
            again = client.receive_partitioned("q", "g", slot=batch.slot, slots=4)
            assert again is not None and again.batch_id == batch.batch_id
        assert client.ack_slots(mine) == [True] * len(mine)


@pytest.mark.both_clients
def test_nacks_go_with_their_own_piece(client: pgque.Client) -> None:
    fill(client, 2, 40)
    batches = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    assert len(batches) == 2
    doomed = batches[1].messages[0].id
    client.ack_slots(batches, nack={doomed: "boom"}, retry_after=0)
    client.maintenance()  # the retry goes back into the log
    client.tick("q")
    again = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    assert [(b.slot, [m.id for m in b]) for b in again] == [(1, [doomed])]
    assert again[0].messages[0].retry_count == 1
    with pytest.raises(ValueError, match="none of these batches"):
        client.ack_slots(again, nack=[doomed + 10_000])
    client.ack_slots(again)


@pytest.mark.both_clients
def test_a_stale_batch_acks_none_of_them(client: pgque.Client) -> None:
    fill(client, 2, 40)
    batches = client.receive_slots("q", "g", slots=2, owned=[0, 1])
    client.ack(batches[1])  # acked on its own: its id is no longer open
    with pytest.raises(pgque.BatchNotActive):
        client.ack_slots(batches, nack=[batches[0].messages[0].id])
    with pytest.raises(pgque.BatchNotActive):
        client.ack_slots(batches)
    again = client.receive_partitioned("q", "g", slot=0, slots=2)
    assert again is not None and again.batch_id == batches[0].batch_id
    client.ack(again)


@pytest.mark.both_clients
@pytest.mark.parametrize(("owned", "error"), [
    ([0, 0], pgque.InvalidArgument), ([4], pgque.InvalidSlot), ([-1], pgque.InvalidSlot)])
def test_bad_slot_lists_are_refused(client: pgque.Client, owned: list[int],
                                    error: type[Exception]) -> None:
    fill(client, 4, 10)
    with pytest.raises(error):
        client.receive_slots("q", "g", slots=4, owned=owned)
    with pytest.raises(pgque.SlotCountMismatch):
        client.receive_slots("q", "g", slots=8, owned=[0])


@pytest.mark.both_clients
def test_the_sql_calls_check_their_arguments(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
    for statement, sqlstate in [
            ("select * from pgque.receive_slots('q', 'g', 2, null)", "22023"),
            ("select * from pgque.receive_slots('q', 'g', 2, '{0}', 0)", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, '{0,1}', '{1}')", "22023"),
            ("select * from pgque.receive_slots('nope', 'g', 2, '{0}')", "PQ001"),
            ("select * from pgque.receive_slots('q', 'nope', 2, '{0}')", "PQ002"),
            ("select * from pgque.receive_slots('q', 'g', 2, '{1}')", "PQ024")]:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(statement)
        assert caught.value.sqlstate == sqlstate, statement
        conn.rollback()


@pytest.mark.both_clients
def test_a_slot_never_subscribed_is_named(client: pgque.Client) -> None:
    """A group made slot by slot (subscribe_slot) may lack a slot: receive_slots
    and ack_slots refuse it as receive_partitioned does (ConsumerNotFound),
    naming the slot, and receive nothing for the others."""
    client.create_queue("q")
    client.conn.execute("select pgque.subscribe_slot('q', 'g', 0, 4)")
    client.conn.execute("select pgque.subscribe_slot('q', 'g', 2, 4)")
    client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
    client.tick("q")
    assert client.claim_slot("q", "g", 0) and client.claim_slot("q", "g", 2)
    with pytest.raises(pgque.ConsumerNotFound, match="g#1/4"):
        client.receive_slots("q", "g", slots=4, owned=[0, 1, 2])
    with pytest.raises(pgque.ConsumerNotFound, match="g#1/4"):
        client.receive_partitioned("q", "g", slot=1, slots=4)
    batches = client.receive_slots("q", "g", slots=4, owned=[0, 2])
    assert {b.slot for b in batches} <= {0, 2}
    fake = pgque.Batch(queue="q", consumer="g", batch_id=1, messages=[], slot=1, slots=4)
    with pytest.raises(pgque.ConsumerNotFound):
        client.ack_slots([*batches, fake])
    assert client.ack_slots(batches) == [True] * len(batches)


def test_ack_slots_of_empty_lists_returns_an_empty_array(conn: psycopg.Connection[Any]) -> None:
    """receive_slots of an empty list returns no rows; ack_slots of empty lists
    returns an empty array (nothing to ack)."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
    assert conn.execute("select * from pgque.receive_slots('q', 'g', 2, '{}')").fetchall() == []
    assert scalar(conn, "select pgque.ack_slots('q', 'g', 2, '{}', '{}')") == []


def test_ack_slots_refuses_a_null_slot_list_as_receive_slots_does(
        conn: psycopg.Connection[Any]) -> None:
    """A null slot list is refused (22023) by ack_slots as by receive_slots,
    even with a null batch list beside it: never taken for an empty ack."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select * from pgque.receive_slots('q', 'g', 4, null)")
    assert info.value.sqlstate == "22023"
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select pgque.ack_slots('q', 'g', 4, null, null)")
    assert info.value.sqlstate == "22023"


def test_bad_arguments_get_specific_sqlstates(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 2)")
    conn.execute("select pgque.claim_slot('q', 'g', 0), pgque.claim_slot('q', 'g', 1)")
    for statement, sqlstate in [
            ("select * from pgque.receive_slots('q', 'g', 2, '{null}')", "PQ023"),
            ("select * from pgque.receive_slots('q', 'g', 0, '{0}')", "PQ022"),
            ("select * from pgque.receive_slots('q', 'g', 2, '{0,1}', -1)", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, '{0,1}', '{null,null}')", "PQ003"),
            ("select pgque.ack_slots('q', 'g', 2, '{0,1}', null)", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, null, '{1}')", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, '{1,1}', '{1,1}')", "22023"),
            ("select pgque.ack_slots('q', 'g', 2, '{2}', '{1}')", "PQ023"),
            ("select pgque.ack_slots('q', 'g', 3, '{0}', '{1}')", "PQ020"),
            ("select pgque.ack_slots('q', 'nope', 2, '{0}', '{1}')", "PQ002"),
            ("select pgque.ack_slots('nope', 'g', 2, '{0}', '{1}')", "PQ001")]:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(statement)
        assert caught.value.sqlstate == sqlstate, statement


def test_ack_slots_refuses_odd_lists_and_acks_none(client: pgque.Client) -> None:
    """Slot and batch lists that do not pair up (lengths, nulls, slots out of
    range or twice, another group's or a swapped batch, another slot count)
    are refused with their SQLSTATE; a slot lost acks none of the batches, not
    even those of the slots before it."""
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
    assert all(slot_cursor(client, f"g#{k}/4")[1] == g[k].batch_id for k in range(4))
    assert client.claim_slot("q", "g", 3)
    assert client.ack_slots([g[2], g[0], g[1], g[3]]) == [True] * 4
    assert conn.execute("select pgque.ack_slots('q', 'g', 4, '{}', '{}')").fetchone() == ([],)


@pytest.mark.both_clients
def test_ack_slots_with_nacks_is_all_or_none(client: pgque.Client) -> None:
    """An ack with nacks of which one slot is no longer owned writes nothing:
    no retry, no nack, every batch still open."""
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
    assert all(slot_cursor(client, f"g#{b.slot}/4")[1] == b.batch_id for b in batches)


def test_receive_slots_of_a_terminated_session_are_received_again(
        client: pgque.Client, dsn: str) -> None:
    """Pieces handed out to a session that is then terminated (never acked) are
    received again, all of them, by the next owner of the slots."""
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


# -- roles ---------------------------------------------------------------------------------


def _denied(call: Any) -> bool:
    """Whether call fails for want of a right: pgque's PQ014/PQ015, or 42501."""
    try:
        call()
    except pgque.AccessDenied:
        return True
    except psycopg.Error as exc:
        return exc.sqlstate == "42501"
    return False


@pytest.mark.both_clients
def test_slot_sets_respect_roles(role_clients: dict[str, pgque.Client]) -> None:
    """Only the group's owner receives, acks and lists pending slots of its group:
    another reader, a writer and a role outside pgque are refused; an admin may
    use the group but owns no slot."""
    reader, other, writer, admin = (role_clients[k] for k in ("reader", "other", "writer",
                                                              "admin"))
    admin.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
    admin.tick("q")
    for slot in range(4):
        assert reader.claim_slot("q", "g", slot)
    for client in (other, writer, role_clients["nobody"]):
        assert _denied(lambda c=client: c.receive_slots("q", "g", slots=4, owned=range(4)))
    batches = reader.receive_slots("q", "g", slots=4, owned=range(4))
    assert sum(len(b) for b in batches) == 20
    for client in (other, writer, role_clients["nobody"]):
        assert _denied(lambda c=client: c.ack_slots(batches))
        assert _denied(lambda c=client: c.pending_slots("q", "g"))
    assert reader.pending_slots("q", "g") == {b.slot for b in batches}
    assert all(reader.ack_slots(batches))
    assert reader.pending_slots("q", "g") == frozenset()
    # An admin may use the group (admins act for every role), but owns no slot.
    assert refused(lambda: admin.receive_slots("q", "g", slots=4, owned=[0]),
                   pgque.SlotNotOwned)


@pytest.fixture
def team(dsn: str) -> Iterator[str]:
    """A login role that may consume group g of queue q only while granted it."""
    role = f"rv_team_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login in role pgque_reader")
        try:
            yield role
        finally:
            su.execute(f"drop owned by {role}")
            su.execute(f"drop role {role}")


def waits_on_lock(watch: psycopg.Connection[Any], pid: int) -> bool:
    return bool(scalar(watch, "select coalesce(wait_event_type = 'Lock', false) "
                              "from pg_stat_activity where pid = %s", (pid,)))


@pytest.mark.parametrize("call", [
    "receive_partitioned",       # the reference
    "receive_slots_together",    # every slot goes together
    "receive_slots_some",        # slot 1 has an open batch: slot 0 alone goes together
])
def test_a_slot_taken_over_mid_call_is_refused(dsn: str, team: str, call: str) -> None:
    """A session S owning slots 0 and 1 starts a receive, and while it reads the
    batch (held here by a lock on the event tables) its role loses the group
    and another session claims slot 0, which renews the slot's key (as
    claim_slot does when the holder does not count). The receive checks the
    owner again once it holds the slot's receive lock, by the subscription as
    it is then: it refuses (PQ024) and hands out nothing of slot 0, whichever
    path it takes."""
    tdsn = make_conninfo("", **{**conninfo_to_dict(dsn), "user": team})
    with psycopg.connect(dsn, autocommit=True) as su, \
            psycopg.connect(tdsn, autocommit=True) as s, \
            psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as thief:
        su.execute("select pgque.create_queue('q')")
        su.execute("select pgque.subscribe_slots('q', 'g', 2)")
        su.execute("select pgque.grant_consumer('q', 'g', %s)", (team,))
        su.execute("select pgque.maint('q')")
        su.execute("select pgque.send('q', 'e', '1', k) from unnest(%s::text[]) k",
                   (["a", "b", "c", "d", "e", "f"],))
        su.execute("select pgque.tick('q')")
        qid = scalar(su, "select queue_id from pgque.queue where queue_name = 'q'")
        assert s.execute("select pgque.claim_slot('q', 'g', 0), "
                         "pgque.claim_slot('q', 'g', 1)").fetchone() == (True, True)
        if call == "receive_slots_some":
            assert s.execute("select * from pgque.receive_partitioned('q', 'g', 1, 2)").fetchall()
            su.execute("select pgque.send('q', 'e', '1', k) from unnest(%s::text[]) k",
                       (["a", "b", "c", "d", "e", "f"],))
            su.execute("select pgque.tick('q')")
        statement = ("select 0, ev_id from pgque.receive_partitioned('q', 'g', 0, 2)"
                     if call == "receive_partitioned"
                     else "select slot, ev_id from pgque.receive_slots('q', 'g', 2, '{0,1}')")
        blocker.execute(f"lock table pgque.event_{qid} in access exclusive mode")
        out: dict[str, Any] = {}

        def receive() -> None:
            try:
                out["rows"] = s.execute(statement).fetchall()
            except psycopg.Error as error:
                out["sqlstate"] = error.sqlstate
        thread = threading.Thread(target=receive)
        thread.start()
        try:
            wait_for(lambda: waits_on_lock(su, s.info.backend_pid), what="the receive to wait")
            su.execute("select pgque.revoke_consumer('q', 'g', %s)", (team,))
            assert scalar(thief, "select pgque.claim_slot('q', 'g', 0)") is True
        finally:
            blocker.rollback()
            thread.join(10)
        assert out.get("sqlstate") == "PQ024", \
            f"{call} handed out {out.get('rows')} of slot 0, owned by another session"


# -- the order of the slots' locks ---------------------------------------------------------


def row_locked(dsn: str, consumer: str) -> bool:
    """Whether another transaction holds subscription ``consumer``'s row lock."""
    with psycopg.connect(dsn) as probe:
        probe.execute("set lock_timeout = '100ms'")
        try:
            probe.execute("select 1 from pgque.subscription where sub_consumer = %s for update",
                          (consumer,))
        except psycopg.errors.LockNotAvailable:
            return True
        return False


def test_sql_calls_lock_in_ascending_slot_order(dsn: str) -> None:
    """receive_slots (every slot together: one statement) and the SQL ack_slots wait
    for slot 0's lock before taking any other."""
    with psycopg.connect(dsn, autocommit=True) as su, psycopg.connect(dsn) as blocker, \
            psycopg.connect(dsn, autocommit=True) as owner:
        su.execute("select pgque.create_queue('q')")
        su.execute("select pgque.subscribe_slots('q', 'g', 4)")
        su.execute("select pgque.maint('q')")
        su.execute("select pgque.send('q', 'e', '1', 'k' || n) from generate_series(1, 40) n")
        su.execute("select pgque.tick('q')")
        owner.execute("select pgque.claim_slot('q', 'g', k) from generate_series(0, 3) k")
        for statement in ["select * from pgque.receive_slots('q', 'g', 4, '{3,1,2,0}')",
                          "select pgque.ack_slots('q', 'g', 4, '{3,2,1,0}', "
                          " array(select c.cur_batch from pgque.subscription s cross join lateral"
                          " pgque._current_cursor(s.sub_id) c where s.sub_consumer like 'g#%%'"
                          " order by s.sub_consumer desc))"]:
            blocker.execute("select 1 from pgque.subscription where sub_consumer = 'g#0/4' "
                            "for update")
            out: dict[str, Any] = {}

            def run(statement: str = statement, out: dict[str, Any] = out) -> None:
                out["rows"] = owner.execute(statement).fetchall()
            thread = threading.Thread(target=run)
            thread.start()
            try:
                wait_for(lambda: waits_on_lock(su, owner.info.backend_pid),
                         what="the call to wait for slot 0")
                locked = [row_locked(dsn, f"g#{k}/4") for k in (1, 2, 3)]
            finally:
                blocker.rollback()
                thread.join(10)
            assert out["rows"] and locked == [False, False, False], statement


def test_ack_slots_with_nacks_locks_in_ascending_slot_order(client: pgque.Client,
                                                            dsn: str) -> None:
    """Client.ack_slots with a nack takes the slots' receive locks in ascending
    slot order too, the nacked pieces' acks among the others: while it waits for
    slot 0's lock it holds no other slot's, so it cannot deadlock with another
    transaction locking the group's slots in ascending order (a stale session's
    ack_slots)."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.maintenance("q")
    client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
    client.tick("q")
    for k in range(4):
        assert client.claim_slot("q", "g", k)
    batches = client.receive_slots("q", "g", slots=4, owned=range(4))
    assert [b.slot for b in batches] == [0, 1, 2, 3]
    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as watch:
        blocker.execute("select 1 from pgque.subscription where sub_consumer = 'g#0/4' "
                        "for update")
        out: dict[str, Any] = {}

        def ack() -> None:
            try:
                out["done"] = client.ack_slots(batches, nack=[batches[2].messages[0]])
            except Exception as error:
                out["error"] = error
        thread = threading.Thread(target=ack)
        thread.start()
        try:
            wait_for(lambda: waits_on_lock(watch, client.conn.info.backend_pid),
                     what="the ack to wait for slot 0")
            slot_2_locked_first = row_locked(dsn, "g#2/4")
        finally:
            blocker.rollback()
            thread.join(10)
    assert out.get("done") == [True, True, True, True]
    assert not slot_2_locked_first, "slot 2 was locked before slot 0"


# -- the read of every slot together -------------------------------------------------------


def test_the_read_together_keeps_at_most_max_events_plus_one_per_slot(
        conn: psycopg.Connection[Any]) -> None:
    """The span read asked for at most 3 events per slot returns the first 3 (by
    ev_id) of each slot asked for, and no more, not the whole batch (the long
    form is the test below)."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 8)")
    conn.execute("select pgque.maint('q')")
    conn.execute("select pgque.send('q', 'e', n::text, 'k' || n) from generate_series(1, 200) n")
    conn.execute("select pgque.tick('q')")
    rows = conn.execute(
        "select pgque.slot_of(e.ev_extra1, 8), e.ev_id"
        "  from pgque.queue q, lateral (select t.tick_snapshot from pgque.tick t"
        "                               where t.tick_queue = q.queue_id"
        "                               order by t.tick_id limit 1) p,"
        "       lateral (select t.tick_snapshot from pgque.tick t"
        "                 where t.tick_queue = q.queue_id"
        "                 order by t.tick_id desc limit 1) n,"
        "       unnest(pgque._run_reader(q.queue_id, row(pg_snapshot_xmax(p.tick_snapshot),"
        "              array(select pg_snapshot_xip(p.tick_snapshot)),"
        "              pg_snapshot_xmax(n.tick_snapshot), n.tick_snapshot, null, null, null, null,"
        "              null, 8, 3, '{1,4,6}', (select array_agg(s.sub_id) from pgque.subscription s"
        "                           where s.sub_queue = q.queue_id), null, false)"
        "              ::pgque.read_request)) e"
        " where q.queue_name = 'q'").fetchall()
    everything = conn.execute(
        "select pgque.slot_of(ev_extra1, 8), ev_id from pgque.event_1 order by ev_id").fetchall()
    wanted = [r for k in (1, 4, 6) for r in [e for e in everything if e[0] == k][:3]]
    assert sorted(rows, key=lambda r: r[1]) == sorted(wanted, key=lambda r: r[1])


@pytest.mark.long
@pytest.mark.skipif(not LONG, reason="long variant: PGQUE_TEST_LONG=1 (make test-long)")
def test_max_events_bounds_the_read_of_a_large_batch(conn: psycopg.Connection[Any]) -> None:
    """max_events bounds what receive_slots reads of each slot, as it bounds
    receive_partitioned's read (max_events + 1 events of the slot): a batch of
    1.1 GB of payloads (1100 events of 1 MB, stored compressed in a few MB) is
    handed out 100 events per slot, never built whole into one array (which
    fails with 54000 'array size exceeds the maximum allowed')."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 8)")
    conn.execute("select pgque.maint('q')")
    conn.execute("""select pgque.send('q', 'e', '"' || repeat('x', 1000000) || '"', 'k' || n)
                      from generate_series(1, 1100) n""")
    conn.execute("select pgque.tick('q')")
    conn.execute("select pgque.claim_slot('q', 'g', k) from generate_series(0, 7) k")
    assert scalar(conn, "select count(*) from pgque.receive_partitioned('q', 'g', 0, 8, 100)") \
        == 100
    pieces = conn.execute("select slot, count(*) from pgque.receive_slots('q', 'g', 8, "
                          "'{1,2,3,4,5,6,7}', 100) group by slot").fetchall()
    assert len(pieces) == 7 and all(n == 100 for _, n in pieces)
