"""Ticking with pg_cron: start_cron/stop_cron, and the ticker loop the job runs.

pg_cron must be preloaded by the server and runs jobs in one database
(cron.database_name); the harness preloads it when the server's build has it
and names the database ``pgque_cron``. Without it, only the clear refusal is
tested here (docs/operations.md says how to set pg_cron up).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pgtest
import psycopg
import pytest
from helpers import scalar, wait_for

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


def test_start_cron_without_pg_cron_is_refused(client: pgque.Client) -> None:
    with pytest.raises(pgque.CronUnavailable):
        client.start_cron()
    with pytest.raises(pgque.CronUnavailable):
        client.stop_cron()


def test_loop_and_python_ticker_share_the_election(client: pgque.Client, dsn: str) -> None:
    with pgque.Ticker(dsn) as ticker:
        assert ticker.wait_active(10)
        # The loop returns at once: the Python ticker holds the election.
        started = scalar(client.conn, "select clock_timestamp()")
        client.conn.execute("call pgque.ticker_loop(5, 100)")
        assert scalar(client.conn, "select clock_timestamp() - %s < interval '4 s'", (started,))
        assert client.active_ticker() == ticker.backend_pid
    # With no other ticker, the loop wins the election and gives it up when it ends.
    with pgque.connect(dsn) as watcher:
        # (The stopped Ticker's backend lets the election go as it exits, a moment
        # after its client closed: a loop started before that returns at once.)
        wait_for(lambda: watcher.active_ticker() is None, what="the Ticker's session to end")
        loop = threading.Thread(target=lambda: client.conn.execute("call pgque.ticker_loop(1, 50)"))
        loop.start()
        wait_for(lambda: watcher.active_ticker() is not None, what="the loop to be elected")
        assert watcher.active_ticker() != watcher.pinned_pid
        loop.join(10)
        assert watcher.active_ticker() is None


@pytest.fixture
def cron_dsn(pg_server: pgtest.PgServer) -> Iterator[str]:
    with psycopg.connect(pg_server.dsn(), autocommit=True) as su:
        preload = scalar(su, "select current_setting('shared_preload_libraries')")
        if "pg_cron" not in preload:
            pytest.skip("this server does not preload pg_cron")
        su.execute(f"drop database if exists {pgtest.CRON_DB} with (force)")
        su.execute(f"create database {pgtest.CRON_DB}")
    dsn = pg_server.dsn(pgtest.CRON_DB)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create extension pg_cron")
            pgque.install(conn)
        yield dsn
    finally:
        with psycopg.connect(pg_server.dsn(), autocommit=True) as su:
            su.execute(f"drop database if exists {pgtest.CRON_DB} with (force)")


def test_start_and_stop_cron(cron_dsn: str) -> None:
    with pgque.connect(cron_dsn) as client:
        job = client.start_cron()
        row = client.conn.execute("select schedule, command, active from cron.job "
                                  "where jobid = %s", (job,)).fetchone()
        assert row == ("* * * * *", "call pgque.ticker_loop()", True)
        assert client.start_cron() == job  # scheduling again replaces, never duplicates
        assert scalar(client.conn, "select count(*) from cron.job") == 1
        assert client.stop_cron() is True
        assert client.stop_cron() is False
        assert scalar(client.conn, "select count(*) from cron.job") == 0


def test_ticker_loop_ticks_pending_queues(cron_dsn: str) -> None:
    with pgque.connect(cron_dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        sent = client.send("q", "e", 1)
        client.conn.execute("call pgque.ticker_loop(0.5, 50)")  # what the cron job runs
        batch = client.receive("q", "c")
        assert batch is not None and [m.id for m in batch] == [sent]


def test_ticker_loop_stands_by_while_another_ticker_is_active(cron_dsn: str) -> None:
    with pgque.connect(cron_dsn) as client, pgque.Ticker(cron_dsn) as ticker:
        assert ticker.wait_active(10)
        client.create_queue("q")
        before = ticker.ticks
        started = scalar(client.conn, "select clock_timestamp()")
        client.conn.execute("call pgque.ticker_loop(2, 50)")
        took = scalar(client.conn, "select clock_timestamp() - %s", (started,))
        assert took.total_seconds() < 1.0  # returned at once: not elected
        assert ticker.active and ticker.ticks >= before
