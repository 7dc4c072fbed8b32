"""The fault suite: real Worker processes and producers against the test server,
one fault injected per scenario, then the checks of tests/faults.py:

* no committed event lost (handled, or dead-lettered when it always fails);
* nothing delivered that rolled back;
* per (producer, key), first handlings in send order;
* always-failing events dead-lettered once each, after exactly max_retries;
* the zombie bound, where the victim's sessions end on the server side;
* the latency bound of healthy slots while the ticker holder is frozen;
* workers exit 0 on SIGTERM afterwards.

Each scenario prints one ``FAULTS ...`` summary line (duplicates, overlaps,
time until the victim's slots moved, zombie starts, latency) and appends its
figures to ``fault_report.json`` in pytest's base temp directory (or
``PGQUE_FAULTS_REPORT``).

Long variants (30 s freezes and blackholes, repeated kills, bigger loads) run
only with ``PGQUE_FAULTS_LONG=1`` (``make test-faults``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pgtest
import pytest
from faults import (
    FaultRun,
    Workload,
    append_report,
    fault_run,
    network_factories,
    report_path,
    summary_line,
)
from psycopg.conninfo import make_conninfo

LONG = os.environ.get("PGQUE_FAULTS_LONG") == "1"


def long_variant(*values: Any, id: str | None = None) -> Any:
    """A parameter set that runs only with PGQUE_FAULTS_LONG=1."""
    return pytest.param(*values, id=id, marks=[
        pytest.mark.faults_long,
        pytest.mark.skipif(not LONG, reason="long fault variant: PGQUE_FAULTS_LONG=1 "
                                            "(make test-faults)")])


Scenario = Callable[..., FaultRun]


@pytest.fixture
def scenario(request: pytest.FixtureRequest, dsn: str, pg_server: pgtest.PgServer,
             tmp_path: Path) -> Iterator[Scenario]:
    """Make the test's FaultRun (one per test); everything it started is
    released at the end, whatever happened."""
    with contextlib.ExitStack() as stack:
        def make(workload: Workload | None = None) -> FaultRun:
            return stack.enter_context(fault_run(request.node.name, dsn, tmp_path,
                                                 workload or Workload(),
                                                 pg_server.major_version))
        yield make


@pytest.fixture
def conclude(capsys: pytest.CaptureFixture[str],
             tmp_path_factory: pytest.TempPathFactory) -> Callable[[FaultRun], None]:
    """Drain and stop the run, report it, and fail with every check that failed."""
    def finish(run: FaultRun) -> None:
        run.finish()
        report = run.conclude()
        append_report(report_path(tmp_path_factory.getbasetemp()), report)
        with capsys.disabled():
            print("\n" + summary_line(report), flush=True)
        if report["failures"]:
            run.dump_logs()
        assert not report["failures"], (
            "\n".join(report["failures"]) + "\nreport: " + json.dumps(report, default=str))
    return finish


def cool_down(run: FaultRun) -> None:
    time.sleep(run.workload.cooldown)  # traffic after the fault, not a synchronisation


# -- 1. SIGKILL ---------------------------------------------------------------------


@pytest.mark.parametrize("kills", [3, long_variant(10, id="10-long")])
def test_sigkill_mid_batch(scenario: Scenario, conclude: Callable[[FaultRun], None],
                           kills: int) -> None:
    """The oldest worker (the ticker holder first) is killed mid-handler, then
    replaced, again and again."""
    run = scenario()
    run.start(each=lambda i: {"victim": True})
    for _ in range(kills):
        run.sigkill(run.live_workers()[0])
        run.spawn(victim=True)
        run.wait_spread()
    cool_down(run)
    conclude(run)


# -- 2. SIGSTOP ---------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [10, long_variant(30, id="30-long")])
def test_sigstop_ticker_holder(scenario: Scenario, conclude: Callable[[FaultRun], None],
                               seconds: float) -> None:
    """The worker holding the ticker election freezes. The server ends its slot
    sessions (idle_session_timeout of 3 s on them), so its slots move; after
    SIGCONT it must not go on starting events of the batches it had (zombie
    bound). Its ticker session (on a DSN without the timeout) stays and keeps
    the election for the whole freeze: the healthy workers' slots must still
    deliver within 5 s.

    The timeout comes from the DSN's options, and from network_timeout on a
    Worker that has it (which then sets idle_session_timeout to 5/6 of it on
    its sessions, overriding the DSN's)."""
    run = scenario()
    frozen_dsn = make_conninfo(run.dsn, options="-c idle_session_timeout=3000 "
                                                 "-c idle_in_transaction_session_timeout=3000")
    run.start(first={"dsn": frozen_dsn, "ticker_dsn": run.dsn, "network_timeout": 3.6,
                     "victim": True})
    fault = run.sigstop(run.workers[0], seconds, expect_session_end=True, latency_bound=True)
    if not fault.ticker:
        run.failures.append(f"{fault.victim} did not hold the ticker election when frozen")
    cool_down(run)
    conclude(run)


# -- 3. the network: a proxy that cuts or blackholes ---------------------------------


@pytest.mark.parametrize("cuts", [1, long_variant(5, id="5-long")])
def test_proxy_cut(scenario: Scenario, conclude: Callable[[FaultRun], None],
                   cuts: int) -> None:
    """A worker's connections (all through a proxy) are closed on both sides
    mid-handler: the server ends its sessions, and the zombie bound applies."""
    run = scenario()
    net = run.network()
    run.start(each=lambda i: {"network": net, "victim": True} if i == 1 else {})
    for _ in range(cuts):
        run.cut(run.workers[1], net)
        run.wait_spread()
    cool_down(run)
    conclude(run)


@pytest.mark.parametrize("network", list(network_factories()))
@pytest.mark.parametrize(("end", "seconds"), [
    ("heal", 8), ("close", 8),
    long_variant("heal", 30, id="heal-30-long"), long_variant("close", 30, id="close-30-long")])
def test_blackhole(scenario: Scenario, conclude: Callable[[FaultRun], None], network: str,
                   end: str, seconds: float) -> None:
    """A worker's traffic stops in both directions (sockets kept open), then
    flows again (heal) or its connections are closed (close). Through the proxy
    the server never notices (the proxy's kernel still ACKs): the slots stall
    for the whole blackhole. Real packet loss: tests/netns.py, see faults.py."""
    run = scenario()
    net = run.network(network_factories()[network])
    run.start(each=lambda i: {"network": net, "network_timeout": 5.0} if i == 1 else {})
    run.blackhole(run.workers[1], net, seconds, end=end)
    run.wait_spread()
    cool_down(run)
    conclude(run)


# -- 4. pg_terminate_backend -----------------------------------------------------------


@pytest.mark.parametrize("rounds", [1, long_variant(6, id="6-long")])
def test_terminate_backend(scenario: Scenario, conclude: Callable[[FaultRun], None],
                           rounds: int) -> None:
    """Every session of a worker is terminated mid-handler (found by its
    application_name); the zombie bound applies. Long: each worker in turn,
    the ticker holder included."""
    run = scenario()
    run.start(each=lambda i: {"victim": i == 1 or rounds > 1})
    for i in range(rounds):
        run.terminate(run.workers[(i + 1) % len(run.workers)])
        run.wait_spread()
    cool_down(run)
    conclude(run)


# -- 5. server restart -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_server_restart(scenario: Scenario, conclude: Callable[[FaultRun], None],
                        restartable_server: pgtest.PgServer, mode: str) -> None:
    """The server stops (fast: sessions terminated, checkpoint; immediate: a
    crash, recovery at start) and starts again while everything runs."""
    run = scenario()
    run.start(first={"victim": True})
    run.restart(restartable_server, mode)
    run.wait_spread()
    cool_down(run)
    conclude(run)


# -- 6. long producer transactions -------------------------------------------------------


@pytest.mark.parametrize("seconds", [5, long_variant(30, id="30-long")])
def test_long_producer_transactions(scenario: Scenario, conclude: Callable[[FaultRun], None],
                                    seconds: float) -> None:
    """Two producers keep each transaction open 2-4 s, then commit or roll back
    (in turn), while the others produce normally: late commits are not skipped,
    rollbacks never delivered, order holds."""
    run = scenario()
    run.start(slow=2)
    time.sleep(seconds)  # the slow producers' transactions come and go meanwhile
    conclude(run)


# -- 7. failing handlers --------------------------------------------------------------


@pytest.mark.parametrize("seconds", [4, long_variant(30, id="30-long")])
def test_failing_handler(scenario: Scenario, conclude: Callable[[FaultRun], None],
                         seconds: float) -> None:
    """A quarter of the events fail once or twice (by payload), and every event
    of key 'doomed' always fails: each of those must be dead-lettered once,
    after exactly max_retries (2) retries; everything else succeeds."""
    run = scenario(Workload(fail_once=0.15, fail_twice=0.10, doomed_every=8))
    run.start()
    time.sleep(seconds)  # failures and retries come and go meanwhile
    conclude(run)
