"""``pgque worker`` runs what the library runs: every Worker parameter as an
option with the library's default, transactional and async handlers. (How it
ends on an error the worker cannot heal is in test_cli.)

The handlers are in tests/cli_handlers.py; the subprocess helpers are
test_cli's.
"""

from __future__ import annotations

import inspect
import signal
from itertools import pairwise
from typing import Any

import cli_handlers
import psycopg
import pytest
from helpers import (
    BAD_DSN,
    TESTS_DIR,
    assert_one_line_error,
    cli_process,
    run_cli,
    scalar,
    wait_for,
)

import pgque
from pgque import cli

#: The Worker's parameters that have defaults, with them.
LIBRARY_DEFAULTS = {name: p.default
                    for name, p in inspect.signature(pgque.Worker).parameters.items()
                    if p.default is not inspect.Parameter.empty}


class RecordedWorker:
    """Stands in for pgque.Worker: keeps the arguments it was made with, and runs
    no further."""

    made: list[dict[str, Any]]

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        self.made.append(kwargs)

    def run(self) -> None:
        """Returns at once, as a worker stopped by a signal does."""


def owners(client: pgque.Client) -> list[int | None]:
    return [s.owner_pid for s in client.partition_slot_status("q")]


def test_worker_passes_every_option_with_the_librarys_defaults(
        client: pgque.Client, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every parameter of the Worker reaches it: as given, or else with the
    library's own default (connect_timeout included: 30 s, not the 5 s of the
    interactive commands)."""
    client.create_queue("q")
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(RecordedWorker, "made", made, raising=False)
    monkeypatch.setattr(pgque, "Worker", RecordedWorker)
    base = {"queue": "q", "consumer": "g", "slots": 2, "handler": cli_handlers.record}

    def made_by(*options: str) -> dict[str, Any]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["worker", "cli_handlers:record", "--queue", "q", "--consumer", "g",
                      "--slots", "2", "--dsn", dsn, *options])
        assert exit_.value.code == 0
        return made.pop()

    assert LIBRARY_DEFAULTS["connect_timeout"] == 30.0
    assert made_by() == {**base, **LIBRARY_DEFAULTS}
    assert made_by(
        "--concurrency", "1", "--key-concurrency", "3", "--payload-type", "cli_handlers:Job",
        "--max-events", "7", "--poll-interval", "0.5", "--retry-after", "1.5",
        "--rebalance-interval", "2", "--no-ticker", "--no-listen", "--connect-timeout", "7",
        "--network-timeout", "12", "--name", "w1", "--failure-policy", "pause",
        "--non-retryable", "cli_handlers:Refused", "--record", "--metrics-port", "9188",
        "--metrics-host", "0.0.0.0", "--ownership", "lease", "--lease", "4",
    ) == {**base, "transactional": False, "concurrency": 1, "key_concurrency": 3,
          "payload_type": cli_handlers.Job, "max_events": 7, "poll_interval": 0.5,
          "retry_after": 1.5, "rebalance_interval": 2.0, "ticker": False, "listen": False,
          "connect_timeout": 7.0, "network_timeout": 12.0, "name": "w1",
          "failure_policy": "pause", "non_retryable": (cli_handlers.Refused,), "record": True,
          "meter_provider": None, "metrics_port": 9188, "metrics_host": "0.0.0.0",
          "ownership": "lease", "lease": 4.0}


@pytest.mark.parametrize(("options", "says"), [
    pytest.param(["--transactional", "--key-concurrency", "2"],
                 "key_concurrency must be 1 with transactional=True", id="key-concurrency"),
    pytest.param(["--payload-type", "cli_handlers:NOT_A_TYPE"], "not a payload type",
                 id="payload-type"),
])
def test_worker_refuses_what_the_library_refuses_before_connecting(options: list[str],
                                                                   says: str) -> None:
    result = run_cli("worker", "cli_handlers:apply", "--queue", "q", "--consumer", "g",
                     "--slots", "2", "--dsn", BAD_DSN, *options, PYTHONPATH=TESTS_DIR)
    assert says in assert_one_line_error(result, 2)


def test_worker_runs_a_transactional_handler_and_retries_after_the_given_delay(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """--transactional: the handler's writes on its conn commit with the ack (those
    of a failed attempt roll back); --retry-after brings the failed event back after
    that delay (database clock); --name names the worker's sessions."""
    conn.execute("create table cli_attempts (ev_id bigint, retry_count int, tx_now timestamptz, "
                 "at timestamptz)")
    conn.execute("create table cli_effects (ev_id bigint primary key, retry_count int, pid int, "
                 "app text)")
    client.create_queue("q")
    with cli_process("worker", "cli_handlers:apply", "--transactional", "--retry-after", "1",
                     "--queue", "q", "--consumer", "g", "--slots", "2", "--name", "cliw",
                     "--log-level", "warning", PGQUE_DSN=dsn, PYTHONPATH=TESTS_DIR) as proc:
        wait_for(lambda: len(owners(client)) == 2 and None not in owners(client), timeout=30,
                 what="the worker to own both slots")
        ids = client.send_batch("q", [("Job", {"n": n, "fail": n == 3}, f"tenant-{n % 3}")
                                      for n in range(6)])
        wait_for(lambda: scalar(conn, "select count(*) from cli_effects") == len(ids),
                 timeout=30, what="every event's effect")
        lanes = {pid for (pid,) in conn.execute(
            "select pid from pg_stat_activity where application_name like 'cliw-lane%'")}
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    failing = ids[3]
    effects = conn.execute("select ev_id, retry_count, pid, app from cli_effects "
                           "order by ev_id").fetchall()
    # One effect each, on a lane's session; the failing event's of its retry only.
    assert [(e[0], e[1]) for e in effects] == [(i, int(i == failing)) for i in ids]
    assert {e[2] for e in effects} <= lanes and all(e[3].startswith("cliw-lane") for e in effects)
    attempts = conn.execute("select ev_id, retry_count from cli_attempts "
                            "order by ev_id, retry_count").fetchall()
    assert attempts == sorted([(i, 0) for i in ids] + [(failing, 1)])
    # From the failed attempt's transaction (whose now() the nack counts from) to
    # the retry: at least --retry-after, and well below the default 5 s.
    delay = scalar(conn, "select extract(epoch from r.at - f.tx_now) from cli_attempts f "
                         "join cli_attempts r using (ev_id) "
                         "where f.retry_count = 0 and r.retry_count = 1")
    assert 1 <= delay < 5, delay
    assert owners(client) == [None, None]


def test_worker_runs_an_async_handler_with_keys_in_parallel(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """An ``async def`` handler runs under an AsyncWorker, with --key-concurrency and
    --payload-type, until SIGTERM (which it takes as the Worker does: it finishes,
    releases its slot and exits with 0)."""
    conn.execute("create table cli_spans (ev_id bigint primary key, key text, n int, "
                 "started timestamptz, finished timestamptz)")
    client.create_queue("q")
    with cli_process("worker", "cli_handlers:record_span", "--key-concurrency", "3",
                     "--payload-type", "cli_handlers:Job", "--queue", "q", "--consumer", "g",
                     "--slots", "1", "--log-level", "warning",
                     PGQUE_DSN=dsn, PYTHONPATH=TESTS_DIR) as proc:
        wait_for(lambda: owners(client) not in ([], [None]), timeout=30,
                 what="the worker to own its slot")
        events = [("Job", {"n": n}, f"tenant-{n % 4}") for n in range(12)]
        ids = client.send_batch("q", events)  # one batch of the one slot
        wait_for(lambda: scalar(conn, "select count(finished) from cli_spans") == len(ids),
                 timeout=30, what="every event handled")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert owners(client) == [None]
    spans = conn.execute("select ev_id, key, n, started, finished from cli_spans "
                         "order by ev_id").fetchall()
    assert [(s[0], s[1], s[2]) for s in spans] == [
        (i, key, payload["n"]) for i, (_, payload, key) in zip(ids, events, strict=True)]
    for key in {s[1] for s in spans}:  # one event of a key at a time, in order
        own = [s for s in spans if s[1] == key]
        assert all(a[4] <= b[3] for a, b in pairwise(own)), own
    # At most 3 at once (--key-concurrency), and more than one: keys in parallel.
    most = scalar(conn, "select max((select count(*) from cli_spans t "
                        "where t.started <= s.started and s.started < t.finished)) "
                        "from cli_spans s")
    assert 2 <= most <= 3, spans


class RecordedTicker:
    """Stands in for pgque.Ticker: keeps the arguments it was made with."""

    made: list[dict[str, Any]]
    ticks = 0

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        self.made.append(kwargs)

    def run(self) -> None:
        """Returns at once, as a ticker stopped by a signal does."""


def test_ticker_passes_every_option_with_the_librarys_defaults(
        client: pgque.Client, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for ``pgque ticker``, whose --connect-timeout (5 s) never reached
    the Ticker (30 s), and which lacked most of its parameters."""
    defaults = {name: p.default for name, p in inspect.signature(pgque.Ticker).parameters.items()
                if p.default is not inspect.Parameter.empty and name != "required"}
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(RecordedTicker, "made", made, raising=False)
    monkeypatch.setattr(pgque, "Ticker", RecordedTicker)

    def made_by(*options: str) -> dict[str, Any]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["ticker", "--dsn", dsn, *options])
        assert exit_.value.code == 0
        return made.pop()

    assert made_by() == defaults
    assert made_by("--min-interval", "0.01", "--idle-interval", "0.2", "--idle-after", "3",
                   "--standby-interval", "0.5", "--overdue-after", "2",
                   "--maintenance-interval", "4", "--network-timeout", "12",
                   "--connect-timeout", "7", "--name", "t1", "--ownership", "lease",
                   "--lease", "9") == {
        "min_interval": 0.01, "idle_interval": 0.2, "idle_after": 3.0, "standby_interval": 0.5,
        "overdue_after": 2.0, "maintenance_interval": 4.0, "network_timeout": 12.0,
        "connect_timeout": 7.0, "name": "t1", "meter_provider": None, "ownership": "lease",
        "lease": 9.0}
