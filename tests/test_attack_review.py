"""Attack review of 0.2.0's new parts: slot indexes (62_slot_index.sql), the
idle-slot probe (_slot_has_nothing), pending_slots and the Worker's targeted
wakeups, and the issue-11 fixes.

The tests without "Held:" showed a defect found in review: each failed on the
reviewed code (commit 17522a7) and passes since its fix. Those whose
docstring starts with "Held:" are attacks that did not work, kept as
regression tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import warnings
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from psycopg.conninfo import make_conninfo

import pgque


def _slot_of(conn: psycopg.Connection[Any], key: str | None, slots: int) -> int:
    return int(scalar(conn, "select pgque.slot_of(%s, %s)", (key, slots)))


def _keys_for(conn: psycopg.Connection[Any], slot: int, slots: int, count: int,
              prefix: str = "k") -> list[str]:
    """``count`` keys that route to ``slot`` of ``slots``."""
    keys: list[str] = []
    n = 0
    while len(keys) < count:
        key = f"{prefix}{n}"
        if _slot_of(conn, key, slots) == slot:
            keys.append(key)
        n += 1
    return keys


def _drain_slot(client: pgque.Client, slot: int, slots: int) -> list[int]:
    got: list[int] = []
    while (batch := client.receive_partitioned("q", "g", slot=slot, slots=slots)) is not None:
        got.extend(m.id for m in batch)
        client.ack(batch)
    return got


# -- 1. slot indexes -------------------------------------------------------------


def test_receive_partitioned_with_a_null_slot_count_gets_only_its_slot(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """DESIGN 3: receive_partitioned "returns only its hash class, filtered
    server-side", and a buggy client must not reach another slot's events.
    A NULL slot count passes _slot_sub (it then takes the group's count) but
    _batch_where writes no slot filter for it, so the slot's batch is the whole
    queue's batch."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    other = _keys_for(conn, 1, 4, 3)
    mine = _keys_for(conn, 0, 4, 2)
    client.send_batch("q", [("e", None, k) for k in other + mine])
    client.tick("q")
    assert client.claim_slot("q", "g", 0)
    rows = client.conn.execute(
        "select ev_extra1 from pgque.receive_partitioned('q', 'g', 0, null)").fetchall()
    keys = [r[0] for r in rows]
    assert sorted(keys) == sorted(mine), f"slot 0 received {keys}"


def test_concurrent_producers_in_progress_at_tick_time_reach_their_slot(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Held: the xip arm of the dual filter with the slot index. Producers whose
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
    """Held: a slot whose cursor moved to a tick that had the producer's
    transaction in progress (xip), probed within the second after: the probe
    must find the event through the xip arm, not say "nothing"."""
    slots = 4
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    assert client.claim_slot("q", "g", 1)
    [key] = _keys_for(conn, 1, slots, 1)
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


@pytest.mark.parametrize("call", ["subscribe_slots", "unsubscribe_slots"])
def test_subscribing_in_a_transaction_does_not_hold_the_producers(
        client: pgque.Client, dsn: str, call: str) -> None:
    """docs/operations.md (Sizing N): a table busy for more than 50 ms is left
    without the index "so that no producer waits for an index build". A group
    subscribed (or unsubscribed) inside a longer transaction, as a schema
    migration does, keeps the lock that CREATE INDEX (DROP INDEX) took on every
    event table until that transaction ends: every send to the queue waits for
    it (with unsubscribe, every receive of every consumer of the queue too)."""
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


# -- 4. issue-11 fixes -------------------------------------------------------------


def test_a_worker_whose_ticker_never_connected_does_not_run_on_silently(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """0.2.0: "a Worker, AsyncWorker or Ticker that has not connected once within
    connect_timeout of starting stops". The Worker's own Ticker is a service of
    its own: when only it fails to connect for that long (here its role's
    connection limit is taken during the first seconds, a transient state),
    it stops for good while the Worker, connected, runs on: nothing ticks
    again, events are never delivered, and neither worker.error nor run()
    says anything. Before 0.2.0 the Ticker retried for ever."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=1)
    role = f"pgque_test_ticker_{uuid.uuid4().hex[:8]}"
    conn.execute(f"create role {role} login connection limit 1")
    conn.execute(f"grant pgque_admin to {role}")
    ticker_dsn = make_conninfo(dsn, user=role)
    handled = threading.Event()
    blocker = psycopg.connect(ticker_dsn)  # the role's one connection, for now
    try:
        ticker = pgque.Ticker(ticker_dsn, connect_timeout=1.0)
        worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, ticker=ticker,
                              handler=lambda m: handled.set())
        worker.start()
        try:
            wait_for(lambda: worker.owned_slots == {0}, what="the slot owned")
            wait_for(lambda: not ticker.alive, timeout=15, what="the ticker to give up")
            blocker.close()  # the limit is free again: the transient state is over
            client.send("q", "e", None, partition_key="k")
            # Either the event is delivered, or the worker has stopped and says why.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not handled.is_set() and worker.alive:
                time.sleep(0.05)
            assert handled.is_set() or (not worker.alive and worker.error is not None), (
                f"worker alive={worker.alive} error={worker.error!r}, ticker error "
                f"{ticker.error!r}: the event waits for a tick that never comes")
        finally:
            worker.stop()
    finally:
        blocker.close()
        conn.execute(f"drop role {role}")


def test_an_async_handler_that_returns_a_coroutine_is_not_acked(
        client: pgque.Client, dsn: str) -> None:
    """The sync twin of this was fixed in 0.2.0 (HandlerReturnedAwaitable: "before,
    every event counted as handled and was acked, though no work ran"). The
    AsyncWorker awaits its handler but not what that returns: ``async def
    handle(m): return work(m)`` (a forgotten await) acks every event, no work
    done, with only a RuntimeWarning."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=1)
    ran: list[int] = []

    async def work(message: pgque.Message[Any]) -> None:
        ran.append(message.id)

    async def handle(message: pgque.Message[Any]) -> Any:
        return work(message)  # forgot the await

    [ev] = client.send_batch("q", [("e", None, "k")])

    async def main() -> pgque.AsyncWorker[Any]:
        worker: pgque.AsyncWorker[Any] = pgque.AsyncWorker(
            dsn, queue="q", consumer="g", slots=1, handler=handle, retry_after=100)
        task = asyncio.get_running_loop().create_task(worker.run())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not task.done() and worker.handled == 0:
            await asyncio.sleep(0.05)
        if not task.done():
            await worker.stop()
        with contextlib.suppress(Exception):
            await task
        return worker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "never awaited"
        worker = asyncio.run(main())
    # Either the event was really handled, or it was not acked (still pending).
    pending = scalar(client.conn, "select pending_events from pgque.partition_slot_status")
    assert ran == [ev] or (worker.handled == 0 and pending == 1), (
        f"handled={worker.handled} ran={ran} pending={pending}")


# -- 2. the idle-slot probe ------------------------------------------------------


def test_idle_probe_finds_a_retry_meant_for_the_slot(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """Held: a retry re-inserted by maintenance (ev_owner the slot's
    subscription, a new txid) in a tick less than a second after the slot's
    last one is found by the probe, and only by its own slot: a second group
    of the same N never sees it."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=4)
    client.subscribe_slots("q", "h", slots=4)
    [key] = _keys_for(conn, 2, 4, 1)
    [ev] = client.send_batch("q", [("e", None, key)])
    client.tick("q")
    assert client.claim_slot("q", "g", 2) and client.claim_slot("q", "h", 2)
    batch = client.receive_partitioned("q", "g", slot=2, slots=4)
    assert batch is not None and [m.id for m in batch] == [ev]
    client.ack(batch, nack={ev: "boom"}, retry_after=0)
    assert _drain_slot_of(client, "h", 2, 4) == [ev]
    client.maintenance("q")
    client.tick("q")
    batch = client.receive_partitioned("q", "g", slot=2, slots=4)
    assert batch is not None and [(m.id, m.retry_count) for m in batch] == [(ev, 1)]
    client.ack(batch)
    assert _drain_slot_of(client, "h", 2, 4) == []


def _drain_slot_of(client: pgque.Client, group: str, slot: int, slots: int) -> list[int]:
    got: list[int] = []
    while (batch := client.receive_partitioned("q", group, slot=slot, slots=slots)) is not None:
        got.extend(m.id for m in batch)
        client.ack(batch)
    return got


def test_an_idle_slot_does_not_pin_rotation(client: pgque.Client,
                                            conn: psycopg.Connection[Any]) -> None:
    """Held: a slot that never gets an event, polled as a worker polls it, still
    moves its cursor (at least once a second of ticks), so the queue's old
    tables are truncated while only the other slot has traffic."""
    client.create_queue("q", rotation_period=0)
    client.subscribe_slots("q", "g", slots=2)
    for slot in (0, 1):
        assert client.claim_slot("q", "g", slot)
    busy = _keys_for(conn, 0, 2, 5)

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


# -- 3. pending_slots and the Worker's targeted wakeups ---------------------------


@pytest.mark.both_workers
@pytest.mark.parametrize("slots,concurrency", [(8, 2), (8, 8), (1, 1)])
def test_targeted_wakeups_deliver_every_slot_long_before_the_poll(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str, slots: int,
        concurrency: int) -> None:
    """Held: with a poll_interval of 30 s, only tick notifications and
    pending_slots can bring a slot's events in time. Events for one slot after
    another (lanes owning several slots, one slot per lane, a worker of one
    slot), and a retry that comes back through maintenance, each reach the
    handler within a few seconds."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)
    seen: dict[int, int] = {}  # event id -> retry count seen last
    lock = threading.Lock()

    def handle(message: pgque.Message[Any]) -> None:
        with lock:
            seen[message.id] = message.retry_count
        if (message.partition_key or "").startswith("retry-") and message.retry_count == 0:
            raise RuntimeError("once")

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=slots,
                          concurrency=concurrency, handler=handle, poll_interval=30,
                          retry_after=0.2)
    worker.start()
    try:
        wait_for(lambda: len(worker.owned_slots) == slots, timeout=15, what="all slots")
        # The first round also warms up: after its event, each slot's next
        # receive finds nothing and waits out 30 s unless woken.
        for slot in list(range(slots))[::-1] * 2:
            [key] = _keys_for(conn, slot, slots, 1, prefix=f"w{slot}-")
            sent = client.send("q", "e", None, partition_key=key)
            wait_for(lambda: sent in seen, timeout=5,  # noqa: B023 (called at once)
                     what=f"event of slot {slot}")
        [key] = _keys_for(conn, slots - 1, slots, 1, prefix="retry-")
        ev = client.send("q", "e", None, partition_key=key)
        wait_for(lambda: seen.get(ev) == 1, timeout=8, what="the retry")
    finally:
        worker.stop()


def test_concurrent_subscribes_with_producers_lose_and_misroute_nothing(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Held: two groups of different N subscribe at the same time (index syncs
    of one queue one at a time), a third unsubscribes, while producers send
    without pause; both new groups end with their indexes, and each slot of
    each gets exactly the events committed after its group existed, routed by
    slot_of."""
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
    client.maintenance()  # where the slot indexes are made, since the review
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
