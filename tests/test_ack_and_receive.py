"""Ack and the next receive in one call (pgque.ack_receive_partitioned,
Client.ack_and_receive): a slot worked piece after piece gets exactly what
receive_partitioned + ack would give it, and a refused call acks nothing: bad
arguments and an error in the receive half leave the cursor as it was. Nacks
come back as retries and then dead letters, the piece carries its owner's
fencing epoch, and the function is granted as ack_partitioned is.

The tests marked both_clients run with the Client and the AsyncClient (conftest.py)."""

from __future__ import annotations

import builtins
import re
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import owned_group, scalar
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

SLOTS = 4
DOCS = Path(__file__).resolve().parent.parent / "docs"


def fill(client: pgque.Client, per_tick: int, *, ticks: int = 1,
         **queue: Any) -> dict[int, list[int]]:
    """Queue q, group g of SLOTS slots all owned by ``client`` (helpers.owned_group)."""
    return owned_group(client, per_tick, ticks=ticks, slots=SLOTS, **queue)


def open_batch(client: pgque.Client, slot: int) -> int | None:
    [info] = [r for r in client.consumer_info("q") if r.consumer_name == f"g#{slot}/{SLOTS}"]
    return info.open_batch_id


@pytest.mark.both_clients
def test_each_slot_gets_its_events_in_order_across_pieces_and_batches(
        client: pgque.Client) -> None:
    expected = fill(client, ticks=3, per_tick=90)
    for slot in range(SLOTS):
        got: list[int] = []
        calls = 0
        batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=4)
        while batch is not None:
            assert batch.slot == slot and len(batch) <= 4 and batch.fence is not None
            got += [m.id for m in batch]
            calls += 1
            batch = client.ack_and_receive(batch, max_events=4)
        assert got == expected[slot]
        assert calls >= len(expected[slot]) // 4
        # The last piece was acked by the call that found nothing after it.
        assert open_batch(client, slot) is None
        assert client.receive_partitioned("q", "g", slot=slot, slots=SLOTS) is None


@pytest.mark.both_clients
def test_nacks_go_to_retry_with_the_ack(client: pgque.Client) -> None:
    expected = fill(client, ticks=1, per_tick=40)
    slot = max(expected, key=lambda k: len(expected[k]))
    batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
    assert batch is not None
    failed = batch.messages[1]
    rest = client.ack_and_receive(batch, nack={failed.id: "broken"}, max_events=100)
    assert rest is not None and [m.id for m in rest] == expected[slot][3:]
    [info] = [r for r in client.consumer_info("q") if r.consumer_name == f"g#{slot}/{SLOTS}"]
    assert info.retries_waiting == 1
    assert client.ack_and_receive(rest) is None


@pytest.mark.both_clients
def test_a_session_that_does_not_own_the_slot_acks_nothing(client: pgque.Client,
                                                            dsn: str) -> None:
    fill(client, ticks=1, per_tick=40)
    batch = client.receive_partitioned("q", "g", slot=1, slots=SLOTS, max_events=2)
    assert batch is not None
    with pgque.connect(dsn) as other, pytest.raises(pgque.SlotNotOwned):
        other.ack_and_receive(batch)
    assert open_batch(client, 1) == batch.batch_id
    # The owner gets the same piece again: nothing moved.
    again = client.receive_partitioned("q", "g", slot=1, slots=SLOTS, max_events=2)
    assert again is not None and [m.id for m in again] == [m.id for m in batch]


@pytest.mark.both_clients
def test_a_stale_batch_or_bad_argument_changes_nothing(client: pgque.Client) -> None:
    fill(client, ticks=1, per_tick=40)
    first = client.receive_partitioned("q", "g", slot=2, slots=SLOTS)
    assert first is not None and client.ack(first)  # the whole first batch
    client.send_batch("q", [("e", {"n": n}, f"k{n % 30}") for n in range(40)])
    client.tick("q")
    second = client.receive_partitioned("q", "g", slot=2, slots=SLOTS, max_events=1)
    assert second is not None and second.batch_id != first.batch_id
    with pytest.raises(pgque.BatchNotActive):
        client.ack_and_receive(first)
    with pytest.raises(pgque.InvalidArgument):
        client.ack_and_receive(second, max_events=0)
    assert open_batch(client, 2) == second.batch_id
    again = client.receive_partitioned("q", "g", slot=2, slots=SLOTS, max_events=1)
    assert again is not None and [m.id for m in again] == [m.id for m in second]


@pytest.mark.both_clients
def test_a_plain_batch_is_refused_before_any_call(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    with pytest.raises(ValueError, match="slot"):
        client.ack_and_receive(batch)
    assert client.ack(batch) is True  # still open: nothing was sent to the server


@pytest.mark.both_clients
def test_a_reader_role_may_call_it(client: pgque.Client, dsn: str) -> None:
    expected = fill(client, ticks=1, per_tick=30)
    for slot in range(SLOTS):
        client.release_slot("q", "g", slot)
    name = f"pgque_test_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {name} login in role pgque_reader")
        su.execute("select pgque.grant_consumer('q', 'g', %s)", (name,))
        try:
            with pgque.connect(make_conninfo(**{**conninfo_to_dict(dsn), "user": name})) as rd:
                assert rd.claim_slot("q", "g", 0)
                got: list[int] = []
                batch = rd.receive_partitioned("q", "g", slot=0, slots=SLOTS, max_events=2)
                while batch is not None:
                    got += [m.id for m in batch]
                    batch = rd.ack_and_receive(batch, max_events=2)
                assert got == expected[0]
        finally:
            su.execute(f"drop owned by {name}")
            su.execute(f"drop role {name}")


@pytest.mark.both_clients
def test_the_sql_function_refuses_a_non_owner_with_its_sqlstate(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    fill(client, ticks=1, per_tick=10)
    batch = client.receive_partitioned("q", "g", slot=0, slots=SLOTS)
    assert batch is not None
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("select * from pgque.ack_receive_partitioned('q', 'g', 0, %s, %s, "
                     "'{}', '{}', '0', null)", (SLOTS, batch.batch_id))
    assert raised.value.sqlstate == "PQ024"
    assert open_batch(client, 0) == batch.batch_id


@pytest.mark.both_clients
def test_the_next_piece_carries_the_epoch_and_a_new_claim_takes_a_new_one(
        client: pgque.Client) -> None:
    expected = fill(client, ticks=1, per_tick=60)
    slot = max(expected, key=lambda k: len(expected[k]))
    first = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
    assert first is not None and first.fence is not None
    second = client.ack_and_receive(first, max_events=2)
    assert second is not None and second.fence == first.fence
    assert all(m.fence == first.fence for m in second)
    # Released and claimed again by the same session: its old epoch ended. The
    # ack still holds (the session owns the slot), but the receive is left to
    # receive_partitioned, which takes the new epoch.
    assert client.release_slot("q", "g", slot) and client.claim_slot("q", "g", slot)
    assert client.ack_and_receive(second, max_events=2) is None
    third = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
    assert third is not None and third.fence is not None
    assert third.fence.epoch > first.fence.epoch
    assert [m.id for m in third] == expected[slot][4:6]
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(first.fence)


def cursor_state(conn: Any, slot: int) -> tuple[Any, ...]:
    """The slot's newest cursor row (its whole state)."""
    return tuple(conn.execute(
        "select c.cur_seq, c.cur_last_tick, c.cur_batch, c.cur_pos, c.cur_handed, c.cur_end "
        "from pgque.cursor c join pgque.subscription s on s.sub_id = c.cur_sub "
        "where s.sub_consumer = %s order by c.cur_seq desc limit 1",
        (f"g#{slot}/{SLOTS}",)).fetchone())


def fused_sql(conn: Any, slot: Any, slots: Any, batch_id: Any, ids: Any = "{}",
              reasons: Any = "{}", retry: Any = "0", max_events: Any = None) -> list[Any]:
    return conn.execute(
        "select * from pgque.ack_receive_partitioned('q', 'g', %s, %s, %s, %s::bigint[], "
        "%s::text[], %s::interval, %s)",
        (slot, slots, batch_id, ids, reasons, retry, max_events)).fetchall()


@pytest.mark.both_clients
def test_bad_arguments_are_refused_and_change_nothing(client: pgque.Client) -> None:
    """Each bad argument of the SQL function (slot, slot count, batch, max_events,
    nack ids and reasons, retry_after) is refused with its SQLSTATE and leaves
    the cursor, the retries and the dead letters as they were; null nack arrays
    mean no nacks, a null slot count the group's."""
    expected = fill(client, per_tick=60)
    slot = max(expected, key=lambda k: len(expected[k]))
    batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
    assert batch is not None
    before = cursor_state(client.conn, slot)
    handed = [m.id for m in batch]
    not_handed = expected[slot][5]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("PQ023", {"slot": None}),
        ("PQ023", {"slot": SLOTS}),
        ("PQ022", {"slots": 0}),
        ("PQ020", {"slots": SLOTS * 2, "slot": 1}),
        ("PQ003", {"batch_id": None}),
        ("PQ003", {"batch_id": batch.batch_id + 1000}),
        ("22023", {"max_events": 0}),
        ("22023", {"max_events": -1}),
        ("PQ010", {"ids": [not_handed], "reasons": ["r"]}),
        ("PQ010", {"ids": [None], "reasons": ["r"]}),
        ("22023", {"ids": handed[:1]}),  # ids without reasons (one for all, or one each)
        ("22023", {"ids": handed[:2], "reasons": ["a", "b", "c"]}),
        ("22023", {"ids": handed[:1], "reasons": ["r"], "retry": "-1 second"}),
        ("22023", {"ids": handed[:1], "reasons": ["r"], "retry": None}),
        # Without nacks too, as the ack with nacks.
        ("22023", {"retry": "-1 second"}),
        ("22023", {"retry": None}),
    ]
    for sqlstate, change in cases:
        args: dict[str, Any] = {"slot": slot, "slots": SLOTS, "batch_id": batch.batch_id,
                                **change}
        with pytest.raises(psycopg.Error) as raised:
            fused_sql(client.conn, **args)
        assert raised.value.sqlstate == sqlstate, (change, raised.value)
        assert cursor_state(client.conn, slot) == before, change
    assert not client.dead_letters("q")
    [info] = [r for r in client.consumer_info("q") if r.consumer_name == f"g#{slot}/{SLOTS}"]
    assert info.retries_waiting == 0
    # Null nack arrays mean no nacks; null slots means the group's count.
    rows = fused_sql(client.conn, slot, None, batch.batch_id, ids=None, reasons=None,
                     max_events=3)
    assert [r[1] for r in rows] == expected[slot][3:6]
    assert all(r[7] == batch.fence.epoch for r in rows)  # type: ignore[union-attr]


@pytest.mark.both_clients
def test_an_error_in_the_receive_half_undoes_the_ack(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The receive reads the event tables; when that read fails (here a lock
    timeout against a session holding the queue's event table), the ack made
    first in the same call does not stay."""
    expected = fill(client, per_tick=60)
    slot = max(expected, key=lambda k: len(expected[k]))
    batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
    assert batch is not None
    before = cursor_state(conn, slot)
    table = scalar(conn, "select 'pgque.event_' || queue_id from pgque.queue "
                         "where queue_name = 'q'")
    client.conn.execute("set lock_timeout = '200ms'")
    with psycopg.connect(dsn) as holder:
        holder.execute(f"lock table {table} in access exclusive mode")
        with pytest.raises(psycopg.Error) as raised:
            client.ack_and_receive(batch, max_events=3)
        assert raised.value.sqlstate == "55P03"
        holder.rollback()
    client.conn.execute("reset lock_timeout")
    assert cursor_state(conn, slot) == before  # the ack went with the receive
    again = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
    assert again is not None and [m.id for m in again] == [m.id for m in batch]
    nxt = client.ack_and_receive(again, max_events=3)
    assert nxt is not None and [m.id for m in nxt] == expected[slot][3:6]


FUSED = ("pgque.ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],"
         "interval,integer)")


def test_granted_to_reader_and_admin_only(conn: psycopg.Connection[Any], dsn: str) -> None:
    """pgque_reader and pgque_admin may execute the function, as they may
    ack_partitioned with its nacks; pgque_writer, PUBLIC and a role in neither
    may not."""
    assert scalar(conn, "select has_function_privilege('pgque_reader', %s, 'execute')",
                  (FUSED,))
    assert scalar(conn, "select has_function_privilege('pgque_admin', %s, 'execute')",
                  (FUSED,))
    assert not scalar(conn, "select has_function_privilege('pgque_writer', %s, 'execute')",
                      (FUSED,))
    assert not scalar(conn, "select has_function_privilege('public', %s, 'execute')",
                      (FUSED,))
    # The same grantees as ack_partitioned with its nacks, the function it extends.
    acl = ("select array(select r.rolname from pg_proc p cross join lateral "
           "aclexplode(p.proacl) a join pg_roles r on r.oid = a.grantee "
           "where p.oid = %s::regprocedure "
           "and r.rolname like 'pgque%%' order by 1)")
    assert scalar(conn, acl, (FUSED,)) == scalar(
        conn, acl, ("pgque.ack_partitioned(text,text,integer,integer,bigint,bigint[],text[],"
                    "interval)",))
    client = pgque.connect(dsn)
    try:
        fill(client, per_tick=20)
        batch = client.receive_partitioned("q", "g", slot=0, slots=SLOTS)
        assert batch is not None
        for member_of in ("pgque_writer", None):
            name = f"pgque_test_{uuid.uuid4().hex[:8]}"
            conn.execute(f"create role {name} login"
                         + (f" in role {member_of}" if member_of else ""))
            try:
                dsn_as = make_conninfo(dsn, user=name)
                with (psycopg.connect(dsn_as, autocommit=True) as other,
                      pytest.raises(psycopg.errors.InsufficientPrivilege)):
                    fused_sql(other, 0, SLOTS, batch.batch_id)
            finally:
                conn.execute(f"drop owned by {name}")
                conn.execute(f"drop role {name}")
        assert client.ack(batch) is not None
    finally:
        client.close()


@pytest.mark.both_clients
def test_nacked_events_come_back_then_go_to_dead_letters(client: pgque.Client) -> None:
    """Every piece acked with ack_and_receive and its nacks; one event fails every
    time: it is retried max_retries times on its slot, then dead-lettered, and
    every other event is seen exactly once, in order."""
    expected = fill(client, per_tick=40, max_retries=2)
    slot = max(expected, key=lambda k: len(expected[k]))
    poison = expected[slot][4]
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 8
    while not client.dead_letters("q") and time.monotonic() < deadline:
        batch = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=3)
        while batch is not None:
            seen += [(m.id, m.retry_count) for m in batch]
            failed = {m.id: "poison" for m in batch if m.id == poison}
            batch = client.ack_and_receive(batch, nack=failed, retry_after=0, max_events=3)
        client.maintenance()  # moves the due retries back into the log
        client.tick("q")
    [letter] = client.dead_letters("q")
    assert letter.event_id == poison and letter.reason == "poison"
    assert [r for i, r in seen if i == poison] == [0, 1, 2]
    assert [i for i, _ in seen if i != poison] == [i for i in expected[slot] if i != poison]


@pytest.mark.both_clients
def test_the_fused_epoch_fences_like_the_received_one(client: pgque.Client, dsn: str) -> None:
    """A piece from ack_and_receive carries the epoch receive_partitioned gave:
    a handler's check_fence under it holds the epoch while its transaction is
    open, the slot's next owner receives nothing until it ends, and then a
    newer epoch; the old owner's pieces and fences are refused."""
    expected = fill(client, per_tick=60)
    slot = max(expected, key=lambda k: len(expected[k]))
    first = client.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
    assert first is not None and first.fence is not None
    second = client.ack_and_receive(first, max_events=2)
    assert second is not None and second.fence == first.fence
    with pgque.connect(dsn) as handler_side, pgque.connect(dsn) as other:
        handler_side.check_fence(second.fence)  # a handler's check passes
        handler_side.conn.execute("begin")
        handler_side.check_fence(second.fence)  # and holds the epoch while open
        # The owner goes on under the same epoch meanwhile (no new one, no wait).
        third = client.ack_and_receive(second, max_events=2)
        assert third is not None and third.fence == first.fence
        # The slot moves while the handler's transaction still holds the epoch:
        # the new owner receives nothing until that transaction ends.
        assert client.release_slot("q", "g", slot)
        assert other.claim_slot("q", "g", slot)
        assert other.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2) is None
        handler_side.conn.execute("commit")
        with pytest.raises(pgque.StaleEpoch):
            handler_side.check_fence(first.fence)
        fourth = other.receive_partitioned("q", "g", slot=slot, slots=SLOTS, max_events=2)
        assert fourth is not None and fourth.fence is not None
        assert fourth.fence.epoch > first.fence.epoch
        assert [m.id for m in fourth] == [m.id for m in third]  # third was never acked
        with pytest.raises(pgque.SlotNotOwned):
            client.ack_and_receive(third, max_events=2)
        fifth = other.ack_and_receive(fourth, max_events=2)
        assert fifth is not None and fifth.fence == fourth.fence
        assert [m.id for m in fifth] == expected[slot][6:8]
        other.check_fence(fifth.fence)  # type: ignore[arg-type]
        with pytest.raises(pgque.StaleEpoch):
            client.check_fence(third.fence)  # type: ignore[arg-type]


def test_the_errors_the_docs_name_for_it_exist() -> None:
    """api.md's row for ack_and_receive (and the method's docstring) name the
    errors it raises: each is a pgque error class."""
    [row] = [line for line in (DOCS / "api.md").read_text().splitlines()
             if line.startswith("| `ack_and_receive(")]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", row))
    doc = pgque.Client.ack_and_receive.__doc__ or ""
    named |= set(re.findall(r"\b([A-Z][a-z]+(?:[A-Z][a-z]+)+)\b", doc))
    assert named, row
    missing = sorted(name for name in named
                     if not hasattr(pgque, name) and not hasattr(builtins, name))
    assert not missing, f"no such error: {missing}"
