"""G2 ownership with real sessions: one owner per slot, enforced by the server."""

from __future__ import annotations

import threading
import time
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import scalar, wait_for

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


@pytest.fixture
def group(client: pgque.Client) -> pgque.Client:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    return client


def key_for_slot(conn: psycopg.Connection[Any], slot: int, slots: int) -> str:
    for n in range(1000):
        if scalar(conn, "select pgque.slot_of(%s, %s)", (f"key-{n}", slots)) == slot:
            return f"key-{n}"
    raise AssertionError("no key found")


def test_second_claim_fails_at_once(group: pgque.Client, dsn: str) -> None:
    with pgque.connect(dsn) as other:
        assert group.claim_slot("q", "g", 0) is True
        assert group.claim_slot("q", "g", 0) is True  # idempotent for the owner
        other.conn.execute("set statement_timeout = '2s'")  # a blocking claim would fail loudly
        started = time.monotonic()
        assert other.claim_slot("q", "g", 0) is False
        assert time.monotonic() - started < 1.5
        assert other.claim_slot("q", "g", 1) is True
        # Released once, the slot is free for the other session (no lock stacking).
        assert group.release_slot("q", "g", 0) is True
        assert group.release_slot("q", "g", 0) is False
        assert other.claim_slot("q", "g", 0) is True


def test_non_owner_cannot_receive_or_ack(group: pgque.Client, dsn: str,
                                         conn: psycopg.Connection[Any]) -> None:
    group.send("q", "e", 1, partition_key=key_for_slot(conn, 0, 2))
    group.tick("q")
    with pgque.connect(dsn) as intruder:
        with pytest.raises(pgque.SlotNotOwned):
            intruder.receive_partitioned("q", "g", slot=0, slots=2)
        assert group.claim_slot("q", "g", 0)
        batch = group.receive_partitioned("q", "g", slot=0, slots=2)
        assert batch is not None and len(batch) == 1
        with pytest.raises(pgque.SlotNotOwned):
            intruder.ack(batch)
        with pytest.raises(pgque.SlotNotOwned):
            intruder.nack(batch, batch.messages)
        with pytest.raises(pgque.SlotNotOwned):  # the nack-and-ack in one call too
            intruder.ack(batch, nack=batch.messages)
        with pytest.raises(pgque.SlotNotOwned):
            intruder.receive_partitioned("q", "g", slot=0, slots=2)
        assert scalar(conn, "select count(*) from pgque.retry_queue") == 0
        assert group.ack(batch) is True


def test_concurrent_receive_waits_for_the_receive_lock_and_gets_same_batch(
        group: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The receive lock (G2) serializes receivers of one slot even when the
    advisory lock changes hands in between."""
    key = key_for_slot(conn, 1, 2)
    group.send_batch("q", [("e", i, key) for i in range(3)])
    group.tick("q")
    first_conn = psycopg.connect(dsn)  # transactional: keeps the row lock until commit
    first = pgque.Client(first_conn)
    second = pgque.connect(dsn)
    try:
        assert first.claim_slot("q", "g", 1)
        held = first.receive_partitioned("q", "g", slot=1, slots=2)
        assert held is not None
        first.release_slot("q", "g", 1)  # the advisory lock goes; the row lock stays
        assert second.claim_slot("q", "g", 1)
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(
            batch=second.receive_partitioned("q", "g", slot=1, slots=2)))
        thread.start()
        pid = second.conn.info.backend_pid
        wait_for(lambda: scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity "
                                      "where pid = %s", (pid,)), what="receive to block")
        assert thread.is_alive()
        first_conn.commit()
        thread.join(10)
        assert result["batch"].batch_id == held.batch_id
        assert [m.id for m in result["batch"]] == [m.id for m in held]
    finally:
        first_conn.close()
        second.close()


def test_terminated_owner_frees_slot_and_cannot_ack_after_reconnect(
        group: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    key = key_for_slot(conn, 0, 2)
    ids = group.send_batch("q", [("e", i, key) for i in range(4)])
    group.tick("q")
    owner = pgque.connect(dsn)
    assert owner.claim_slot("q", "g", 0)
    batch = owner.receive_partitioned("q", "g", slot=0, slots=2)
    assert batch is not None and [m.id for m in batch] == ids
    owner_pid = owner.conn.info.backend_pid

    with pgque.connect(dsn) as successor:
        assert successor.claim_slot("q", "g", 0) is False
        assert scalar(conn, "select pg_terminate_backend(%s)", (owner_pid,)) is True
        # The lock goes with the session, as soon as the backend is gone.
        wait_for(lambda: successor.claim_slot("q", "g", 0), what="the slot to be free")
        again = successor.receive_partitioned("q", "g", slot=0, slots=2)
        assert again is not None
        assert again.batch_id == batch.batch_id
        assert [m.id for m in again] == ids

        # The old owner reconnects: its session holds nothing, so it cannot ack.
        with pytest.raises(psycopg.OperationalError):
            owner.ack(batch)
        zombie = pgque.connect(dsn)
        try:
            with pytest.raises(pgque.SlotNotOwned):
                zombie.ack(batch)
            assert zombie.claim_slot("q", "g", 0) is False
        finally:
            zombie.close()
            owner.close()
        assert successor.ack(again) is True


def test_partition_slot_status_shows_owner_and_lag(group: pgque.Client, dsn: str,
                                                    conn: psycopg.Connection[Any]) -> None:
    group.send_batch("q", [("e", i, key_for_slot(conn, 0, 2)) for i in range(3)])
    group.send_batch("q", [("e", i, key_for_slot(conn, 1, 2)) for i in range(5)])
    group.send("q", "e", 0)  # NULL key: slot 0
    group.tick("q")
    assert group.claim_slot("q", "g", 0)
    rows = {r.slot: r for r in group.partition_slot_status("q")}
    assert rows[0].owner_pid == group.conn.info.backend_pid
    assert rows[1].owner_pid is None
    assert (rows[0].pending_events, rows[1].pending_events) == (4, 5)
    assert rows[0].slots == rows[1].slots == 2
    assert rows[0].ticks_behind == 1
    assert rows[0].oldest_unconsumed_age is not None
    assert not rows[0].stalled and not rows[1].stalled

    batch = group.receive_partitioned("q", "g", slot=0, slots=2)
    assert batch is not None and len(batch) == 4
    assert group.ack(batch)
    rows = {r.slot: r for r in group.partition_slot_status("q")}
    assert (rows[0].pending_events, rows[1].pending_events) == (0, 5)
    assert rows[0].oldest_unconsumed_age is None
    assert rows[0].ticks_behind == 0
    # Traffic of slot 1 only: slot 0 falls a tick behind but has nothing of its
    # own waiting, so it shows no age and is never flagged as stalled.
    group.send("q", "e", 1, partition_key=key_for_slot(conn, 1, 2))
    group.tick("q")
    rows = {r.slot: r for r in group.partition_slot_status("q")}
    assert rows[0].ticks_behind == 1 and rows[0].pending_events == 0
    assert rows[0].oldest_unconsumed_age is None
    assert rows[1].pending_events == 6 and rows[1].oldest_unconsumed_age is not None
    # Status seen from another session agrees on the owner.
    with psycopg.connect(dsn, autocommit=True) as observer:
        owner = scalar(observer, "select owner_pid from pgque.partition_slot_status where slot = 0")
    assert owner == group.conn.info.backend_pid
    group.release_slot("q", "g", 0)
    assert {r.slot: r.owner_pid for r in group.partition_slot_status("q")} == {0: None,
                                                                                     1: None}


def test_group_status_counts_members(group: pgque.Client, dsn: str) -> None:
    assert group.join_group("q", "g") is True
    assert group.join_group("q", "g") is False
    with pgque.connect(dsn) as other:
        other.join_group("q", "g")
        other.claim_slot("q", "g", 1)
        status = group.group_status("q", "g")
        assert status.members == 2 and len(status.slots) == 2
        assert status.my_rank in (0, 1) and status.fair_share() == 1
        assert status.slots[1].owner_pid == other.conn.info.backend_pid
        assert not status.slots[1].mine
    wait_for(lambda: group.group_status("q", "g").members == 1, what="member to leave")


def test_a_rolled_back_join_is_still_one_membership(group: pgque.Client) -> None:
    """A member's number is remembered in a setting, which a rollback undoes while
    its lock stays: the session finds the lock again rather than take another
    (one more lock held for every rolled back join)."""
    with pytest.raises(psycopg.errors.RaiseException), group.conn.transaction():
        assert group.join_group("q", "g") is True
        group.conn.execute("do $$ begin raise 'undo'; end $$")
    assert group.join_group("q", "g") is False  # a member still
    assert group.join_group("q", "g") is False
    held = scalar(group.conn, "select count(*) from pg_locks where locktype = 'advisory'"
                              " and objsubid = 2 and pid = pg_backend_pid()")
    assert held == 1
    assert group.group_status("q", "g").members == 1


def test_other_databases_slots_are_not_ours(group: pgque.Client, dsn: str, pg_server: Any,
                                            template_db: str) -> None:
    """Advisory locks are per database while pg_locks shows the whole cluster: the
    same group in another database (same ids, and here the same lock keys) must not
    look like an owner or a member here, nor block a claim."""
    other_db = pgtest.scratch_name("t")
    pgtest.create_database(pg_server, other_db, template=template_db)
    try:
        with pgque.connect(pg_server.dsn(other_db)) as other:
            other.create_queue("q")
            other.subscribe_slots("q", "g", slots=2)
            # Keys are random per database: give the other one ours.
            for table, key, name in (("subscription", "sub_lock_key", "sub_consumer"),
                                     ("consumer_group", "cg_lock_key", "cg_consumer")):
                for value, row in group.conn.execute(
                        f"select {key}, {name} from pgque.{table}").fetchall():
                    other.conn.execute(f"update pgque.{table} set {key} = %s where {name} = %s",
                                       (value, row))
            other.join_group("q", "g")
            assert other.claim_slot("q", "g", 0)
            assert other.slot_lock_key("q", "g", 0) == group.slot_lock_key("q", "g", 0)
            status = group.group_status("q", "g")
            assert [s.owner_pid for s in status.slots] == [None, None]
            assert status.members == 0
            assert [r.owner_pid for r in group.partition_slot_status("q")] == [None, None]
            assert group.claim_slot("q", "g", 0) is True
    finally:
        pgtest.drop_database(pg_server, other_db)


def test_a_shared_hold_of_the_slot_key_is_not_ownership(group: pgque.Client, dsn: str) -> None:
    """Two sessions can both take the slot's key in share mode: neither owns it."""
    key = group.slot_lock_key("q", "g", 0)
    with pgque.connect(dsn) as first, pgque.connect(dsn) as second:
        for intruder in (first, second):
            assert scalar(intruder.conn, "select pg_try_advisory_lock_shared(%s)", (key,))
        for intruder in (first, second):
            with pytest.raises(pgque.SlotNotOwned):
                intruder.receive_partitioned("q", "g", slot=0, slots=2)
        status = {s.slot: s.owner_pid for s in group.group_status("q", "g").slots}
        assert status[0] is None  # shown as free, not as owned by a share holder
        # An exclusive claim cannot be had while they share it, and releasing
        # does not touch a share hold.
        assert first.claim_slot("q", "g", 0) is False
        assert first.release_slot("q", "g", 0) is False


def test_release_slot_never_makes_the_server_warn(group: pgque.Client) -> None:
    notices: list[str] = []
    group.conn.add_notice_handler(lambda diag: notices.append(str(diag.message_primary)))
    assert group.claim_slot("q", "g", 0) is True
    assert group.release_slot("q", "g", 0) is True
    assert group.release_slot("q", "g", 0) is False
    # A key taken twice by hand is let go completely, still without a warning.
    key = group.slot_lock_key("q", "g", 1)
    group.conn.execute("select pg_advisory_lock(%s), pg_advisory_lock(%s)", (key, key))
    assert group.release_slot("q", "g", 1) is True
    assert all(s.owner_pid is None for s in group.group_status("q", "g").slots)
    assert notices == []
