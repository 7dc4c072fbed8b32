"""The lifecycle of long-running services (Worker, Ticker): a stop is noticed
within a second also while the database is unreachable, errors that cannot heal
stop the service instead of looping, and a worker whose session is gone stops
handling its batch at the next event."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for

import pgque


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
        script = textwrap.dedent(f"""
            import pgque
            worker = pgque.Worker({unreachable_dsn(port)!r}, queue="q", consumer="g",
                                  slots=2, handler=print)
            print("running", flush=True)
            worker.run()
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
            assert proc.wait(5) == 0
            assert time.monotonic() - started < 1.0
            assert proc.stdout.read().strip() == "stopped"
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


def test_bad_credentials_stop_the_worker(pg_server: Any, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("drop role if exists pgque_nobody")
        conn.execute("create role pgque_nobody login password 'right'")
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(user="pgque_nobody", password="wrong")
    worker = pgque.Worker(psycopg.conninfo.make_conninfo(**params), queue="q", consumer="g",
                          slots=2, handler=noop, ticker=False)
    worker.start()
    assert worker.wait_stopped(10)
    # Trusted local authentication lets the wrong password in; then it is the
    # missing privileges that cannot heal. Either way the worker stops.
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
        terminated = scalar(conn, "select count(pg_terminate_backend(pid)) from "
                                  "pg_stat_activity where application_name = 'zombie-test'")
        assert terminated == 1
        # The new session gets the unacked batch again, from its first event.
        wait_for(lambda: any(t > at and i == ids[0] for t, i in started), timeout=20,
                 what="the batch to be delivered again", dsn=dsn)
    after = [i for t, i in started if t > at]
    zombie_starts = after[:after.index(ids[0])]
    # At most one start can slip in between the termination and the check.
    assert len(zombie_starts) <= 1, zombie_starts
