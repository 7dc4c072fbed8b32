"""The lifecycle of long-running services (Worker, Ticker): a stop is noticed
within a second also while the database is unreachable, errors that cannot heal
stop the service instead of looping and reach the caller (run(), the with
block's end, wait()), a service that never connected gives up after
connect_timeout while one that did retries an outage for ever, a worker whose
role may not tick runs without ticking, and a worker whose session is gone stops
handling its batch at the next event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import faults
import psycopg
import pytest
from helpers import run_in_thread, scalar, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port with nothing listening: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers: a client
    waits for the server's first message until its own timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def unreachable_dsn(port: int) -> str:
    return f"host=127.0.0.1 port={port} dbname=x user=x connect_timeout=20"


def noop(message: pgque.Message[Any]) -> None:
    pass


@pytest.mark.parametrize("where", [closed_port, silent_server])
def test_stop_is_noticed_within_a_second_while_the_server_is_unreachable(where: Any) -> None:
    with where() as port:
        dsn = unreachable_dsn(port)
        worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=noop)
        ticker = pgque.Ticker(dsn)
        worker.start()
        ticker.start()
        time.sleep(1.5)  # let them get deep into connecting and backing off
        for service in (worker, ticker):
            started = time.monotonic()
            service.stop(timeout=5)
            assert not service.alive
            assert time.monotonic() - started < 1.0
            assert service.error is None


def test_sigterm_ends_a_worker_process_within_a_second_while_the_server_is_down() -> None:
    with closed_port() as port:
        # With the AsyncWorker (PGQUE_TEST_WORKER=async, conftest.py): its run()
        # under asyncio.run in the main thread, where SIGTERM must stop it too.
        script = textwrap.dedent(f"""
            import asyncio, os
            import pgque
            options = dict(queue="q", consumer="g", slots=2)
            print("running", flush=True)
            if os.environ.get("PGQUE_TEST_WORKER") == "async":
                async def handler(message):
                    print(message)
                asyncio.run(pgque.AsyncWorker({unreachable_dsn(port)!r}, handler=handler,
                                              **options).run())
            else:
                pgque.Worker({unreachable_dsn(port)!r}, handler=print, **options).run()
            print("stopped", flush=True)
        """)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "running"
            time.sleep(1.5)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().strip() == "stopped"  # run() returned
            # The stop is noticed within STOP_LATENCY (0.2 s); the margin is for a
            # busy 2-core machine scheduling the process.
            assert time.monotonic() - started < 1.0
            assert proc.wait(5) == 0
        finally:
            proc.kill()


def test_open_connection_gives_up_when_told_to_stop() -> None:
    with closed_port() as port:
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        with pytest.raises(pgque.ConnectError) as info:
            pgque.open_connection(unreachable_dsn(port), timeout=30, stop=stop)
        assert time.monotonic() - started < 1.0
        assert info.value.transient


@pytest.mark.parametrize(("setup", "error"), [
    ("wrong_slot_count", pgque.SlotCountMismatch),
    ("unknown_queue", pgque.QueueNotFound),
    ("bad_name", pgque.InvalidName),
])
def test_configuration_errors_stop_the_worker_instead_of_looping(
        client: pgque.Client, dsn: str, setup: str, error: type[Exception]) -> None:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=8)
    queue, consumer, slots = {"wrong_slot_count": ("q", "g", 4),
                              "unknown_queue": ("nope", "g", 8),
                              "bad_name": ("q", "bad#name", 8)}[setup]
    worker = pgque.Worker(dsn, queue=queue, consumer=consumer, slots=slots, handler=noop,
                          ticker=False)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(10)
    assert not runner.is_alive()
    assert [type(e) for e in raised] == [error]  # run() raises it
    assert worker.error is raised[0]


def test_a_role_without_pgque_rights_stops_the_worker(pg_server: Any, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("drop role if exists pgque_nobody")
        conn.execute("create role pgque_nobody login password 'right'")
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(user="pgque_nobody", password="wrong")
    worker = pgque.Worker(psycopg.conninfo.make_conninfo(**params), queue="q", consumer="g",
                          slots=2, handler=noop, ticker=False)
    worker.start()
    assert worker.wait_stopped(10)
    # The test server trusts local connections, so the wrong password gets in
    # and the missing privileges are what cannot heal (a refused password is a
    # ConnectError that is not transient: also fatal).
    assert isinstance(worker.error, (pgque.ConnectError, psycopg.errors.InsufficientPrivilege))


def test_a_worker_stops_handling_its_batch_once_its_session_is_gone(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """After pg_terminate_backend of its session, the worker starts no further
    event of the batch in hand (it used to run the whole batch, overlapping the
    slot's next owner)."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    ids = client.send_batch("q", [("e", i, "one-key") for i in range(40)])
    started: list[tuple[float, int]] = []

    def slow(message: pgque.Message[Any]) -> None:
        started.append((time.monotonic(), message.id))
        time.sleep(0.05)

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=slow,
                          max_events=100, name="zombie-test")
    with worker:
        wait_for(lambda: len(started) >= 3, timeout=20, what="handling to start", dsn=dsn)
        at = time.monotonic()
        # The session of the lane that owns the slot.
        terminated = scalar(conn, "select count(pg_terminate_backend(pid)) "
                                  "from pg_stat_activity "
                                  "where application_name like 'zombie-test-lane%%'")
        assert terminated == 1
        # The new session gets the unacked batch again, from its first event.
        wait_for(lambda: any(t > at and i == ids[0] for t, i in started), timeout=20,
                 what="the batch to be delivered again", dsn=dsn)
    after = [i for t, i in started if t > at]
    zombie_starts = after[:after.index(ids[0])]
    # At most one start can slip in between the termination and the check.
    assert len(zombie_starts) <= 1, zombie_starts


def test_invalid_worker_arguments_are_refused_up_front() -> None:
    for bad in ({"max_events": 0}, {"retry_after": -1}, {"network_timeout": 1},
                {"concurrency": 0}):
        with pytest.raises(ValueError):
            pgque.Worker("dbname=x", queue="q", consumer="g", slots=2, handler=noop, **bad)


def test_privileges_revoked_while_running_stop_the_worker(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("drop role if exists pgque_revoked")
    conn.execute("create role pgque_revoked login in role pgque_reader")
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=2)
    client.grant_consumer("q", "g", "pgque_revoked")  # the group is the superuser's
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["user"] = "pgque_revoked"
    worker = pgque.Worker(psycopg.conninfo.make_conninfo(**params), queue="q", consumer="g",
                          slots=2, handler=noop, ticker=False, rebalance_interval=0.1)
    # Refused by the server in a receive, or found out at the next rebalance
    # (a session whose role may not receive counts as no member): it stops.
    refused = (psycopg.errors.InsufficientPrivilege, pgque.ConsumerAccessDenied)
    try:
        with pytest.raises(refused), worker:
            wait_for(lambda: len(worker.owned_slots) == 2, timeout=20, what="slots claimed")
            # Fails in the slots' receive (a slot step), not in the main loop.
            conn.execute("revoke execute on function pgque.receive_partitioned("
                         "text, text, integer, integer, integer) from pgque_reader")
            client.send("q", "e", 1)
            worker.wait(timeout=10)
        assert isinstance(worker.error, refused)
    finally:
        conn.execute("drop owned by pgque_revoked")
        conn.execute("drop role pgque_revoked")


def test_an_event_whose_failure_cannot_be_stored_as_given_is_still_nacked(
        client: pgque.Client, dsn: str) -> None:
    """Exceptions whose text PostgreSQL cannot store (a NUL byte, a lone surrogate,
    a __str__ that raises) and BaseExceptions such as CancelledError fail their
    event like any other: it is retried and dead-lettered, and the slot goes on
    (they used to stall the slot, handling the same piece over and over)."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    raising: dict[str, BaseException] = {
        "nul": ValueError("bad name a\x00b"), "surrogate": ValueError("bad \ud800"),
        "unprintable": Unprintable(), "cancelled": asyncio.CancelledError()}
    client.create_queue("q", max_retries=1, ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    ids = client.send_batch("q", [*((kind, None, "k") for kind in raising), ("Good", None, "k")])
    calls: list[str] = []

    def handler(message: pgque.Message[Any]) -> None:
        calls.append(message.type)
        if message.type in raising:
            raise raising[message.type]

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handler,
                          retry_after=0, poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.05))
    with worker:
        wait_for(lambda: len(client.dead_letters("q")) == len(raising), timeout=30,
                 what="every failing event dead-lettered", dsn=dsn)
    assert sorted(d.event_id for d in client.dead_letters("q")) == ids[:-1]
    assert calls.count("Good") == 1
    assert all(calls.count(kind) == 2 for kind in raising)  # first try and one retry
    reasons = {d.type: d.reason for d in client.dead_letters("q")}
    assert reasons["nul"] == "ValueError: bad name a\\0b"
    assert reasons["unprintable"] == "Unprintable: <unprintable>"


def test_a_stalled_network_cannot_make_two_workers_handle_a_key_at_once(
        client: pgque.Client, dsn: str) -> None:
    """A middlebox that stops forwarding but keeps acknowledging (no TCP timeout
    fires): the cut-off worker gives up its session after network_timeout / 2,
    before the server ends it (5/6 of network_timeout) and another worker can
    take the slot; and its stop() returns."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    client.send_batch("q", [("e", n, "k") for n in range(16)])
    started: list[tuple[float, str, int]] = []
    first = threading.Event()

    def recorder(name: str, seconds: float) -> Any:
        def handle(message: pgque.Message[Any]) -> None:
            started.append((time.monotonic(), name, message.id))
            first.set()
            time.sleep(seconds)
        return handle

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    proxy = faults.TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    try:
        cut_off = pgque.Worker(proxy.dsn(dsn), queue="q", consumer="g", slots=1,
                               handler=recorder("cut-off", 0.4), network_timeout=4, ticker=False,
                               listen=False, rebalance_interval=0.2, name="cut-off")
        with pgque.Ticker(dsn):
            cut_off.start()
            assert first.wait(20)
            proxy.blackhole()
            # Only when the direct worker first starts a handler matters; a quick
            # handler lets it finish the batch it took over, and stop, at once.
            with pgque.Worker(dsn, queue="q", consumer="g", slots=1,
                              handler=recorder("direct", 0.0), ticker=False,
                              rebalance_interval=0.2, name="direct"):
                wait_for(lambda: any(n == "direct" for _, n, _ in started), timeout=20,
                         what="the direct worker to take the slot over", dsn=dsn)
                took_over = min(t for t, n, _ in started if n == "direct")
                stopping = time.monotonic()
                cut_off.stop(timeout=10)
                assert not cut_off.alive
                assert time.monotonic() - stopping < 5
    finally:
        proxy.stop()
    late = [i for t, n, i in started if n == "cut-off" and t >= took_over]
    assert late == []  # the cut-off worker had stopped before the takeover


def test_stopping_while_slow_handlers_run_still_acks_their_batch(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Finishing the batches in hand can take longer than the session's
    idle_session_timeout: the worker keeps its session alive meanwhile."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    client.send_batch("q", [("e", n, "k") for n in range(8)])
    handled: list[int] = []
    first = threading.Event()

    def slow(message: pgque.Message[Any]) -> None:
        first.set()
        time.sleep(0.6)
        handled.append(message.id)

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=slow,
                          network_timeout=3, rebalance_interval=0.2)
    worker.start()
    assert first.wait(20)
    worker.stop(timeout=30)  # about 8 * 0.6 s: longer than the 3 s idle timeout
    assert len(handled) == 8
    assert scalar(conn, "select count(*) from pgque.consumer_info "
                        "where open_batch_id is not null") == 0
    assert scalar(conn, "select sum(pending_events) from pgque.partition_slot_status") == 0


def test_the_check_between_events_sees_a_terminated_session_both_twins(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """CallWatch.gone (the Worker's check before each event, no round trip) is
    False on a live idle connection, and True soon after the server ends the
    session; the same for the AsyncCallWatch."""
    from pgque.lifecycle import CallWatch
    from pgque.lifecycle_async import AsyncCallWatch

    sync_conn = psycopg.connect(dsn, autocommit=True)
    watch = CallWatch(sync_conn, deadline=30.0)
    assert not watch.gone() and not watch.gone()  # asking again changes nothing

    async def async_side() -> bool:
        aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        awatch = AsyncCallWatch(aconn, deadline=30.0)
        try:
            assert not awatch.gone()
            scalar(conn, "select pg_terminate_backend(%s)", (aconn.info.backend_pid,))
            deadline = time.monotonic() + 10
            while not awatch.gone() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return awatch.gone()
        finally:
            await aconn.close()

    try:
        scalar(conn, "select pg_terminate_backend(%s)", (sync_conn.info.backend_pid,))
        assert wait_for(lambda: watch.gone() or None, timeout=10, what="the session's end")
        assert watch.lost
        assert asyncio.run(async_side())
    finally:
        sync_conn.close()
    assert CallWatch(sync_conn, deadline=30.0).gone()  # a closed connection is gone


def test_a_worker_that_gave_up_raises_its_error_as_its_with_block_ends(
        client: pgque.Client, dsn: str) -> None:
    """A fatal error (a slot count other than the group's) ends the worker: the
    with block's end raises it, as run() does, and wait() raises it too. An
    exception of the body's own goes on instead, never replaced by the worker's."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=8)

    def wrong_count() -> pgque.Worker[Any]:
        return pgque.Worker(dsn, queue="q", consumer="g", slots=4, handler=noop, ticker=False)

    worker = wrong_count()
    with pytest.raises(pgque.SlotCountMismatch) as raised, worker:
        assert worker.wait_stopped(10)
    assert raised.value is worker.error
    with pytest.raises(pgque.SlotCountMismatch):
        worker.wait(timeout=0)  # at once: the worker has stopped

    worker = wrong_count()
    with pytest.raises(LookupError) as body, worker:
        assert worker.wait_stopped(10)
        raise LookupError("the body's own")
    assert isinstance(worker.error, pgque.SlotCountMismatch)
    if sys.version_info >= (3, 11):  # add_note; the worker's error is named there
        assert any("SlotCountMismatch" in note for note in body.value.__notes__)


def test_a_body_waiting_on_the_worker_is_woken_by_its_failure(
        client: pgque.Client, dsn: str) -> None:
    """The body waits for a count the worker never reaches: its handler returns a
    coroutine instead of handling (HandlerReturnedAwaitable, fatal), and wait()
    raises that as soon as the worker has stopped, not at its timeout."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)

    async def work() -> None:
        pass

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=lambda m: work(),
                          poll_interval=0.05)
    returned: list[bool] = []
    with pytest.raises(pgque.HandlerReturnedAwaitable) as raised, worker:
        client.send("q", "e", 1, partition_key="k")
        started = time.monotonic()
        returned.append(worker.wait(lambda: worker.handled >= 1, timeout=60))
    assert returned == []  # wait() raised: the body went no further
    assert time.monotonic() - started < 30
    assert raised.value is worker.error
    assert worker.handled == 0


def test_wait_returns_when_its_condition_holds_or_the_worker_has_stopped(
        client: pgque.Client, dsn: str) -> None:
    """wait(): True once its condition holds, False at its timeout; after a clean
    stop, at once: True without a condition, False with one that does not hold."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=2)
    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=noop,
                          poll_interval=0.05)
    with worker:
        client.send_batch("q", [("e", n, f"k{n}") for n in range(10)])
        assert worker.wait(lambda: worker.handled >= 10, timeout=30)
        assert not worker.wait(lambda: False, timeout=0.05)  # the timeout passed
    assert worker.error is None
    assert worker.wait(timeout=0)  # stopped cleanly: True, nothing raised
    assert not worker.wait(lambda: False)  # stopped before it held: False, at once


def test_a_worker_whose_role_may_not_tick_runs_without_ticking(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """A login role with the consumer's grants (pgque_reader, the group granted)
    but not pgque_admin: the worker's own Ticker is refused the election; the
    worker neither stops nor needs ticker=False. It says so once, at INFO, and
    handles what another session's Ticker ticks."""
    role = f"pgque_no_tick_{uuid.uuid4().hex[:8]}"
    conn.execute(f"create role {role} login in role pgque_reader")
    caplog.set_level(logging.INFO, logger="pgque")
    try:
        client.create_queue("q", ticker_max_lag=0)
        client.subscribe_slots("q", "g", slots=2)
        client.grant_consumer("q", "g", role)
        worker = pgque.Worker(make_conninfo(dsn, user=role), queue="q", consumer="g", slots=2,
                              handler=noop, poll_interval=0.05, rebalance_interval=0.1)
        with worker, pgque.Ticker(dsn):
            own = worker.ticker
            assert own is not None
            wait_for(lambda: not own.alive, timeout=20, what="its own ticker to stand down",
                     dsn=dsn)
            assert own.error is None and own.ticks == 0
            ids = client.send_batch("q", [("e", n, f"k{n}") for n in range(20)])
            assert worker.wait(lambda: worker.handled >= len(ids), timeout=30)
            assert worker.alive and worker.error is None
    finally:
        conn.execute(f"drop owned by {role}")
        conn.execute(f"drop role {role}")
    said = [r for r in caplog.records
            if r.name == "pgque.ticker" and "may not tick" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]
    assert [r.getMessage() for r in caplog.records
            if r.name.startswith("pgque") and r.levelno >= logging.WARNING] == []


# -- a service that never connected gives up; one that did retries ----------------------------


@pytest.mark.parametrize("missing", ["dbname", "user"])
def test_a_worker_that_never_connects_stops_after_connect_timeout(
        dsn: str, missing: str) -> None:
    """libpq reports every connection failure without an SQLSTATE, a missing database
    or role alike: a worker that has never connected since it started gives up
    once connect_timeout has passed without a first connection, and run() raises
    the ConnectError (worker.error keeps it)."""
    params = conninfo_to_dict(dsn)
    params[missing] = "pgque_no_such_" + missing
    worker = pgque.Worker(make_conninfo(**params), queue="q", consumer="g", slots=1,
                          handler=lambda message: None, connect_timeout=1)
    started = time.monotonic()
    runner, raised = run_in_thread(worker)
    runner.join(15)
    took = time.monotonic() - started
    if runner.is_alive():
        worker.stop()
    assert not runner.is_alive(), "still retrying after 15 s"
    assert [type(e) for e in raised] == [pgque.ConnectError]
    assert worker.error is raised[0]
    assert 1 <= took < 12


def test_a_worker_that_connected_retries_an_outage_longer_than_connect_timeout(
        client: pgque.Client, dsn: str) -> None:
    """Once a worker has connected, an outage is retried for ever (with backoff),
    however long it lasts: here three times connect_timeout, with every
    connection attempt held unanswered."""
    connect_timeout = 1.0
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    handled: list[int] = []
    params = conninfo_to_dict(dsn)
    proxy = faults.TcpProxy(str(params.get("host") or "127.0.0.1"),
                            int(params.get("port") or 5432))
    try:
        worker = pgque.Worker(proxy.dsn(dsn), queue="q", consumer="g", slots=1,
                              handler=lambda message: handled.append(message.id),
                              ticker=False, connect_timeout=connect_timeout,
                              network_timeout=2,
                              poll_interval=0.05, rebalance_interval=0.2)
        with worker:
            wait_for(lambda: worker.owned_slots, timeout=20, what="the slot claimed", dsn=dsn)
            proxy.blackhole()
            proxy.cut()
            down = time.monotonic()
            while time.monotonic() - down < 3 * connect_timeout:
                assert worker.alive and worker.error is None
                time.sleep(0.1)
            proxy.heal()
            ids = client.send_batch("q", [("e", 1, "k")])
            client.tick("q")
            wait_for(lambda: ids[0] in handled, timeout=30, what="handling after the outage",
                     dsn=dsn)
        assert worker.error is None
    finally:
        proxy.stop()
