"""Fencing epochs: each ownership of a slot receives under a new epoch, and a
write checked with pgque.check_fence commits only while that ownership lasts;
a new owner's first receive waits for the transactions that checked the old
epoch, so no effect of a stale epoch commits after the slot moved."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import refused, scalar, wait_for

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


def _setup(client: pgque.Client, slots: int = 1) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=slots)


def _received(client: pgque.Client, slots: int = 1, slot: int = 0) -> pgque.Batch[Any]:
    client.tick("q")
    batch = client.receive_partitioned("q", "g", slot=slot, slots=slots)
    assert batch is not None
    return batch


def test_a_batch_carries_its_owners_epoch(client: pgque.Client, dsn: str) -> None:
    _setup(client)
    client.send("q", "e", 1)
    assert client.claim_slot("q", "g", 0)
    batch = _received(client)
    assert batch.fence is not None and batch.fence.epoch > 0
    assert batch.fence == pgque.Fence("q", "g", 0, batch.fence.epoch)
    assert [m.fence for m in batch] == [batch.fence]
    client.ack(batch)
    client.send("q", "e", 2)
    again = _received(client)
    assert again.fence == batch.fence  # the same ownership, the same epoch
    # Any connection may check, in its own transaction.
    with pgque.connect(dsn) as handler:
        handler.check_fence(batch.fence)
    # A plain consumer's batch has no fence.
    client.subscribe("q", "plain")
    client.send("q", "e", 3)
    client.tick("q")
    plain = client.receive("q", "plain")
    assert plain is not None and plain.fence is None and plain.messages[0].fence is None


def test_an_epoch_is_stale_once_its_owners_session_ends(client: pgque.Client, dsn: str,
                                                        conn: psycopg.Connection[Any]) -> None:
    _setup(client)
    client.send("q", "e", 1)
    with pgque.connect(dsn) as owner:
        assert owner.claim_slot("q", "g", 0)
        fence = _received(owner).fence
        assert fence is not None
        client.check_fence(fence)
        owner_pid = owner.pinned_pid
    # The session has ended (the server takes a moment after the client left).
    wait_for(lambda: not scalar(conn, "select count(*) from pg_stat_activity where pid = %s",
                                (owner_pid,)), what="the owner's backend to exit", dsn=dsn)
    # Nobody owns the slot now: the old epoch fences its writes out at once.
    with pytest.raises(pgque.StaleEpoch, match="no longer owns"):
        client.check_fence(fence)
    # The next owner receives the same batch under a higher epoch.
    assert client.claim_slot("q", "g", 0)
    batch = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert batch is not None and batch.fence is not None
    assert batch.fence.epoch > fence.epoch
    with pytest.raises(pgque.StaleEpoch, match="stale"):
        client.check_fence(fence)
    client.check_fence(batch.fence)
    # pids are reused: the owner is named by pid and the epoch's key it holds. A
    # session of the same pid holding the slot but not that key (here the owner,
    # having let go of the key by hand) passes for no owner, from any session.
    with pgque.connect(dsn) as other:
        other.check_fence(batch.fence)
        client.conn.execute("select pg_advisory_unlock(-sc_sub, pgque._epoch_number(sc_epoch)),"
                            " pg_advisory_unlock(-sc_sub, pgque._epoch_number(sc_epoch))"
                            " from pgque.slot_claim")
        with pytest.raises(pgque.StaleEpoch):
            other.check_fence(batch.fence)
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(batch.fence)


def test_every_claim_gets_a_new_epoch(client: pgque.Client) -> None:
    _setup(client)
    client.send("q", "e", 1)
    assert client.claim_slot("q", "g", 0)
    first = _received(client).fence
    assert first is not None
    assert client.release_slot("q", "g", 0)
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(first)
    assert client.claim_slot("q", "g", 0)
    second = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert second is not None and second.fence is not None
    assert second.fence.epoch > first.epoch
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(first)


def test_a_new_owner_waits_for_writes_checked_under_the_old_epoch(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The race fencing is for: a zombie's handler checked its epoch just before
    its owner's session died. Its write commits, and only then does the new owner
    receive (under a new epoch): until then its receive returns nothing, without
    waiting. After that, the old epoch's checks fail."""
    _setup(client)
    conn.execute("create table effects (epoch bigint, at timestamptz default clock_timestamp())")
    client.send("q", "e", 1)
    owner = pgque.connect(dsn)
    assert owner.claim_slot("q", "g", 0)
    fence = _received(owner).fence
    assert fence is not None
    with psycopg.connect(dsn) as zombie_conn:  # the handler's own connection
        pgque.Client(zombie_conn).check_fence(fence)  # holds the epoch until commit
        zombie_conn.execute("insert into effects (epoch) values (%s)", (fence.epoch,))
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (owner.pinned_pid,))
        owner.close()
        successor = pgque.connect(dsn)
        try:
            assert successor.claim_slot("q", "g", 0)  # a claim never waits
            # Nothing is handed out while the old epoch is held; nor does it wait.
            assert successor.receive_partitioned("q", "g", slot=0, slots=1) is None
            assert successor.receive_partitioned("q", "g", slot=0, slots=1) is None
            zombie_conn.commit()
            batch = successor.receive_partitioned("q", "g", slot=0, slots=1)
            assert batch is not None and batch.fence is not None
            assert batch.fence.epoch > fence.epoch
            # The zombie's next write is refused, and rolls back with its transaction.
            with pytest.raises(pgque.StaleEpoch):
                pgque.Client(zombie_conn).check_fence(fence)
                zombie_conn.execute("insert into effects (epoch) values (%s)", (fence.epoch,))
            zombie_conn.rollback()
            successor.check_fence(batch.fence)
        finally:
            successor.close()
    assert [r[0] for r in conn.execute("select epoch from effects")] == [fence.epoch]


def test_check_fence_refuses_bad_input_and_strangers(client: pgque.Client, dsn: str,
                                                     conn: psycopg.Connection[Any]) -> None:
    _setup(client, slots=2)
    client.send("q", "e", 1)
    assert client.claim_slot("q", "g", 0)
    assert client.claim_slot("q", "g", 1)
    client.tick("q")
    for slot in (0, 1):
        batch = client.receive_partitioned("q", "g", slot=slot, slots=2)
        if batch is not None and batch.fence is not None:
            fence = batch.fence
            break
    with pytest.raises(pgque.QueueNotFound):
        client.check_fence(pgque.Fence("nope", "g", 0, fence.epoch))
    with pytest.raises(pgque.ConsumerNotFound):
        client.check_fence(pgque.Fence("q", "nope", 0, fence.epoch))
    with pytest.raises(pgque.InvalidSlot):
        client.check_fence(pgque.Fence("q", "g", 2, fence.epoch))
    with pytest.raises(pgque.StaleEpoch):
        client.check_fence(pgque.Fence("q", "g", fence.slot, fence.epoch + 1))
    with pytest.raises(pgque.StaleEpoch):  # a slot never received from has no epoch
        client.check_fence(pgque.Fence("q", "g", 1 - fence.slot, fence.epoch))
    with pytest.raises(psycopg.Error) as null_epoch:
        scalar(conn, "select pgque.check_fence('q', 'g', %s, null)", (fence.slot,))
    assert null_epoch.value.sqlstate == "22023"
    # A role that may not use the group may not probe its epochs.
    conn.execute("create role fence_stranger login in role pgque_reader")
    try:
        with pgque.connect(dsn.replace("postgres@", "fence_stranger@")) as stranger:
            refused(lambda: stranger.check_fence(fence), pgque.ConsumerAccessDenied)
    finally:
        conn.execute("drop owned by fence_stranger")
        conn.execute("drop role fence_stranger")
    client.check_fence(fence)  # the log and the epoch are untouched


class _Effects:
    """A handler writing its effect over its own connection, fenced: it stops in
    the first event until released, so the test can end its worker's session."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.entered = threading.Event()
        self.release = threading.Event()
        self.refused: list[int] = []

    def __call__(self, message: pgque.Message[Any]) -> None:
        assert message.fence is not None
        if message.payload == 0 and not self.release.is_set():
            self.entered.set()
            self.release.wait(30)
        with psycopg.connect(self.dsn) as conn:
            try:
                pgque.Client(conn).check_fence(message.fence)
            except pgque.StaleEpoch:
                self.refused.append(message.fence.epoch)
                raise
            conn.execute("insert into effects (ev_id, epoch) values (%s, %s)",
                         (message.id, message.fence.epoch))


def test_a_zombie_workers_handler_commits_nothing(client: pgque.Client, dsn: str,
                                                  conn: psycopg.Connection[Any]) -> None:
    """A Worker's handler outlives its session (the server ended it mid-handler):
    its fenced write is refused, the event is handled again by the next ownership,
    and every committed effect is of the epoch current when it committed."""
    _setup(client)
    conn.execute("create table effects (ev_id bigint, epoch bigint)")
    ids = client.send_batch("q", [("e", n, "k") for n in range(3)])
    handler = _Effects(dsn)
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handler,
                          retry_after=0, rebalance_interval=0.2, poll_interval=0.05,
                          name="fenced-worker")
    with worker:
        assert handler.entered.wait(30)
        owner = scalar(conn, "select owner_pid from pgque.partition_slot_status")
        assert scalar(conn, "select pg_terminate_backend(%s)", (owner,))
        # The session is gone with its lock; the handler runs on (this Worker
        # waits for it before it reconnects and claims again).
        wait_for(lambda: scalar(conn, "select owner_pid is null from pgque.partition_slot_status"),
                 what="the slot to be free", dsn=dsn)
        handler.release.set()
        wait_for(lambda: scalar(conn, "select count(distinct ev_id) from effects") == 3,
                 timeout=30, what="every event's effect", dsn=dsn)
    epochs = dict(conn.execute("select ev_id, epoch from effects").fetchall())
    assert sorted(epochs) == ids
    assert scalar(conn, "select count(*) from effects") == 3  # no effect twice
    current = scalar(conn, "select max(sc_epoch) from pgque.slot_claim")
    assert handler.refused and all(e < current for e in handler.refused)
    assert set(epochs.values()).isdisjoint(handler.refused)


def test_epochs_taken_in_rolled_back_transactions_leave_no_lock_behind(
        client: pgque.Client) -> None:
    """A new epoch's key (slots/fence.sql) stays held when the transaction that took
    the epoch rolls back: the next epoch's takes the place of every earlier one of
    the slot, so a session holds no more locks however often that happens."""
    _setup(client)
    client.send("q", "e", 1)
    client.tick("q")
    assert client.claim_slot("q", "g", 0)
    epochs = set()
    for _ in range(4):
        with pytest.raises(psycopg.errors.RaiseException), client.conn.transaction():
            batch = client.receive_partitioned("q", "g", slot=0, slots=1)
            assert batch is not None and batch.fence is not None
            epochs.add(batch.fence.epoch)
            client.conn.execute("do $$ begin raise 'undo'; end $$")
    held = scalar(client.conn, "select count(*) from pg_locks where locktype = 'advisory'"
                               " and pid = pg_backend_pid()")
    assert held == 2, "the slot's key and its epoch's, nothing else"
    batch = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert batch is not None and batch.fence is not None
    client.check_fence(batch.fence)


def test_epochs_keep_growing_on_a_server_that_starts_again_on_timeline_1(
        client: pgque.Client) -> None:
    """An epoch is its generation (the highest timeline the database took one on)
    times 2^40 plus the sequence. A pg_upgrade or a restore of a database that
    failed over starts the server on timeline 1 again (here: a generation of 5
    stored, as after failovers): its epochs still grow, they never fall back to
    timeline 1's."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.set_ownership("q", "g", "lease", lease=30)
    client.take_lease("q", "g", name="w")

    def epoch(slot: int) -> int:
        assert client.claim_slot("q", "g", slot)
        return int(client.conn.execute(
            "select c.sc_epoch from pgque.slot_claim c join pgque.subscription s "
            "on s.sub_id = c.sc_sub where s.sub_consumer = pgque._slot_name('g', %s, 2)",
            (slot,)).fetchone()[0])  # type: ignore[index]

    before = epoch(0)
    assert before >> 40 == 1  # this server's timeline
    client.conn.execute("update pgque.epoch_generation set eg_generation = 5")
    after = epoch(1)
    assert after >> 40 == 5 and after > before
