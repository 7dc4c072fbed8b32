"""Always-on ticking: one elected ticker per database, prompt takeover, quiet when
idle, wakeups that may be lost, and a Worker that needs nothing else."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from helpers import drain, dump_state, long_variant, run_in_thread, scalar, wait_for
from psycopg.conninfo import make_conninfo

import pgque


def max_tick(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "select coalesce(max(tick_id), 0) from pgque.tick"))


def test_only_one_ticker_ticks_and_standby_takes_over(client: pgque.Client, dsn: str,
                                                      conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    first = pgque.Ticker(dsn, standby_interval=0.1, name="ticker-a")
    second = pgque.Ticker(dsn, standby_interval=0.1, name="ticker-b")
    first.start()
    assert first.wait_active(10)
    second.start()
    try:
        for n in range(20):
            before = max_tick(conn)
            client.send("q", "e", n)
            wait_for(lambda b=before: max_tick(conn) > b, what="a tick after a send", dsn=dsn)
        # The ticker counts a tick just after its commit, which the loop may see first.
        wait_for(lambda: first.ticks >= 20, what="the active ticker's count", dsn=dsn)
        assert second.ticks == 0
        assert not second.active

        # The active ticker dies: its session ends, and the lock with it.
        first.request_stop()  # its thread must not reconnect and compete
        scalar(conn, "select pg_terminate_backend(%s)", (first.backend_pid,))
        died = time.monotonic()
        assert second.wait_active(1.0), "the standby did not take over within 1 s"
        took_over = time.monotonic() - died
        before = max_tick(conn)
        client.send("q", "e", "after")
        wait_for(lambda: max_tick(conn) > before, what="ticks from the new active ticker", dsn=dsn)
        # As above: its count follows its commit, which the loop may see first.
        wait_for(lambda: second.ticks >= 1, what="the new active ticker's count", dsn=dsn)
        assert took_over < 1.0
    finally:
        first.stop()
        second.stop()


#: The WAL a quiet period may cost: 256 KiB per 30 s (a tick writes about 500 bytes;
#: a poll that wrote anything would show).
WAL_PER_QUIET_SECOND = 256 * 1024 / 30

#: The WAL from `since` of the transactions that changed one of pgque's relations,
#: every record of theirs, with summaries of those records and of all the others.
#: WAL is cluster-wide, and housekeeping, here or in other databases, must not
#: count: an autovacuum or autoanalyze (of catalogs install changed, of an earlier
#: test's database) writes without a transaction id, or only to the catalogs.
_PGQUE_WAL = """
    with wal as (select * from pg_get_wal_records_info(%(since)s, %(until)s)),
         pgque_files as (select array_agg(pg_relation_filenode(c.oid)) as files
                           from pg_class c
                          where c.relnamespace = 'pgque'::regnamespace
                             or c.oid in (select reltoastrelid from pg_class
                                           where relnamespace = 'pgque'::regnamespace)),
         writers as (select distinct w.xid::text as xid
                       from wal w
                      cross join lateral regexp_matches(
                          w.block_ref,
                          'rel [0-9]+/' || (select oid from pg_database
                                             where datname = current_database()) || '/([0-9]+)',
                          'g') as m(ref)
                      where w.xid::text <> '0'
                        and m.ref[1]::oid = any((select files from pgque_files)::oid[])),
         ours as (select * from wal where xid::text in (select xid from writers))
    select coalesce(sum(record_length), 0),
           (select string_agg(resource_manager || '/' || record_type || ' ' || n, ', ')
              from (select resource_manager, record_type, count(*) as n from ours
                     group by 1, 2 order by 3 desc limit 8) as mine),
           (select string_agg(resource_manager || '/' || record_type || ' ' || n, ', ')
              from (select resource_manager, record_type, count(*) as n
                      from wal where start_lsn not in (select start_lsn from ours)
                     group by 1, 2 order by 3 desc limit 8) as other)
    from ours
"""


def wal_meter(conn: psycopg.Connection[Any]) -> Callable[[str], tuple[int, str]]:
    """A function giving the WAL bytes since an insert LSN of the transactions that
    changed pgque's relations, with what they and the others wrote; the cluster-wide
    LSN difference where pg_walinspect cannot be installed. Install it before the
    LSN is taken: the install writes WAL."""
    try:
        with conn.transaction():
            conn.execute("create extension if not exists pg_walinspect")
    except psycopg.Error:
        def cluster_wal(since: str) -> tuple[int, str]:
            total = scalar(conn, "select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)",
                           (since,))
            return int(total), "cluster-wide: pg_walinspect is not available"
        return cluster_wal

    def pgque_wal(since: str) -> tuple[int, str]:
        # pg_walinspect reads flushed WAL only, and commits here do not wait
        # for the flush (synchronous_commit = off): the WAL writer's, then.
        until = str(scalar(conn, "select pg_current_wal_insert_lsn()"))
        if scalar(conn, "select %s::pg_lsn <= %s::pg_lsn", (until, since)):
            return 0, "no WAL at all"
        wait_for(lambda: scalar(conn, "select pg_current_wal_flush_lsn() >= %s", (until,)),
                 what="the WAL to be flushed", dsn=conn.info.dsn)
        row = conn.execute(_PGQUE_WAL, {"since": since, "until": until}).fetchone()
        assert row is not None
        counted, others = row[1] or "none", row[2] or "none"
        return int(row[0]), f"records: {counted}; not counted: {others}"
    return pgque_wal


@pytest.mark.slow
@pytest.mark.parametrize(("idle_period", "quiet"), [(2, 6), long_variant(10, 30, id="10-30-long")])
def test_idle_queue_costs_almost_nothing(client: pgque.Client, dsn: str,
                                         conn: psycopg.Connection[Any], idle_period: int,
                                         quiet: int) -> None:
    """A quiet period of three idle periods (the ticker falls asleep after 2 s,
    marking the queue once, and polls every second): about one tick per idle
    period, and next to no WAL."""
    client.create_queue("q", ticker_idle_period=idle_period)
    wal_since = wal_meter(conn)
    with pgque.Ticker(dsn) as ticker:
        assert ticker.wait_active(10)
        client.send("q", "e", 0)
        wait_for(lambda: ticker.ticks >= 1, what="the first tick", dsn=dsn)
        ticks_before = max_tick(conn)
        # The insert position: the write position (pg_current_wal_lsn) may lag
        # behind by all of create_queue's WAL, commits here not waiting for it.
        lsn_before = str(scalar(conn, "select pg_current_wal_insert_lsn()"))
        time.sleep(quiet)  # the quiet period being measured, not a synchronization
        ticks = max_tick(conn) - ticks_before
        wal, others = wal_since(lsn_before)
    assert ticks <= 4, f"{ticks} ticks in {quiet} s of silence with a {idle_period} s idle period"
    assert ticks >= 2, f"the idle period asks for a tick every {idle_period} s"
    assert wal < WAL_PER_QUIET_SECOND * quiet, \
        f"{wal} bytes of WAL in {quiet} s of silence ({others})"


def asleep(conn: psycopg.Connection[Any]) -> bool:
    """Whether every queue is marked as having a sleeping ticker."""
    return bool(scalar(conn, "select bool_and(queue_ticker_asleep) from pgque.queue"))


def marked(conn: psycopg.Connection[Any], queue: str) -> bool:
    """Whether the queue is marked as asleep (its sends notify the ticker)."""
    return bool(scalar(conn, "select queue_ticker_asleep from pgque.queue where queue_name = %s",
                       (queue,)))


def test_an_idle_ticker_falls_asleep_and_a_send_wakes_its_queue_at_once(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """An idle queue is marked asleep, and the ticker looks at every queue only
    every idle_interval and maintenance_interval (here a minute each): the tick of
    a send that comes meanwhile is the send's notification's doing. Its queue is
    then unmarked (hot, polled often) while the others sleep on, and it falls
    asleep again once quiet for idle_after."""
    client.create_queue("q")
    client.create_queue("other")
    with pgque.Ticker(dsn, idle_after=0.3, idle_interval=60, maintenance_interval=60) as ticker:
        assert ticker.wait_active(10)
        for n in range(3):
            wait_for(lambda: asleep(conn), what="the ticker asleep", dsn=dsn)
            before = max_tick(conn)
            client.send("q", "e", n)
            wait_for(lambda b=before: max_tick(conn) > b, what="a tick after a send",
                     timeout=30, dsn=dsn)  # far from the minute's look
            # Unmarked just after that tick's commit, in a transaction of its own.
            wait_for(lambda: not marked(conn, "q"), what="the queue unmarked", timeout=30,
                     dsn=dsn)
            assert marked(conn, "other")


def test_a_busy_queue_is_polled_alone_while_the_others_sleep(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """With thousands of queues, a poll of every queue every few milliseconds
    costs a core for the few that are busy. The ticker polls often only the
    queues it ticked lately: while one queue is busy the others stay marked
    asleep, and, with the look at every queue a minute away, a send into one is
    ticked at once all the same, by its notification."""
    for name in ("busy", "idle", "late"):
        client.create_queue(name)
    with pgque.Ticker(dsn, idle_after=5, idle_interval=60, maintenance_interval=60) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="every queue asleep", dsn=dsn)
        for n in range(10):
            before = max_tick(conn)
            client.send("busy", "e", n)
            wait_for(lambda b=before: max_tick(conn) > b, what="the busy queue's tick",
                     timeout=30, dsn=dsn)
        assert not marked(conn, "busy")
        assert marked(conn, "idle") and marked(conn, "late")
        before = max_tick(conn)
        client.send("late", "e", 0)
        wait_for(lambda: max_tick(conn) > before, what="the sleeping queue's tick", timeout=30,
                 dsn=dsn)
        wait_for(lambda: not marked(conn, "late"), what="the queue unmarked", dsn=dsn)
        assert marked(conn, "idle")


def test_a_sleeping_queues_send_is_heard_however_long_the_hot_polls_take(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A pass over the hot queues that takes longer than min_interval (here 0)
    must still read the notifications that came meanwhile: the wait for them
    gave up at its deadline before reading any, and a send into a sleeping
    queue waited until the busy queue cooled or every queue was looked at (two
    minutes away here)."""
    client.create_queue("busy")
    client.create_queue("late")
    with pgque.Ticker(dsn, min_interval=0, idle_after=120, idle_interval=120,
                      maintenance_interval=120) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="every queue asleep", dsn=dsn)
        before = max_tick(conn)
        client.send("busy", "e", 0)
        wait_for(lambda: max_tick(conn) > before and not marked(conn, "busy"),
                 what="the busy queue hot", timeout=30, dsn=dsn)
        before = max_tick(conn)
        client.send("late", "e", 0)
        # Far sooner than the busy queue cools or every queue is looked at.
        wait_for(lambda: max_tick(conn) > before, what="the sleeping queue's tick", timeout=20,
                 dsn=dsn)
        assert ticker.error is None


def test_notifications_that_tick_nothing_are_looked_at_no_more_than_every_50_ms(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Sends into a sleeping queue whose ticker_max_lag holds its tick back each
    notify, and each look ticks nothing: the ticker looks at that queue again no
    sooner than 50 ms after, however many notifications come (a look per
    notification made it spend a fifth of a core on one busy producer)."""
    client.create_queue("slow", ticker_max_lag=3600, ticker_max_count=100_000)
    with pgque.Ticker(dsn, idle_after=0.3, idle_interval=60, maintenance_interval=60) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="every queue asleep", dsn=dsn)
        looks = ticker.looks
        started = time.monotonic()
        for n in range(200):
            client.send("slow", "e", n)
        elapsed = time.monotonic() - started
        time.sleep(0.2)  # the looks still due, not a synchronization: counted below
        made = ticker.looks - looks
        assert ticker.ticks == 0 and marked(conn, "slow")
    assert made <= 5 + (elapsed + 0.2) / 0.05, f"{made} looks for 200 notifications in " \
        f"{elapsed:.2f} s"


def test_a_notification_that_ticks_nothing_leaves_the_ticker_asleep(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Anyone may NOTIFY the ticker's channel: with a queue's id the ticker looks
    at that queue (one ticker_some call), finds nothing to tick and sleeps on,
    writing nothing (waking and falling asleep again would cost two writes each
    time); with anything else it does not look, and stays on its session (a
    payload such as '²' passed str.isdigit() and made int() raise: any role that
    could connect could knock the ticker off its election). A send still wakes it."""
    client.create_queue("q")
    queue_id = scalar(conn, "select queue_id from pgque.queue where queue_name = 'q'")
    with pgque.Ticker(dsn, idle_after=0.3, idle_interval=60, maintenance_interval=60) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="the ticker asleep", dsn=dsn)
        pid = ticker.backend_pid
        with psycopg.connect(dsn, autocommit=True) as outsider:
            for _ in range(3):
                since = scalar(conn, "select clock_timestamp()")
                for junk in ("junk", "²", "①", "-1", "99999999999999999999"):
                    outsider.execute("select pg_notify(%s, %s)", (client.ticker_channel(), junk))
                outsider.execute("select pg_notify(%s, %s)",
                                 (client.ticker_channel(), str(queue_id)))
                # The ticker's look: its last query since (no poll is due for a minute).
                wait_for(lambda s=since: scalar(
                    conn, "select state_change > %s and state = 'idle' "
                          "and query like %s from pg_stat_activity where pid = %s",
                    (s, "%pgque.ticker_some(%", pid)), what="the ticker's look", dsn=dsn)
                assert asleep(conn)
        assert ticker.ticks == 0
        assert ticker.backend_pid == pid and ticker.error is None  # never reconnected
        before = max_tick(conn)
        client.send("q", "e", 2)
        wait_for(lambda: max_tick(conn) > before, what="a send's tick", timeout=30, dsn=dsn)


def test_sends_notify_the_ticker_channel_only_while_it_sleeps(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Every way an event enters a queue's log notifies the ticker channel at its
    commit while the queue is marked, and none does while it is not: a busy
    queue never pays for a notification."""
    client.create_queue("q")
    channel = client.ticker_channel()
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"listen {channel}")

        def heard() -> int:
            return sum(1 for _ in listener.notifies(timeout=0.5))

        sends: list[Callable[[], object]] = [
            lambda: client.send("q", "e", 1),
            lambda: client.send_batch("q", [("e", 1), ("e", 2)]),
            lambda: client.send("q", "e", 1, idempotency_key=uuid.uuid4().hex),
            lambda: client.send("q", "e", 1, deliver_after=60),
        ]
        for send in sends:
            send()
        assert heard() == 0
        with psycopg.connect(dsn, autocommit=True) as elected:
            assert scalar(elected, "select pgque.claim_ticker()")
            assert scalar(elected, "select pgque.ticker_sleep()") == 1
            assert scalar(elected, "select pgque.ticker_sleep()") == 0  # already
            for send in sends:
                send()
                assert heard() == 1
            with conn.transaction():
                client.send("q", "e", 1, conn=conn)
                assert heard() == 0  # at the commit, not before
            assert heard() == 1
            assert scalar(elected, "select pgque.ticker_wake()") == 1
        client.send("q", "e", 1)
        assert heard() == 0


def test_only_the_active_ticker_marks_the_queues_and_its_successor_hears_their_sends(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """ticker_sleep and ticker_wake are the elected session's (55000 elsewhere,
    nothing changed); a ticker elected after one that went away asleep unmarks
    the queues before anything else (and marks the idle ones again as its own),
    so that a send into a queue its predecessor marked is heard at once."""
    client.create_queue("q")
    for call in ("ticker_sleep", "ticker_wake"):
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState,
                           match="only the active ticker"):
            conn.execute(f"select pgque.{call}()")
    assert not asleep(conn)
    with psycopg.connect(dsn, autocommit=True) as gone:
        assert scalar(gone, "select pgque.claim_ticker()")
        scalar(gone, "select pgque.ticker_sleep()")
    assert asleep(conn)  # its session ended asleep
    with pgque.Ticker(dsn, idle_after=60, idle_interval=60, maintenance_interval=60) as ticker:
        assert ticker.wait_active(10)
        # The successor unmarks, listens, marks the queues as its own, then
        # looks at every queue: from then on only a notification ticks.
        wait_for(lambda: ticker.looks >= 1, what="the successor's first look", dsn=dsn)
        assert asleep(conn)
        before = max_tick(conn)
        client.send("q", "e", 1)
        wait_for(lambda: max_tick(conn) > before, what="the send's tick", timeout=30, dsn=dsn)


def test_a_queue_made_while_the_ticker_sleeps_is_marked_at_its_next_poll(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A queue created while the ticker sleeps starts unmarked; the ticker marks
    it at its next poll, so that its sends too wake the ticker."""
    client.create_queue("q")
    with pgque.Ticker(dsn, idle_after=0.3, idle_interval=0.2) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="the ticker asleep", dsn=dsn)
        client.create_queue("late")
        wait_for(lambda: scalar(conn, "select queue_ticker_asleep from pgque.queue "
                                      "where queue_name = 'late'"),
                 what="the new queue marked", dsn=dsn)


def test_a_stopping_ticker_and_pg_crons_loop_unmark_the_queues(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A Ticker that stops asleep unmarks the queues (nobody would hear their
    sends); so does pg_cron's ticker_loop when elected, after a Ticker that went
    away without stopping, since it never sleeps itself."""
    client.create_queue("q")
    with pgque.Ticker(dsn, idle_after=0.3) as ticker:
        assert ticker.wait_active(10)
        wait_for(lambda: asleep(conn), what="the ticker asleep", dsn=dsn)
    assert not scalar(conn, "select bool_or(queue_ticker_asleep) from pgque.queue")
    with psycopg.connect(dsn, autocommit=True) as gone:
        assert scalar(gone, "select pgque.claim_ticker()")
        scalar(gone, "select pgque.ticker_sleep()")
    assert asleep(conn)
    with psycopg.connect(dsn, autocommit=True) as cron:
        cron.execute("call pgque.ticker_loop(0.1, 10)")
    assert not scalar(conn, "select bool_or(queue_ticker_asleep) from pgque.queue")


def test_lost_wakeups_cost_latency_only(client: pgque.Client, dsn: str,
                                        conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    handled: list[int] = []
    got = threading.Event()

    def handler(message: pgque.Message[Any]) -> None:
        handled.append(message.id)
        got.set()

    # Subscribed before the worker starts: a group subscribed later would start
    # after events sent in the meantime (a new subscription starts at the newest tick).
    client.subscribe_slots("q", "g", slots=2)
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler,
                          listen=False, poll_interval=0.3)
    with worker:
        assert worker.ticker is not None and worker.ticker.wait_active(10)
        for n in range(5):
            got.clear()
            ev = client.send("q", "e", n, partition_key=f"k{n}")
            if not got.wait(0.3 + 3.0):
                dump_state(dsn)
                raise AssertionError("not delivered by polling alone")
            assert handled[-1] == ev
        listeners = scalar(conn, "select count(*) from pg_stat_activity "
                                 "where application_name like '%%listener' "
                                 "and datname = current_database()")
    assert listeners == 0


def test_worker_alone_delivers_and_retries(client: pgque.Client, dsn: str) -> None:
    client.create_queue("q", max_retries=3)
    attempts: dict[int, int] = {}

    def handler(message: pgque.Message[Any]) -> None:
        attempts[message.id] = attempts.get(message.id, 0) + 1
        if message.payload == "flaky" and message.retry_count == 0:
            raise RuntimeError("first attempt fails")

    client.subscribe_slots("q", "g", slots=3)  # before the worker starts (see above)
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=3, handler=handler,
                          retry_after=0.2)
    with worker:
        ids = [client.send("q", "e", "flaky" if n == 4 else n, partition_key=f"k{n}")
               for n in range(10)]
        wait_for(lambda: attempts.get(ids[4], 0) == 2 and len(attempts) == 10, timeout=20,
                 what=f"every event handled and the flaky one retried ({attempts})", dsn=dsn)
    assert all(attempts[i] == 1 for i in ids if i != ids[4])
    assert attempts[ids[4]] == 2


def test_drop_queue_with_force_never_deadlocks_with_a_running_ticker(
        client: pgque.Client, dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """drop_queue takes its locks in the ticker's and maintenance's order; it used to
    deadlock with a busy ticker in most tries."""
    caplog.set_level(logging.WARNING, logger="pgque")
    with pgque.Ticker(dsn, min_interval=0.001, maintenance_interval=0.01) as ticker:
        assert ticker.wait_active(10)
        for n in range(8):
            client.create_queue(f"q{n}", ticker_max_lag=0)
            client.subscribe_slots(f"q{n}", "g", slots=2)
            client.send_batch(f"q{n}", [("e", i, f"k{i}") for i in range(50)])
            client.drop_queue(f"q{n}", force=True)
        assert ticker.alive and ticker.error is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_ticker_that_never_connects_stops_after_connect_timeout(dsn: str) -> None:
    """A Ticker that has never connected since it started gives up once
    connect_timeout has passed, as a Worker does: its run() raises the ConnectError
    (ticker.error keeps it)."""
    ticker = pgque.Ticker(make_conninfo(dsn, dbname="pgque_no_such_dbname"),
                          connect_timeout=1)
    runner, raised = run_in_thread(ticker)
    runner.join(15)
    if runner.is_alive():
        ticker.stop()
    assert not runner.is_alive(), "still retrying after 15 s"
    assert [type(e) for e in raised] == [pgque.ConnectError]
    assert ticker.error is raised[0]


def test_a_worker_whose_ticker_never_connected_does_not_run_on_silently(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A Worker's own Ticker that cannot connect for connect_timeout after it
    starts (here its role's connection limit is taken during the first seconds,
    a transient state) while the Worker itself is connected: either the events
    are still delivered once the state is over, or the Worker stops and says
    why (worker.error); it never runs on with nothing ticking."""
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


def test_a_ticker_ticks_where_the_default_isolation_is_repeatable_read(
        client: pgque.Client, dsn: str) -> None:
    """Ticks and maintenance need READ COMMITTED (PQ008 otherwise): a Ticker sets it
    on its own session, whatever the database's default, and ticks."""
    client.create_queue("q")
    client.subscribe("q", "c")
    database = scalar(client.conn, "select current_database()")
    client.conn.execute(f'alter database "{database}"'
                        " set default_transaction_isolation = 'repeatable read'")
    try:
        with pgque.Ticker(dsn) as ticker:
            event = client.send("q", "e", 1)
            wait_for(lambda: ticker.ticks or None, timeout=10, what="a tick")
            batch = wait_for(lambda: client.receive("q", "c"), timeout=10, what="the event")
            assert [m.id for m in batch] == [event]
            assert ticker.error is None
    finally:
        client.conn.execute(f'alter database "{database}" reset default_transaction_isolation')


def event_table_locks(conn: psycopg.Connection[Any]) -> set[str]:
    """The queues whose event tables this session holds a lock on (their ids)."""
    return {row[0] for row in conn.execute(
        "select distinct substring(c.relname from '^event_([0-9]+)') from pg_locks l "
        "join pg_class c on c.oid = l.relation "
        "where l.pid = pg_backend_pid() and c.relname ~ '^event_[0-9]+'").fetchall()}


def test_the_tickers_poll_goes_through_the_queues_a_chunk_a_transaction(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A look at a queue keeps a lock on its event tables until the transaction
    ends, and one statement over thousands of queues outgrew the lock table ("out
    of shared memory" at about 4,400 queues, so nothing ticked): ticker_some looks
    at max_queues of them and says where to go on, and Client.ticker() and
    tick_overdue() go through every queue that way, each chunk its own statement."""
    names = [f"q{i:02d}" for i in range(7)]
    for name in names:
        client.create_queue(name)
        client.tick(name)
    ids = [scalar(conn, "select queue_id from pgque.queue where queue_name = %s", (n,))
           for n in names]
    with conn.transaction():
        scalar(conn, "select pgque.ticker()")
        assert event_table_locks(conn) == {str(i) for i in ids}  # every queue's, at once
    with conn.transaction():
        assert conn.execute("select ticks, last_queue from pgque.ticker_some(null, 3)"
                            ).fetchone() == (0, ids[2])
        assert event_table_locks(conn) == {str(i) for i in ids[:3]}
    assert conn.execute("select ticks, last_queue from pgque.ticker_some(%s, 3)",
                        (ids[2],)).fetchone() == (0, ids[5])
    # None left after this chunk: null at once, not one more call.
    assert conn.execute("select ticks, last_queue from pgque.ticker_some(%s, 3)",
                        (ids[3],)).fetchone() == (0, None)
    assert conn.execute("select ticks, last_queue from pgque.ticker_some(%s, 3)",
                        (ids[6],)).fetchone() == (0, None)
    assert conn.execute("select ticks, last_queue from pgque.ticker_some(null, 7)"
                        ).fetchone() == (0, None)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_queues"):
        conn.execute("select ticks, last_queue from pgque.ticker_some(null, 0)")
    for name in (names[1], names[4], names[6]):
        client.send(name, "e", 1)
    client.tick_chunk = 2
    assert client.ticker() == 3
    assert client.ticker() == 0
    client.send(names[5], "e", 1)
    assert client.tick_overdue(0) == 1
    # By id: only the queues named, and the ids of those ticked.
    for name in (names[0], names[2], names[3]):
        client.send(name, "e", 1)
    assert client.ticker_ids([ids[2], ids[3], ids[5]]) == [ids[2], ids[3]]
    assert client.ticker_ids() == [ids[0]]


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [3, long_variant(240, id="240s-long")])
def test_ticks_maintenance_and_info_never_fail_beside_queues_being_dropped(
        dsn: str, seconds: int) -> None:
    """The ticker's looks, maintenance's and the info views' wait at most 1 or
    100 ms for a lock that a drop_queue holds, and take an error there for "not
    now". A wait whose lock is granted (the drop commits) as its lock_timeout
    fires leaves the timeout's cancel pending while the look fails on the
    dropped relation ("could not open relation with OID"); PostgreSQL raises it
    at the next statement, which was the caller's: the ticker's pass, or
    `pgque status`, failed with "canceling statement due to lock timeout"
    (about once a minute here; the long variant catches it nearly always).
    Drops here hold their locks for about the timeout, to meet it often."""
    stop = threading.Event()
    errors: list[str] = []
    counts = {"drops": 0, "ticker": 0, "maint": 0, "info": 0}

    def churn() -> None:
        rng = random.Random(7)
        with psycopg.connect(dsn, autocommit=True) as c:
            n = 0
            while not stop.is_set():
                queue = f"dropped{n}"
                n += 1
                c.execute("select pgque.create_queue(%s)", (queue,))
                with c.transaction():
                    c.execute("select pgque.drop_queue(%s, true)", (queue,))
                    c.execute("select pg_sleep(%s)", (rng.uniform(0.0005, 0.0015),))
                counts["drops"] += 1

    def loop(what: str, statement: str, pause: float) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            while not stop.wait(pause):
                try:
                    c.execute(statement).fetchall()
                    counts[what] += 1
                except psycopg.Error as e:
                    errors.append(f"{what}: {type(e).__name__}: {e}")

    # Most of the machine to the tickers, whose looks wait 1 ms (it fails
    # far less often with the others as busy).
    threads = [threading.Thread(target=churn)] + [
        threading.Thread(target=loop, args=(what, statement, pause)) for what, statement, pause in [
            ("ticker", "select * from pgque.ticker_some(null, 100)", 0),
            ("ticker", "select * from pgque.ticker_some(null, 100)", 0),
            ("maint", "select * from pgque.maint()", 0.005),
            ("info", "select * from pgque.queue_info", 0.005)]]
    for t in threads:
        t.start()
    try:
        stop.wait(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == [], f"{len(errors)} failed calls ({counts}): {errors[:3]}"
    assert min(counts.values()) > 0, counts


def test_a_queue_found_due_is_ticked_once_when_another_ticker_ticks_it_first(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A ticker that found a queue due by its sequence alone (_ticker_look's sure)
    goes straight to the queue's tick lock: while another ticker's tick is in
    progress it skips the queue, and once that tick committed the look under the
    lock says no. Every event is in exactly one batch."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe("q", "c")
    ids = [client.send("q", "e", i) for i in range(3)]
    queue_id = scalar(conn, "select queue_id from pgque.queue where queue_name = 'q'")
    count = "select count(*) from pgque.tick where tick_queue = %s"
    ticks_before = scalar(conn, count, (queue_id,))
    # What the second ticker's look said before the first one ticked.
    sure = "select pgque._tick_if_wanted(%s, null, false, null, true)"
    with psycopg.connect(dsn) as first, psycopg.connect(dsn, autocommit=True) as second:
        made = first.execute("select pgque.ticker('q')").fetchone()
        assert made is not None and made[0] is not None  # ticked, not committed yet
        assert second.execute(sure, (queue_id,)).fetchone() == (None,)  # its lock is taken
        first.commit()
        assert second.execute(sure, (queue_id,)).fetchone() == (None,)  # ticked already
    assert scalar(conn, count, (queue_id,)) == ticks_before + 1
    assert [m.id for m in drain(client, "q", "c", tick=False)] == ids
