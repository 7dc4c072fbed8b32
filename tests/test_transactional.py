"""Exactly once in the same database.

Transactional handlers: the handler's writes on the lane's connection and the
ack of the batch commit together, each event in a savepoint; a handler that
ends or breaks the worker's transaction costs only its event, or stops the
worker with nothing acked; a lane that lost its session commits nothing.
Effects checked with check_fence: one committed before the next owner
receives, none from a snapshot older than the new epoch, and the new owner's
lane waits for the old epoch's transactions without losing its session.
(Under SIGKILL, terminated sessions and a server crash:
tests/test_faults.py::test_transactional_effects_exactly_once.)"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import first_value, lane_pids, queue_with_effects, scalar, slots_drained, wait_for

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)


def _setup(client: pgque.Client, conn: psycopg.Connection[Any], slots: int = 2) -> None:
    client.create_queue("q", ticker_max_lag=0, max_retries=3)
    client.subscribe_slots("q", "g", slots=slots)
    conn.execute("create table effects (ev_id bigint, key text, pid int)")


def test_effects_commit_with_the_ack_and_failures_roll_back_alone(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    _setup(client, conn)
    ids = client.send_batch("q", [("e", n, f"k{n % 5}") for n in range(30)])
    owners: set[tuple[int, int]] = set()
    tries: dict[int, int] = {}

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        assert message.fence is not None
        owners.add((message.fence.slot, db.info.backend_pid))
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.partition_key))
        tries[message.id] = tries.get(message.id, 0) + 1
        if message.payload % 7 == 3 and tries[message.id] == 1:
            raise ValueError("fails once, after writing")  # its write rolls back
        if message.payload == 11 and tries[message.id] == 1:
            db.execute("select 1/0")  # an SQL error: only its savepoint is lost

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handle,
                          transactional=True, retry_after=0, poll_interval=0.05, name="tx")
    with worker:
        wait_for(lambda: scalar(conn, "select count(distinct ev_id) from effects") == 30
                 and slots_drained(conn), timeout=30, what="every effect", dsn=dsn)
        # Each slot's handler ran on the session that owns the slot.
        slot_owner = dict(conn.execute(
            "select slot, owner_pid from pgque.partition_slot_status").fetchall())
        assert all(slot_owner[slot] == pid for slot, pid in owners)
    assert sorted(r[0] for r in conn.execute("select ev_id from effects")) == ids
    failed_first = sorted(ev for ev, n in tries.items() if n > 1)
    assert len(failed_first) == 5 and worker.failed == 5 and worker.handled == 30
    assert scalar(conn, "select count(*) from pgque.dead_letter") == 0


@pytest.mark.parametrize("heartbeat_first", [False, True])
def test_a_lane_that_lost_its_session_commits_nothing(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        caplog: pytest.LogCaptureFixture, heartbeat_first: bool) -> None:
    """The lane's session ends while its handler has written and waits: the write
    is gone with the transaction, and the event is applied once, by the next
    ownership. With heartbeat_first, the lane's heartbeat has found the session
    gone before the handler returns (the connection is closed by then): that is a
    lost session too, not a handler that ended the transaction (it used to stop
    the worker with HandlerEndedTransaction)."""
    _setup(client, conn, slots=1)
    ids = client.send_batch("q", [("e", n, "k") for n in range(3)])
    entered = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        calls.append(message.id)
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.partition_key))
        if len(calls) == 1:
            entered.set()
            release.wait(30)

    with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                      transactional=True, poll_interval=0.05, rebalance_interval=0.2,
                      name="tx-lost"):
        assert entered.wait(30)
        owner = scalar(conn, "select owner_pid from pgque.partition_slot_status")
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (owner,))
        if heartbeat_first:
            wait_for(lambda: "session lost (heartbeat)" in caplog.text,
                     what="the heartbeat to find the session gone", dsn=dsn)
        release.set()
        wait_for(lambda: scalar(conn, "select count(*) from effects") == 3 and slots_drained(conn),
                 timeout=30, what="every effect, once", dsn=dsn)
    assert calls[0] == ids[0] and calls.count(ids[0]) == 2  # handled again after the loss
    assert sorted(r[0] for r in conn.execute("select ev_id from effects")) == ids
    assert scalar(conn, "select count(*) from effects where pid = %s", (owner,)) == 0


def test_a_worker_opens_one_session_per_lane(client: pgque.Client, dsn: str,
                                             conn: psycopg.Connection[Any]) -> None:
    """concurrency bounds the lanes: 8 slots over 3 lanes, plus the control session."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=8)
    seen: set[int] = set()

    def handle(message: pgque.Message[Any]) -> None:
        seen.add(message.payload)

    with pgque.Worker(dsn, queue="q", consumer="g", slots=8, handler=handle, concurrency=3,
                      ticker=False, name="lanes") as worker, pgque.Ticker(dsn):
        wait_for(lambda: len(worker.owned_slots) == 8, what="every slot", dsn=dsn)
        client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
        wait_for(lambda: len(seen) == 40, what="every event", dsn=dsn)
        assert worker.sessions == 3
        owners = {r[0] for r in conn.execute(
            "select owner_pid from pgque.partition_slot_status")}
        names = {r[0] for r in conn.execute(
            "select application_name from pg_stat_activity where application_name like "
            "'lanes%%'")}
        assert len(owners) == 3
        assert names == {"lanes", "lanes-lane1", "lanes-lane2", "lanes-lane3"}


def test_a_handler_waiting_on_a_lock_keeps_its_session(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A transactional handler's query may wait (a row lock) for longer than half of
    network_timeout: that is a busy session, not a dead network, so the lane keeps
    it (the heartbeat does not queue a ping behind the query for the watchdog to
    time out)."""
    _setup(client, conn, slots=1)
    conn.execute("create table account (id int primary key, n int)")
    conn.execute("insert into account values (1, 0)")
    calls: list[int] = []

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        calls.append(db.info.backend_pid)
        db.execute("update account set n = n + 1 where id = 1")

    with psycopg.connect(dsn) as holder:
        holder.execute("select * from account where id = 1 for update")  # holds the row
        with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                          transactional=True, network_timeout=4, rebalance_interval=0.2,
                          name="tx-wait"):
            client.send("q", "e", 1, partition_key="k")
            wait_for(lambda: scalar(conn, "select count(*) from pg_stat_activity where "
                                          "application_name = 'tx-wait-lane1' and "
                                          "wait_event_type = 'Lock'"),
                     what="the handler to wait for the row", dsn=dsn)
            time.sleep(3.0)  # the fault: a wait longer than network_timeout / 2
            holder.rollback()
            wait_for(lambda: scalar(conn, "select n from account") == 1 and slots_drained(conn),
                     what="the effect", dsn=dsn)
    assert len(calls) == 1  # handled once, on the session it started on


# -- effects fenced with check_fence, across a change of owner --------------------------------


def _owner_with_a_batch(client: pgque.Client,
                        dsn: str) -> tuple[pgque.Client, pgque.Batch[Any], int]:
    """One event sent and ticked; a new session owns slot 0 and has received it:
    the session (to close), its batch (with a fence) and its backend pid."""
    client.send("q", "e", 1, partition_key="k")
    owner = pgque.connect(dsn)
    assert owner.claim_slot("q", "g", 0)
    client.tick("q")
    batch = owner.receive_partitioned("q", "g", slot=0, slots=1)
    assert batch is not None and batch.fence is not None and owner.pinned_pid is not None
    return owner, batch, owner.pinned_pid


def _effects(conn: psycopg.Connection[Any]) -> list[int]:
    return sorted(r[0] for r in conn.execute("select payload from effects"))


def _backend_gone(conn: psycopg.Connection[Any], pid: int) -> bool:
    return not scalar(conn, "select count(*) from pg_stat_activity where pid = %s", (pid,))


def test_a_write_checked_before_its_owner_died_commits_before_the_next_owner_receives(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """What check_fence promises (docs/guarantees.md "Fencing"): an effect checked
    under epoch e, while the session that received under e owned the slot, commits
    before any event is handed out under a later epoch. Here the owner's session
    ends while the checked transaction is open: the next owner claims the slot and
    receives nothing until that transaction has ended, then the event again, under
    a later epoch; the effect committed."""
    queue_with_effects(client, conn)
    owner, batch, pid = _owner_with_a_batch(client, dsn)
    with psycopg.connect(dsn) as zombie:
        pgque.Client(zombie).check_fence(batch.fence)
        zombie.execute("insert into effects values (1, 1, pg_backend_pid())")
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (pid,))
        owner.close()
        wait_for(lambda: _backend_gone(conn, pid), what="the owner's backend to exit", dsn=dsn)
        # Another session owns the slot now: it receives nothing while the
        # checked transaction is open, and everything after it ended.
        with pgque.connect(dsn) as successor:
            assert successor.claim_slot("q", "g", 0)
            assert successor.receive_partitioned("q", "g", slot=0, slots=1) is None
            zombie.commit()
            again = successor.receive_partitioned("q", "g", slot=0, slots=1)
            assert again is not None and again.fence is not None
            assert again.fence.epoch > batch.fence.epoch
            assert [m.payload for m in again] == [1]
    assert _effects(conn) == [1]  # the zombie's write, committed before the successor began


@pytest.mark.parametrize("isolation", [psycopg.IsolationLevel.REPEATABLE_READ,
                                       psycopg.IsolationLevel.SERIALIZABLE])
def test_a_check_in_an_old_snapshot_is_refused(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        isolation: psycopg.IsolationLevel) -> None:
    """A checker whose snapshot predates the new owner's epoch (REPEATABLE READ or
    SERIALIZABLE, the snapshot taken while the old owner was alive) cannot pass
    check_fence once the successor has received: the share lock on the updated
    epoch row fails (StaleEpoch or a serialization failure), and nothing commits."""
    queue_with_effects(client, conn)
    owner, batch, pid = _owner_with_a_batch(client, dsn)
    with psycopg.connect(dsn) as zombie:
        zombie.isolation_level = isolation
        zombie.execute("select count(*) from pgque.slot_claim")  # the snapshot, old epoch
        zombie.execute("select count(*) from pgque.subscription")
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (pid,))
        owner.close()
        with pgque.connect(dsn) as successor:
            wait_for(lambda: successor.claim_slot("q", "g", 0), what="the claim", dsn=dsn)
            again = successor.receive_partitioned("q", "g", slot=0, slots=1)
            assert again is not None and again.fence is not None
            assert again.fence.epoch > batch.fence.epoch
            with pytest.raises((pgque.StaleEpoch, psycopg.errors.SerializationFailure)):
                pgque.Client(zombie).check_fence(batch.fence)
                zombie.execute("insert into effects values (1, 1, pg_backend_pid())")
                zombie.commit()
            zombie.rollback()
    assert _effects(conn) == []


def test_a_new_owner_waits_for_the_old_epochs_checked_transaction_and_keeps_its_lane(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """While a transaction that checked the old epoch is open, a Worker that takes the
    slot over handles nothing of it: its receive returns nothing (it does not wait
    on the epoch row; the worker polls), so the lane keeps its session however long
    that lasts (here 3 times network_timeout / 2, which a call held that long
    would exceed). Once the transaction has ended, the event is handled."""
    queue_with_effects(client, conn)
    owner, batch, pid = _owner_with_a_batch(client, dsn)
    handled: list[int] = []
    with psycopg.connect(dsn) as zombie:
        pgque.Client(zombie).check_fence(batch.fence)  # holds epoch e
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (pid,))
        owner.close()
        with pgque.Worker(dsn, queue="q", consumer="g", slots=1,
                          handler=lambda m: handled.append(m.payload), network_timeout=2,
                          rebalance_interval=0.2, poll_interval=0.05, name="fencewait"):
            first = wait_for(lambda: first_value(
                conn, "select owner_pid from pgque.partition_slot_status "
                      "where owner_pid is not null"),
                timeout=20, what="the lane to own the slot", dsn=dsn)
            seen = {first}
            deadline = time.monotonic() + 3.0  # 3 times network_timeout / 2
            while time.monotonic() < deadline:
                seen |= lane_pids(conn, "fencewait")
                time.sleep(0.05)
            assert handled == []  # held back while the old epoch's transaction is open
            zombie.rollback()
            wait_for(lambda: handled == [1], timeout=20, what="the event", dsn=dsn)
    assert seen == {first}, f"the lane's session was replaced while it waited: {sorted(seen)}"


def test_epochs_grow_across_unsubscribe_and_resubscribe(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A group dropped and subscribed again (even with another N) starts above every
    epoch it had; an old fence is stale against the new subscription."""
    queue_with_effects(client, conn)
    client.send("q", "e", 1, partition_key="k")
    assert client.claim_slot("q", "g", 0)
    client.tick("q")
    first = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert first is not None and first.fence is not None
    client.release_slot("q", "g", 0)
    assert client.unsubscribe_slots("q", "g") == 1
    client.subscribe_slots("q", "g", slots=1)
    client.send("q", "e", 2, partition_key="k")
    assert client.claim_slot("q", "g", 0)
    client.tick("q")
    second = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert second is not None and second.fence is not None
    assert second.fence.epoch > first.fence.epoch
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(first.fence)
    client.check_fence(second.fence)


# -- handlers that break their transaction; batches in pieces ---------------------------------


def test_a_handler_that_swallows_an_sql_error_loses_only_its_event(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A transactional handler that catches an SQL error on conn and returns (the
    common "insert, ignore a duplicate" pattern) leaves the transaction aborted:
    the worker rolls back to the event's savepoint, so that event fails alone (its
    writes gone) and the next event runs normally. No event whose handler
    succeeded becomes a dead letter."""
    queue_with_effects(client, conn, max_retries=1)
    conn.execute("create table uniq (id int primary key)")
    conn.execute("insert into uniq values (2)")
    calls: list[int] = []

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        calls.append(message.payload)
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.payload))
        if message.payload == 2:
            with contextlib.suppress(psycopg.errors.UniqueViolation):  # "already done"
                db.execute("insert into uniq values (2)")

    client.send_batch("q", [("e", n, "k") for n in range(1, 5)])
    with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                      transactional=True, retry_after=0, poll_interval=0.05,
                      rebalance_interval=0.2, name="swallow"):
        wait_for(lambda: slots_drained(conn) or len(calls) > 40, timeout=30,
                 what="the batch to be drained (or redelivered over and over)", dsn=dsn)
    assert slots_drained(conn), f"the slot is stuck: handler called {len(calls)} times"
    dead = sorted(r[0] for r in conn.execute("select (ev_data::jsonb)::int from pgque.dead_letter"))
    assert {1, 3, 4} <= set(_effects(conn)), f"calls {calls}, dead letters {dead}"
    assert 3 not in dead


def test_a_handler_that_rolls_back_the_transaction_stops_the_worker_acking_nothing(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """psycopg refuses conn.rollback() inside the worker's transaction, not the SQL
    statement. A handler that runs ROLLBACK ends the lane's transaction: the worker
    notices, acks nothing and stops with HandlerEndedTransaction (a bug in the
    handler, documented); the batch comes again, whole, to a fixed handler, and
    every effect is then there once."""
    queue_with_effects(client, conn)
    tries: dict[int, int] = {}

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        tries[message.payload] = tries.get(message.payload, 0) + 1
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.payload))
        if message.payload == 2 and tries[2] == 1:
            db.execute("rollback")  # a helper that "cleans up" after itself

    client.send_batch("q", [("e", n, "k") for n in range(1, 4)])
    broken = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                          transactional=True, retry_after=0, poll_interval=0.05,
                          rebalance_interval=0.2, name="rollback")
    with pytest.raises(pgque.HandlerEndedTransaction):
        broken.run()
    assert _effects(conn) == [] and not slots_drained(conn)  # nothing acked, nothing kept
    with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                      transactional=True, retry_after=0, poll_interval=0.05,
                      rebalance_interval=0.2, name="fixed"):
        wait_for(lambda: slots_drained(conn), timeout=30, what="the batch", dsn=dsn)
    assert _effects(conn) == [1, 2, 3], "an acked event's effect is lost (or doubled)"


def test_max_events_pieces_commit_each_with_their_ack(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A batch split by max_events into pieces, a handler failing once in the middle
    (retried) and one event that always fails (a dead letter after max_retries):
    every effect of a handled event is there exactly once."""
    queue_with_effects(client, conn, max_retries=1)
    tries: dict[int, int] = {}

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        tries[message.payload] = tries.get(message.payload, 0) + 1
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.payload))
        if message.payload == 5 and tries[5] == 1:
            raise ValueError("once")
        if message.payload == 7:
            raise ValueError("always")

    client.send_batch("q", [("e", n, f"k{n % 3}") for n in range(10)])
    with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                      transactional=True, max_events=3, retry_after=0, poll_interval=0.05,
                      name="pieces"):
        wait_for(lambda: slots_drained(conn) and scalar(
            conn, "select count(*) from pgque.dead_letter") == 1, timeout=30,
            what="every event (one dead letter)", dsn=dsn)
    assert _effects(conn) == [n for n in range(10) if n != 7]
    assert tries[7] == 2


def test_check_fence_inside_a_transactional_handler(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A transactional handler may check its fence on the lane's own connection (the
    epoch row is share-locked in the transaction that then acks): no deadlock with
    the ack, and the next receive of the same ownership keeps the epoch."""
    queue_with_effects(client, conn)
    epochs: list[int] = []

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        assert message.fence is not None
        pgque.Client(db).check_fence(message.fence)
        epochs.append(message.fence.epoch)
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.payload))

    with pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                      transactional=True, max_events=2, poll_interval=0.05,
                      name="txfence"):
        client.send_batch("q", [("e", n, "k") for n in range(6)])
        wait_for(lambda: _effects(conn) == list(range(6)) and slots_drained(conn), timeout=30,
                 what="every effect", dsn=dsn)
    assert len(set(epochs)) == 1


@pytest.mark.parametrize("statement", ["commit", "rollback"])
def test_a_handler_that_ends_the_transaction_and_begins_another_stops_the_worker(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any], statement: str) -> None:
    """A transactional handler that ends the worker's transaction on the batch's last
    event (COMMIT or ROLLBACK) and BEGINs another leaves the status "in
    transaction", as if nothing happened: the batch is not acked in the handler's
    transaction (with ROLLBACK the earlier events' effects would be gone yet
    acked). The worker stops with HandlerEndedTransaction and the batch comes back
    whole."""
    queue_with_effects(client, conn)
    ids = client.send_batch("q", [("e", n, "k") for n in range(3)])
    client.tick("q")

    def handle(message: pgque.Message[Any], db: psycopg.Connection[Any]) -> None:
        db.execute("insert into effects values (%s, %s, pg_backend_pid())",
                   (message.id, message.payload))
        if message.id == ids[-1]:
            db.execute(statement)
            db.execute("begin")

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handle,
                          transactional=True, ticker=False, retry_after=100)
    worker.start()
    try:
        stopped = worker.wait_stopped(15)
    finally:
        worker.stop()
    assert stopped and isinstance(worker.error, pgque.HandlerEndedTransaction), (
        f"still running or another end: {worker.error!r}, handled {worker.handled}")
    # Not acked: the whole batch is delivered again.
    assert client.claim_slot("q", "g", 0)
    batch = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert batch is not None and [m.id for m in batch.messages] == ids
