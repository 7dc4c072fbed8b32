"""Review of the fused ack + receive (pgque.ack_receive_partitioned,
Client.ack_and_receive, the Worker's lanes using it) and of session_ended's
read without select(): attacks on its arguments, privileges, atomicity,
retries and dead letters, fencing epochs, and a worker's order, rebalancing
and stop under sustained load."""

from __future__ import annotations

import asyncio
import builtins
import re
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import owned_group, scalar, wait_for
from psycopg.conninfo import make_conninfo

import pgque
from pgque import client as client_sync
from pgque import client_async
from pgque.lifecycle import CallWatch, session_ended
from pgque.lifecycle_async import AsyncCallWatch
from pgque.lifecycle_async import session_ended as asession_ended

SLOTS = 4
DOCS = Path(__file__).resolve().parent.parent / "docs"


def fill(client: pgque.Client, per_tick: int, *, ticks: int = 1,
         **queue: Any) -> dict[int, list[int]]:
    """Queue q, group g of SLOTS slots all owned by ``client`` (helpers.owned_group)."""
    return owned_group(client, per_tick, ticks=ticks, slots=SLOTS, **queue)


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


# -- the SQL function's arguments -------------------------------------------


@pytest.mark.both_clients
def test_bad_arguments_are_refused_and_change_nothing(client: pgque.Client) -> None:
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
        # Without nacks too, as the ack with nacks (it used to be let through).
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
    first in the same call must not stay."""
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


# -- privileges --------------------------------------------------------------


FUSED = ("pgque.ack_receive_partitioned(text,text,integer,integer,bigint,bigint[],text[],"
         "interval,integer)")


def test_granted_to_reader_and_admin_only(conn: psycopg.Connection[Any], dsn: str) -> None:
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


# -- retries and dead letters through the fused call -------------------------


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


# -- fencing epochs ------------------------------------------------------------


@pytest.mark.both_clients
def test_the_fused_epoch_fences_like_the_received_one(client: pgque.Client, dsn: str) -> None:
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


# -- the docs ------------------------------------------------------------------


def test_the_errors_the_docs_name_for_it_exist() -> None:
    """api.md's row for ack_and_receive (and the method's docstring) name the
    errors it raises: each must be a pgque error class."""
    [row] = [line for line in (DOCS / "api.md").read_text().splitlines()
             if line.startswith("| `ack_and_receive(")]
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", row))
    doc = pgque.Client.ack_and_receive.__doc__ or ""
    named |= set(re.findall(r"\b([A-Z][a-z]+(?:[A-Z][a-z]+)+)\b", doc))
    assert named, row
    missing = sorted(name for name in named
                     if not hasattr(pgque, name) and not hasattr(builtins, name))
    assert not missing, f"no such error: {missing}"


# -- session_ended without select() --------------------------------------------


def test_session_ended_on_pending_notify_shut_socket_and_live_idle(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    listener = psycopg.connect(dsn, autocommit=True)
    try:
        listener.execute("listen pgque_review")
        assert not session_ended(listener)  # nothing to read: returns at once
        conn.execute("notify pgque_review, 'x'")
        # The notification is on the socket (or in libpq's buffer): not an end.
        for _ in range(20):
            assert not session_ended(listener)
        assert scalar(listener, "select 1") == 1  # still usable
        watch = CallWatch(listener, deadline=30.0)
        assert not watch.gone()
        watch.abort()  # the socket shut down under it
        assert watch.gone()
        assert session_ended(listener)
    finally:
        listener.close()
    assert session_ended(listener)

    async def async_side() -> None:
        aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            await aconn.execute("listen pgque_review")
            assert not asession_ended(aconn)
            conn.execute("notify pgque_review, 'y'")
            for _ in range(20):
                assert not asession_ended(aconn)
            cur = await aconn.execute("select 1")
            assert await cur.fetchone() == (1,)
            watch = AsyncCallWatch(aconn, deadline=30.0)
            assert not watch.gone()
            watch.abort()
            assert watch.gone() and asession_ended(aconn)
        finally:
            await aconn.close()
        assert asession_ended(aconn)

    asyncio.run(async_side())


# -- the Worker under sustained load ------------------------------------------


def make_backlog(client: pgque.Client, n: int, keys: int) -> list[int]:
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=200)
    client.subscribe_slots("q", "g", slots=2)
    return client.send_batch("q", [("e", i, f"k{i % keys}") for i in range(n)])


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the lanes' ack_and_receive calls (either client flavour)."""
    calls = [0]
    sync_method = client_sync.Client.ack_and_receive
    async_method = client_async.AsyncClient.ack_and_receive

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return sync_method(self, *args, **kwargs)

    async def acounted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await async_method(self, *args, **kwargs)

    monkeypatch.setattr(client_sync.Client, "ack_and_receive", counted)
    monkeypatch.setattr(client_async.AsyncClient, "ack_and_receive", acounted)
    return calls


@pytest.mark.both_workers
def test_under_a_backlog_a_newcomer_gets_its_share_order_holds_and_stop_is_prompt(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One lane per slot, so each lane always fuses while it has a backlog: a
    second worker must still get a slot (the release request stops the fusing),
    each key's events must come in send order with none lost or twice, and a
    stop must come within a piece or so."""
    fused = count_fused_calls(monkeypatch)
    ids = make_backlog(client, 4000, keys=12)
    key_of = {i: f"k{n % 12}" for n, i in enumerate(ids)}
    seen: dict[str, list[int]] = defaultdict(list)
    by_worker: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler_for(name: str) -> Any:
        def handler(message: pgque.Message[Any]) -> None:
            threading.Event().wait(0.001)
            with lock:
                seen[message.partition_key or ""].append(message.id)
                by_worker[name].append(message.id)
        return handler

    def worker(name: str) -> pgque.Worker[Any]:
        return pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler_for(name),
                            max_events=5, rebalance_interval=0.1, poll_interval=0.05,
                            concurrency=2)

    def count() -> int:
        with lock:
            return sum(len(v) for v in by_worker.values())

    a = worker("a")
    a.start()
    try:
        wait_for(lambda: len(a.owned_slots) == 2 and count() >= 50, what="a busy first worker",
                 dsn=dsn)
        b = worker("b")
        b.start()
        try:
            started = time.monotonic()
            wait_for(lambda: len(b.owned_slots) == 1, timeout=5,
                     what="the newcomer's slot under load", dsn=dsn)
            assert time.monotonic() - started < 5
            assert count() < len(ids), "the backlog ran out before the test could tell"
            wait_for(lambda: by_worker["b"], timeout=5, what="the newcomer's first event")
            # A stop under load: within a piece (5 events of ~1 ms) and the release.
            stopping = time.monotonic()
            b.stop(timeout=10)
            assert not b.alive and time.monotonic() - stopping < 3
        finally:
            b.stop()
        wait_for(lambda: count() >= len(ids), timeout=30, what="the backlog to drain", dsn=dsn)
        wait_for(lambda: scalar(conn, "select count(*) from pgque.consumer_info "
                                      "where open_batch_id is not null") == 0,
                 what="every batch acked", dsn=dsn)
    finally:
        a.stop()
    with lock:
        handled = [i for v in by_worker.values() for i in v]
        assert sorted(handled) == ids  # none lost, none twice (clean stops ack)
        for key, got in seen.items():
            assert got == [i for i in ids if key_of[i] == key], key
    assert fused[0] > 100  # the lanes did fuse: what this test is about


@pytest.mark.both_workers
def test_a_fusing_lane_still_polls_its_other_slot(client: pgque.Client, dsn: str) -> None:
    """One lane with both slots (concurrency=1), no notifications: while one
    slot has a backlog the lane fuses on it, but the other slot's event must
    still be handled after about a poll interval, not after the backlog."""
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=200)
    client.subscribe_slots("q", "g", slots=2)
    keys: dict[int, str | None] = {0: None, 1: None}  # a key of each slot
    n = 0
    while None in keys.values():
        slot = scalar(client.conn, "select pgque.slot_of(%s, 2)", (f"k{n}",))
        keys[slot] = keys[slot] or f"k{n}"
        n += 1
    busy = client.send_batch("q", [("e", i, keys[0]) for i in range(3000)])
    handled: list[int] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        threading.Event().wait(0.001)
        with lock:
            handled.append(message.id)

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler,
                          max_events=5, poll_interval=0.1, rebalance_interval=0.1,
                          concurrency=1, listen=False)
    with worker:
        wait_for(lambda: len(handled) >= 100, what="the busy slot under way", dsn=dsn)
        lone = client.send("q", "e", "lone", partition_key=keys[1])
        wait_for(lambda: lone in handled, timeout=5, what="the other slot's event", dsn=dsn)
        with lock:
            assert len(handled) < len(busy), "the backlog ran out before the test could tell"



@pytest.mark.both_workers
def test_a_fusing_lane_whose_session_is_terminated_loses_nothing(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane's session ends (an admin terminates it) while the lane fuses under
    a backlog: only its piece in flight comes again, every event is handled,
    and each key's first deliveries keep send order."""
    fused = count_fused_calls(monkeypatch)
    ids = make_backlog(client, 3000, keys=12)
    key_of = {i: f"k{n % 12}" for n, i in enumerate(ids)}
    seen: dict[str, list[int]] = defaultdict(list)
    handled: list[int] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        threading.Event().wait(0.001)
        with lock:
            seen[message.partition_key or ""].append(message.id)
            handled.append(message.id)

    def count() -> int:
        with lock:
            return len(set(handled))

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler,
                          max_events=5, rebalance_interval=0.1, poll_interval=0.05)
    with worker:
        wait_for(lambda: count() >= 300 and fused[0] > 10, what="fusing lanes", dsn=dsn)
        [victim] = conn.execute(
            "select pid from pg_stat_activity where application_name like %s "
            "order by pid limit 1", ("%-lane%",)).fetchone()
        assert scalar(conn, "select pg_terminate_backend(%s)", (victim,))
        wait_for(lambda: count() >= len(ids), timeout=30, what="the backlog to drain", dsn=dsn)
        wait_for(lambda: scalar(conn, "select count(*) from pgque.consumer_info "
                                      "where open_batch_id is not null") == 0,
                 what="every batch acked", dsn=dsn)
    with lock:
        assert sorted(set(handled)) == ids
        assert len(handled) - len(ids) <= 2 * 5  # at most the pieces in flight, again
        for key, got in seen.items():
            first = list(dict.fromkeys(got))
            assert first == [i for i in ids if key_of[i] == key], key
