"""Transactional handlers: the handler's writes on the lane's connection and the
ack of the batch commit together, each event in a savepoint; a lane that lost
its session commits nothing. (Under SIGKILL, terminated sessions and a server
crash: tests/test_faults.py::test_transactional_effects_exactly_once.)"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)


def _setup(client: pgque.Client, conn: psycopg.Connection[Any], slots: int = 2) -> None:
    client.create_queue("q", ticker_max_lag=0, max_retries=3)
    client.subscribe_slots("q", "g", slots=slots)
    conn.execute("create table effects (ev_id bigint, key text, pid int)")


def _drained(conn: psycopg.Connection[Any]) -> bool:
    return bool(scalar(conn, "select coalesce(bool_and(pending_events = 0 and open_batch_id is "
                             "null and retries_waiting = 0), false) "
                             "from pgque.partition_slot_status"))


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
                 and _drained(conn), timeout=30, what="every effect", dsn=dsn)
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
        wait_for(lambda: scalar(conn, "select count(*) from effects") == 3 and _drained(conn),
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
            wait_for(lambda: scalar(conn, "select n from account") == 1 and _drained(conn),
                     what="the effect", dsn=dsn)
    assert len(calls) == 1  # handled once, on the session it started on
