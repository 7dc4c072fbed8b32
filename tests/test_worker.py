"""The Worker: skip policy, fair sharing of slots, clean stops, reconnects,
lanes whose sessions cannot connect or are lost, targeted wakeups, and lanes
that ack and receive in one call (fusing) under a backlog without starving a
newcomer, another slot or a stop."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import (
    first_value,
    lane_pids,
    queue_with_effects,
    scalar,
    slot_keys,
    slots_drained,
    wait_for,
)
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque import client as client_sync
from pgque import client_async

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)

WORKER_SCRIPT = str(Path(__file__).with_name("worker_process.py"))


def make_queue(client: pgque.Client, **config: Any) -> None:
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=200, **config)


def no_batch_open_no_lock(conn: psycopg.Connection[Any]) -> None:
    assert scalar(conn, "select count(*) from pgque.consumer_info "
                        "where open_batch_id is not null") == 0
    assert scalar(conn, "select count(*) from pgque.partition_slot_status "
                        "where owner_pid is not null") == 0


def test_skip_policy_retries_failed_event_on_its_slot_then_dead_letters(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pgque.worker")
    make_queue(client, max_retries=2)
    client.subscribe_slots("q", "g", slots=4)
    ids = client.send_batch("q", [("e", {"n": i}, f"tenant-{i % 6}") for i in range(60)])
    poison = ids[17]
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        with lock:
            seen.append((message.id, message.retry_count))
        if message.id == poison:
            raise RuntimeError("cannot process this one")

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=4, handler=handler,
                          retry_after=0, poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.1))
    with worker:
        wait_for(lambda: client.dead_letters("q"), timeout=30, what="the dead letter", dsn=dsn)
    handled = Counter(i for i, _ in seen)
    assert all(handled[i] == 1 for i in ids if i != poison)  # the rest of each batch went on
    assert [r for i, r in seen if i == poison] == [0, 1, 2]  # retried, then given up
    [letter] = client.dead_letters("q")
    assert client.dead_letters("q", "g") == [letter]  # found by the group's name too
    slot = scalar(conn, "select pgque.slot_of(%s, 4)", (letter.partition_key,))
    assert letter.event_id == poison
    assert letter.consumer == f"g#{slot}/4"  # retried and dead-lettered on its own slot
    assert "RuntimeError: cannot process this one" in (letter.reason or "")
    assert worker.failed == 3
    # A line per failure, the traceback with the first one only.
    failures = [r for r in caplog.records
                if f": handler failed for event {poison} " in r.getMessage()]
    assert [bool(r.exc_info) for r in failures] == [True, False, False]
    no_batch_open_no_lock(conn)


def test_two_workers_share_eight_slots_and_a_third_joins(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    make_queue(client)
    client.subscribe_slots("q", "g", slots=8)
    handled: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler_for(name: str) -> Any:
        def handler(message: pgque.Message[Any]) -> None:
            with lock:
                handled[name].append(message.id)
        return handler

    def worker(name: str) -> pgque.Worker[Any]:
        return pgque.Worker(dsn, queue="q", consumer="g", slots=8, handler=handler_for(name),
                            concurrency=2, poll_interval=0.05, rebalance_interval=0.1)

    a, b = worker("a"), worker("b")
    with a, b:
        wait_for(lambda: len(a.owned_slots) == 4 and len(b.owned_slots) == 4,
                 what="an even split", dsn=dsn)
        assert a.owned_slots.isdisjoint(b.owned_slots)
        ids = client.send_batch("q", [("e", i, f"k{i}") for i in range(400)])
        wait_for(lambda: sum(len(v) for v in handled.values()) >= 400, timeout=30,
                 what="all events handled", dsn=dsn)
        assert sorted(handled["a"] + handled["b"]) == ids
        with worker("c") as c:
            wait_for(lambda: len(c.owned_slots) >= 2, what="the newcomer to get slots", dsn=dsn)
            wait_for(lambda: sorted(len(w.owned_slots) for w in (a, b, c)) == [2, 3, 3],
                     what="a fair split of 8 slots over 3 workers", dsn=dsn)
            more = client.send_batch("q", [("e", i, f"k{i}") for i in range(300)])
            wait_for(lambda: sum(len(v) for v in handled.values()) >= 700, timeout=30,
                     what="all events handled", dsn=dsn)
            assert handled["c"], "the newcomer handled nothing"
        # c stopped: its slots go back to a and b.
        wait_for(lambda: len(a.owned_slots | b.owned_slots) == 8,
                 what="slots to be taken back", dsn=dsn)
    everything = handled["a"] + handled["b"] + handled["c"]
    assert sorted(everything) == ids + more
    no_batch_open_no_lock(conn)


def test_sigterm_stops_a_worker_process_cleanly(client: pgque.Client, dsn: str,
                                               conn: psycopg.Connection[Any]) -> None:
    make_queue(client)
    client.subscribe_slots("q", "g", slots=4)
    conn.execute("create table handled (id bigserial primary key, ev_id bigint, key text, "
                 "producer int, seq int, pid int, retry int, started timestamptz, "
                 "ended timestamptz)")
    proc = subprocess.Popen([sys.executable, WORKER_SCRIPT, dsn, "q", "g", "4", "5", "1"])
    try:
        wait_for(lambda: client.group_status("q", "g").members == 1,
                 what="worker to join", dsn=dsn)
        ids = client.send_batch("q", [("e", {"p": 0, "s": i}, f"k{i % 9}") for i in range(200)])
        wait_for(lambda: scalar(conn, "select count(distinct ev_id) from handled") == 200,
                 timeout=30, what="events handled", dsn=dsn)
        wait_for(lambda: scalar(conn, "select count(*) from pgque.partition_slot_status "
                                      "where owner_pid is not null") == 4,
                 what="4 owned slots", dsn=dsn)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert scalar(conn, "select count(*) from handled where ended is null") == 0
    assert sorted(r[0] for r in conn.execute("select ev_id from handled")) == ids
    no_batch_open_no_lock(conn)


def test_workers_survive_a_server_restart(client: pgque.Client, dsn: str,
                                          restartable_server: Any) -> None:
    make_queue(client)
    client.subscribe_slots("q", "g", slots=4)
    handled: list[pgque.Message[Any]] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        with lock:
            handled.append(message)

    def count() -> int:
        with lock:
            return len({m.id for m in handled})

    workers = [pgque.Worker(dsn, queue="q", consumer="g", slots=4, handler=handler,
                            poll_interval=0.05, rebalance_interval=0.1) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        first = client.send_batch("q", [("e", i, f"k{i % 7}") for i in range(300)])
        wait_for(lambda: count() >= 100, timeout=30, what="handling to start", dsn=dsn)
        restartable_server.restart()
        client.close()
        with pgque.connect(dsn) as fresh:
            second = fresh.send_batch("q", [("e", i, f"k{i % 7}") for i in range(300, 600)])
            wait_for(lambda: count() == 600, timeout=60, what="all events after the restart",
                     dsn=dsn)
    finally:
        for w in workers:
            w.stop()
    sent = first + second
    assert {m.id for m in handled} == set(sent)  # nothing lost
    # Per key, the first handling of each event follows send order (events of a
    # batch cut short by the restart are delivered again, after their first time).
    first_seen: dict[str, list[int]] = defaultdict(list)
    for m in handled:
        assert m.partition_key is not None
        if m.id not in first_seen[m.partition_key]:
            first_seen[m.partition_key].append(m.id)
    for key, order in first_seen.items():
        assert order == sorted(order), key


def test_newcomer_gets_slots_while_the_others_are_busy(client: pgque.Client, dsn: str,
                                                       conn: psycopg.Connection[Any]) -> None:
    """Under a backlog every slot is always busy; surplus slots must still move to
    a worker that joins, at a batch boundary."""
    make_queue(client)
    client.subscribe_slots("q", "g", slots=4)
    handled: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler_for(name: str) -> Any:
        def handler(message: pgque.Message[Any]) -> None:
            threading.Event().wait(0.002)  # a slow handler keeps every slot busy
            with lock:
                handled[name].append(message.id)
        return handler

    def worker(name: str) -> pgque.Worker[Any]:
        return pgque.Worker(dsn, queue="q", consumer="g", slots=4, handler=handler_for(name),
                            max_events=10, rebalance_interval=0.1)

    ids = client.send_batch("q", [("e", i, f"k{i}") for i in range(1500)])
    a, b = worker("a"), worker("b")
    with a, b:
        wait_for(lambda: len(handled["a"]) + len(handled["b"]) >= 100, what="a busy start", dsn=dsn)
        with worker("c") as c:
            wait_for(lambda: len(c.owned_slots) >= 1, timeout=10,
                     what="the newcomer to get a slot under load", dsn=dsn)
            wait_for(lambda: sum(len(v) for v in handled.values()) >= 1500, timeout=60,
                     what="the backlog to drain", dsn=dsn)
    assert handled["c"], "the newcomer handled nothing"
    assert sorted(handled["a"] + handled["b"] + handled["c"]) == ids
    no_batch_open_no_lock(conn)


def test_a_payload_too_deep_to_decode_is_retried_then_dead_lettered(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The server accepts JSON nested deeper than Python can decode: the handler's
    access to the payload fails with PayloadError, which is nacked like any failure."""
    make_queue(client, max_retries=1)
    client.subscribe_slots("q", "g", slots=2)
    conn.execute("select pgque.send('q', 'deep', %s::text, 'k')", ("[" * 5000 + "]" * 5000,))
    ids = client.send_batch("q", [("e", {"n": i}, "k") for i in range(5)])
    handled: list[int] = []

    def handler(message: pgque.Message[Any]) -> None:
        message.payload  # noqa: B018
        handled.append(message.id)

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler,
                          retry_after=0, poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.1))
    with worker:
        wait_for(lambda: client.dead_letters("q"), timeout=30, what="the dead letter", dsn=dsn)
        wait_for(lambda: len(handled) == len(ids) or None, timeout=30, what="the rest", dsn=dsn)
    [letter] = client.dead_letters("q")
    assert letter.type == "deep"
    assert "PayloadError" in (letter.reason or "")
    assert sorted(handled) == ids  # the slot went on past it
    assert worker.failed == 2


def test_a_tick_wakes_only_the_lanes_whose_slots_it_has_events_for(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """With N slots on N lanes (transactional handlers: a lane per slot), a tick
    that holds events of one slot makes one lane receive, not N: the control
    asks pending_slots and wakes that slot's lane only. Polls are 30 s apart
    and keepalives 20 s here, so within the test only a wakeup makes a lane
    send anything, and only the notification path can deliver the events in
    time."""
    make_queue(client)
    client.subscribe_slots("q", "g", slots=8)
    handled: list[int] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any], conn: Any) -> None:
        with lock:
            handled.append(message.id)

    def lanes() -> dict[int, tuple[str, Any]]:
        """Each lane's backend pid: its state and when its last statement began."""
        rows = conn.execute("select pid, state, query, query_start from pg_stat_activity"
                            " where application_name ~ '-lane[0-9]+$'"
                            "   and datname = current_database()").fetchall()
        return {pid: (f"{state}: {query}", start) for pid, state, query, start in rows}

    def settled() -> dict[int, tuple[str, Any]] | None:
        now = lanes()
        done = len(now) == 8 and all(state.startswith("idle: ") and "receive_partitioned" in state
                                     for state, _ in now.values())
        return now if done else None

    key = "tenant-1"
    slot = scalar(conn, "select pgque.slot_of(%s, 8)", (key,))
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=8, handler=handler,
                          transactional=True, ticker=False, poll_interval=30.0,
                          network_timeout=60.0)
    with worker:
        wait_for(lambda: len(worker.owned_slots) == 8, timeout=20, what="all 8 slots", dsn=dsn)
        before = wait_for(settled, timeout=20, what="each slot's first receive", dsn=dsn)
        owner = scalar(conn, "select owner_pid from pgque.partition_slot_status"
                             " where queue_name = 'q' and slot = %s", (slot,))
        sent = []
        for n in range(5):
            sent.append(client.send("q", "e", {"n": n}, partition_key=key))
            client.tick("q")
            wait_for(lambda n=n: len(handled) == n + 1, timeout=10, what=f"event {n}", dsn=dsn)
        after = lanes()
    assert handled == sent
    assert after[owner][1] > before[owner][1]
    woken = sorted(pid for pid in before if pid != owner and after[pid] != before[pid])
    assert woken == [], f"lanes of other slots than {slot} made calls: {woken}"


def test_key_concurrency_runs_keys_of_a_slot_at_once_never_one_key_twice(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """key_concurrency=4 on one slot: events of different keys overlap (up to 4
    at once), events of one key never do and come in send order; a failed
    event is nacked and retried like any other, every event handled."""
    make_queue(client)
    client.subscribe_slots("q", "g", slots=1)
    keys = [f"tenant-{n}" for n in range(6)]
    sent: dict[str, list[int]] = {key: [] for key in keys}
    for n in range(60):
        key = keys[n % len(keys)]
        sent[key].append(client.send("q", "e", {"n": n}, partition_key=key))
    poison = sent["tenant-2"][3]
    lock = threading.Lock()
    running: dict[str, int] = defaultdict(int)
    busy = [0, 0]  # now, most at once
    first_seen: dict[str, list[int]] = defaultdict(list)
    seen: set[int] = set()
    overlaps: list[str] = []
    done = threading.Event()
    gate = threading.Barrier(2, timeout=10)  # two keys meet: they do run at once

    def handler(message: pgque.Message[Any]) -> None:
        key = message.partition_key
        assert key is not None
        with lock:
            running[key] += 1
            if running[key] > 1:
                overlaps.append(key)
            busy[0] += 1
            busy[1] = max(busy)
            if message.id not in seen:
                seen.add(message.id)
                first_seen[key].append(message.id)
            meet = message.id in (sent["tenant-0"][0], sent["tenant-1"][0])
        try:
            if meet:
                gate.wait()
            threading.Event().wait(0.005)
            if message.id == poison and message.retry_count == 0:
                raise RuntimeError("fails once")
        finally:
            with lock:
                running[key] -= 1
                busy[0] -= 1
                if len(seen) == 60 and message.retry_count == 1:
                    done.set()

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handler,
                          key_concurrency=4, retry_after=0, poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.1))
    with worker:
        assert done.wait(30), f"handled {len(seen)} of 60"
    assert overlaps == []
    assert 2 <= busy[1] <= 4
    assert dict(first_seen) == sent
    assert worker.failed == 1 and worker.handled == 60
    no_batch_open_no_lock(conn)


@pytest.mark.parametrize(("options", "message"), [
    ({"key_concurrency": 0}, "key_concurrency must be at least 1"),
    ({"key_concurrency": 2, "transactional": True}, "key_concurrency must be 1"),
])
def test_key_concurrency_is_checked(dsn: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=lambda m, *rest: None,
                     ticker=False, **options)


# -- lanes whose sessions cannot connect or are lost ------------------------------------------


@pytest.fixture
def limited_dsn(dsn: str) -> Iterator[str]:
    """A DSN of a login role (a pgque reader) with CONNECTION LIMIT 2."""
    role = f"pgque_rv11_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(sql.SQL("create role {} login connection limit 2").format(
            sql.Identifier(role)))
        su.execute(sql.SQL("grant pgque_reader, pgque_writer to {}").format(sql.Identifier(role)))
        params = conninfo_to_dict(dsn)
        try:
            yield make_conninfo(**{**params, "user": role})  # type: ignore[arg-type]
        finally:
            su.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                       "where usename = %s", (role,))
            wait_for(lambda: not scalar(su, "select count(*) from pg_stat_activity "
                                            "where usename = %s", (role,)),
                     what="the role's sessions to end")
            su.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
            su.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_the_slots_of_a_lane_that_cannot_connect_are_handled_by_a_connected_one(
        client: pgque.Client, limited_dsn: str, dsn: str,
        conn: psycopg.Connection[Any]) -> None:
    """A lane that cannot connect (max_connections or the role's connection limit
    reached) strands none of the slots handed to it: they go to a lane that has a
    session, which takes turns between its slots. With the role's limit leaving
    the worker one lane, the events of both slots are handled."""
    client.create_queue("q", ticker_max_lag=0)
    with pgque.connect(limited_dsn) as owner:  # the role subscribes (owns) the group
        owner.subscribe_slots("q", "g", slots=2)
    seen: set[str] = set()

    def handle(message: pgque.Message[Any]) -> None:
        seen.add(message.partition_key or "")

    keys = {}
    for n in range(40):
        keys.setdefault(scalar(conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)), f"k{n}")
    # Control + one lane fill the limit of 2; the second lane cannot connect.
    with pgque.Worker(limited_dsn, queue="q", consumer="g", slots=2, handler=handle,
                      ticker=False, connect_timeout=2, rebalance_interval=0.2,
                      poll_interval=0.05, name="limited") as worker, pgque.Ticker(dsn):
        wait_for(lambda: worker.sessions == 1, what="a first lane", dsn=dsn)
        client.send_batch("q", [("e", 0, keys[0]), ("e", 1, keys[1])])
        wait_for(lambda: seen == {keys[0], keys[1]}, timeout=20,
                 what="the events of both slots", dsn=dsn)


def test_stop_while_a_lane_is_connecting(
        client: pgque.Client, limited_dsn: str, dsn: str,
        conn: psycopg.Connection[Any]) -> None:
    """A stop while a lane retries its connection (the role's limit reached) returns
    promptly; the worker's threads end and its sessions close, and the slot of the
    connected lane is released with its epoch ended."""
    client.create_queue("q", ticker_max_lag=0)
    with pgque.connect(limited_dsn) as owner:
        owner.subscribe_slots("q", "g", slots=2)
    worker = pgque.Worker(limited_dsn, queue="q", consumer="g", slots=2,
                          handler=lambda m: None, ticker=False, connect_timeout=30,
                          concurrency=2, rebalance_interval=0.2, name="stopconn")
    worker.start()
    try:
        wait_for(lambda: worker.sessions == 1 and len(worker.owned_slots) == 1,
                 what="one lane connected", dsn=dsn)
        # An event of the owned slot, so that it takes an epoch (a slot with
        # nothing in its ticks returns before taking one).
        (owned,) = worker.owned_slots
        key = next(k for k in (f"k{n}" for n in range(100))
                   if scalar(conn, "select pgque.slot_of(%s, 2)", (k,)) == owned)
        client.send("q", "e", 1, partition_key=key)
        client.tick("q")
        wait_for(lambda: scalar(conn, "select count(*) from pgque.slot_claim "
                                      "where sc_pid is not null"),
                 what="an epoch", dsn=dsn)
        time.sleep(0.5)  # the fault: the second lane is retrying its connection
        started = time.monotonic()
        worker.stop(timeout=10)
        assert not worker.alive and time.monotonic() - started < 5
    finally:
        worker.stop(timeout=10)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("stopconn")],
             what="the worker's threads to end", dsn=dsn)
    wait_for(lambda: not scalar(conn, "select count(*) from pg_stat_activity "
                                      "where application_name like 'stopconn%%'"),
             what="the worker's sessions to close", dsn=dsn)
    assert scalar(conn, "select count(*) from pgque.slot_claim where sc_pid is not null") == 0


def test_a_lost_control_session_keeps_the_lanes(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The control session ends while the lanes live: the worker reconnects its
    control, keeps its lanes and slots (no second lane per slot), and stays within
    concurrency + 1 sessions; every event is handled once."""
    queue_with_effects(client, conn, slots=4)
    seen: list[int] = []
    lock = threading.Lock()

    def handle(message: pgque.Message[Any]) -> None:
        with lock:
            seen.append(message.payload)

    with pgque.Worker(dsn, queue="q", consumer="g", slots=4, handler=handle, concurrency=2,
                      ticker=False, rebalance_interval=0.2, poll_interval=0.05,
                      name="ctl") as worker, pgque.Ticker(dsn):
        wait_for(lambda: len(worker.owned_slots) == 4 and worker.sessions == 2,
                 what="every slot", dsn=dsn)
        lanes = lane_pids(conn, "ctl")
        control = scalar(conn, "select pid from pg_stat_activity where application_name = 'ctl'")
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (control,))
        wait_for(lambda: first_value(conn, "select pid from pg_stat_activity where "
                                      "application_name = 'ctl' and pid <> %s", (control,)),
                 what="a new control session", dsn=dsn)
        client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
        wait_for(lambda: sorted(seen) == list(range(20)), what="every event", dsn=dsn)
        assert lane_pids(conn, "ctl") == lanes
        assert worker.sessions == 2
        assert scalar(conn, "select count(*) from pg_stat_activity "
                            "where application_name like 'ctl%%'") == 3


def test_a_lane_that_lost_its_session_keeps_its_slot_until_the_handler_returns(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A lane's session is terminated while its (non-transactional) handler runs; the
    worker does not claim that slot on another lane until the handler has
    returned, so one worker never runs two handlers of a slot at once; the event
    is then delivered again and handled."""
    queue_with_effects(client, conn, slots=2)
    key = next(f"k{n}" for n in range(100)
               if scalar(conn, "select pgque.slot_of(%s, 2)", (f"k{n}",)) == 0)
    running = 0
    most = 0
    calls: list[int] = []
    lock = threading.Lock()
    entered = threading.Event()
    release = threading.Event()

    def handle(message: pgque.Message[Any]) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            calls.append(message.id)
        try:
            if len(calls) == 1:
                entered.set()
                release.wait(30)
        finally:
            with lock:
                running -= 1

    with pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handle, concurrency=2,
                      ticker=False, rebalance_interval=0.1, poll_interval=0.05,
                      name="inhand") as worker, pgque.Ticker(dsn):
        wait_for(lambda: len(worker.owned_slots) == 2 and worker.sessions == 2,
                 what="both slots", dsn=dsn)
        [ev] = client.send_batch("q", [("e", 1, key)])
        assert entered.wait(30)
        owner = scalar(conn, "select owner_pid from pgque.partition_slot_status where slot = 0")
        assert scalar(conn, "select pg_terminate_backend(%s, 10000)", (owner,))
        deadline = time.monotonic() + 1.5  # 15 rebalance intervals
        while time.monotonic() < deadline:
            assert first_value(conn, "select owner_pid from pgque.partition_slot_status "
                                "where slot = 0") is None
            time.sleep(0.05)
        release.set()
        wait_for(lambda: calls == [ev, ev] and slots_drained(conn), timeout=30,
                 what="the event again", dsn=dsn)
    assert most == 1


@pytest.mark.parametrize("slots,concurrency", [(8, 2), (8, 8), (1, 1)])
def test_targeted_wakeups_deliver_every_slot_long_before_the_poll(
        client: pgque.Client, conn: psycopg.Connection[Any], dsn: str, slots: int,
        concurrency: int) -> None:
    """With a poll_interval of 30 s, only tick notifications and pending_slots
    can bring a slot's events in time. Events for one slot after another (lanes
    owning several slots, one slot per lane, a worker of one slot), and a retry
    that comes back through maintenance, each reach the handler within a few
    seconds."""
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
            [key] = slot_keys(conn, slot, slots, 1, prefix=f"w{slot}-")
            sent = client.send("q", "e", None, partition_key=key)
            wait_for(lambda: sent in seen, timeout=5,  # noqa: B023 (called at once)
                     what=f"event of slot {slot}")
        [key] = slot_keys(conn, slots - 1, slots, 1, prefix="retry-")
        ev = client.send("q", "e", None, partition_key=key)
        wait_for(lambda: seen.get(ev) == 1, timeout=8, what="the retry")
    finally:
        worker.stop()


# -- lanes that fuse the ack and the next receive under a backlog ---------------------------


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


def test_under_a_backlog_a_newcomer_gets_its_share_order_holds_and_stop_is_prompt(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One lane per slot, so each lane always fuses while it has a backlog: a
    second worker still gets a slot (the release request stops the fusing),
    each key's events come in send order with none lost or twice, and a stop
    comes within a piece or so."""
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


def test_a_fusing_lane_still_polls_its_other_slot(client: pgque.Client, dsn: str) -> None:
    """One lane with both slots (concurrency=1), no notifications: while one
    slot has a backlog the lane fuses on it, but the other slot's event is
    handled after about a poll interval, not after the backlog."""
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
                          max_events=5, rebalance_interval=0.1, poll_interval=0.05,
                          concurrency=2)  # a lane per slot: each fuses on its own
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


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of a Client method (either client flavour)."""
    calls = [0]
    sync_method = getattr(client_sync.Client, name)
    async_method = getattr(client_async.AsyncClient, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return sync_method(self, *args, **kwargs)

    async def acounted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await async_method(self, *args, **kwargs)

    monkeypatch.setattr(client_sync.Client, name, counted)
    monkeypatch.setattr(client_async.AsyncClient, name, acounted)
    return calls


def test_a_plain_worker_serves_all_its_slots_on_one_session_in_one_call(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain handlers: one lane (one session) serves the worker's 8 slots, and
    its idle slots poll together, one receive for all of them per poll
    interval, not one per slot (which made an idle worker's cost and a busy
    one's server CPU grow with its slots); a tick is received in one call too,
    and its events handled."""
    receives = count_calls(monkeypatch, "_receive_slot_pieces")
    one_by_one = count_calls(monkeypatch, "receive_partitioned")
    make_queue(client)
    client.subscribe_slots("q", "g", slots=8)
    handled: list[int] = []
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=8,
                          handler=lambda m: handled.append(m.id), ticker=False,
                          poll_interval=0.2)
    with worker:
        wait_for(lambda: len(worker.owned_slots) == 8, what="all 8 slots", dsn=dsn)
        assert worker.sessions == 1
        wait_for(lambda: receives[0] >= 2, what="the first polls", dsn=dsn)
        start, before = time.monotonic(), receives[0]
        time.sleep(2.0)  # the window measured: polls in 2 s of idling
        polls = receives[0] - before
        elapsed = time.monotonic() - start
        assert polls <= elapsed / 0.2 + 3, polls  # one lane's polls, not one per slot
        ids = client.send_batch("q", [("e", n, f"k{n}") for n in range(40)])
        client.tick("q")
        wait_for(lambda: sorted(handled) == ids, what="the tick's events", dsn=dsn)
    assert one_by_one[0] == 0


def test_a_process_that_exits_without_stopping_its_worker_does_not_wait_for_handlers(
        client: pgque.Client, dsn: str, tmp_path: Path) -> None:
    """The Worker's threads are daemon threads, the handlers' too (plain
    handlers run on the lane's own threads since 0.8): a script that starts a
    Worker and returns while a handler blocks exits at once, as before, not
    when the handler returns."""
    make_queue(client)
    client.subscribe_slots("q", "g", slots=2)
    client.send("q", "e", 1, partition_key="k")
    entered = tmp_path / "entered"
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys, threading, pathlib, pgque\n"
        "entered = threading.Event()\n"
        "def handle(message):\n"
        "    entered.set()\n"
        "    threading.Event().wait(120)  # a handler that does not return soon\n"
        f"worker = pgque.Worker({dsn!r}, queue='q', consumer='g', slots=2, handler=handle)\n"
        "worker.start()\n"
        "assert entered.wait(60)\n"
        f"pathlib.Path({str(entered)!r}).touch()\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script)],
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.wait(30) == 0  # not the handler's 120 s
        assert entered.exists()
    finally:
        proc.kill()
