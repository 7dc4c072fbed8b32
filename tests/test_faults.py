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

The blackhole runs through a TCP proxy (no real loss: its kernel still ACKs)
and with real packet loss (test_blackhole_netns: the victim in a network
namespace, its veth link blackholed by nftables); the netns variants need
root, ``ip``/``nft``/``ss`` and kernel support, and skip with the reason
otherwise (tests/netns.py).

Long variants (30 s freezes and blackholes, the default network_timeout of
30 s under real packet loss, repeated kills) run only with
``PGQUE_FAULTS_LONG=1`` (``make test-faults``; ``-m faults_long`` for them alone).
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
    NetnsNetwork,
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
def netns_scenario(request: pytest.FixtureRequest, netns_server: Any, netns_dsn: str,
                   tmp_path: Path) -> Iterator[Callable[..., tuple[FaultRun, Any]]]:
    """Like ``scenario``, on the ``netns_server`` (a netns.LinkServer, whose
    namespace a worker can be put in): returns the run and the server. Skips
    where network namespaces or nftables cannot be used."""
    with contextlib.ExitStack() as stack:
        def make(workload: Workload | None = None) -> tuple[FaultRun, Any]:
            run = stack.enter_context(fault_run(request.node.name, netns_dsn, tmp_path,
                                                workload or Workload(),
                                                netns_server.major_version))
            return run, netns_server
        yield make


Check = Callable[[dict[str, Any]], list[str]]


@pytest.fixture
def conclude(capsys: pytest.CaptureFixture[str],
             tmp_path_factory: pytest.TempPathFactory) -> Callable[..., None]:
    """Drain and stop the run, report it, and fail with every check that failed
    (``check(report)`` adds the test's own: a list of failures)."""
    def finish(run: FaultRun, check: Check | None = None) -> None:
        run.finish()
        report = run.conclude()
        if check is not None:
            report["failures"].extend(check(report))
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


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
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


@pytest.mark.parametrize("seconds", [8, long_variant(30, id="30-long")])
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
    frozen_dsn = make_conninfo(run.worker_dsn,
                               options="-c idle_session_timeout=3000 "
                                       "-c idle_in_transaction_session_timeout=3000")
    run.start(first={"dsn": frozen_dsn, "ticker_dsn": run.dsn, "network_timeout": 3.6,
                     "victim": True})
    fault = run.sigstop(run.workers[0], seconds, expect_session_end=True, latency_bound=True)
    if not fault.ticker:
        run.failures.append(f"{fault.victim} did not hold the ticker election when frozen")
    cool_down(run)
    conclude(run)


# -- 3. the network: a proxy that cuts or blackholes ---------------------------------


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
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


@pytest.mark.parametrize(("end", "seconds"), [
    ("heal", 5), long_variant("close", 3, id="close-3-long"),
    long_variant("heal", 30, id="heal-30-long"), long_variant("close", 30, id="close-30-long")])
def test_blackhole_proxy(scenario: Scenario, conclude: Callable[[FaultRun], None], end: str,
                         seconds: float) -> None:
    """A worker's traffic stops in both directions (sockets kept open), then
    flows again (heal) or its connections are closed (close). Through the proxy
    no TCP timeout fires (the proxy's kernel still ACKs both sides): the server
    ends the worker's silent sessions by idle_session_timeout (5/6 of its
    network_timeout of 5 s, so after 4.2 s: ``heal`` after 5 s), and the worker
    gives up on calls unanswered for half of it. ``close`` after 3 s comes
    first: the proxy's close ends the sessions. Real packet loss:
    test_blackhole_netns."""
    run = scenario()
    net = network_factories()["proxy"](run, None)
    run.start(each=lambda i: {"network": net, "network_timeout": 5.0} if i == 1 else {})
    run.blackhole(run.workers[1], net, seconds, end=end)
    run.wait_spread()
    cool_down(run)
    conclude(run)


#: Slots must have moved within network_timeout plus this (rebalance, claim,
#: receive, the first handler call; the rebalance interval is 0.2 s).
MOVE_MARGIN = 2.0
#: After the heal, the victim handles events again within this many seconds,
#: by network_timeout. Measured (handles_after_heal_s): 0.6-1.3 s for both. The
#: wait is a connection attempt begun during the blackhole waiting for its next
#: SYN retransmission (1, 2, 4 s apart; an attempt lasts at most libpq's
#: connect_timeout, or tcp_user_timeout), then the other workers releasing
#: their surplus slots at a batch boundary.
REJOIN_BOUND = {6.0: 6.0, 30.0: 10.0}


@pytest.mark.parametrize("network_timeout", [
    6.0, long_variant(None, id="default-long")])
def test_blackhole_netns(netns_scenario: Callable[..., tuple[FaultRun, Any]],
                         conclude: Callable[..., None], network_timeout: float | None) -> None:
    """Real packet loss, twice on the same worker: it runs in a network
    namespace and talks to the server over a veth link that nftables
    blackholes at both ends (no ACK, no RST: both kernels see silence), each
    time while it is busy with a batch (handlers of 20-80 ms).

    * ``partition-busy``: the link goes dark at once; the victim's next
      request (it rebalances every 0.2 s) is lost, the server's session idles.
    * ``partition-answer``: the link goes dark the moment the server sends the
      victim's slot session data, so what is lost is an answer: the server
      holds unacknowledged data and the victim waits for it.

    ``network_timeout`` 6 s, or the Worker's default (30 s) in the long
    variant. Asserted, for each: the victim's client side gives up before the
    server ends its slot session; the zombie bound; its slots are handled by
    other workers within network_timeout + 2 s; after the heal it reconnects,
    owns a slot and handles events again within REJOIN_BOUND."""
    run, server = netns_scenario()
    net = network_factories()["netns"](run, server)
    assert isinstance(net, NetnsNetwork)
    nt = 30.0 if network_timeout is None else network_timeout  # pgque.Worker's default
    victim: dict[str, Any] = {"network": net, "victim": True}
    if network_timeout is not None:
        victim["network_timeout"] = network_timeout
    run.start(each=lambda i: victim if i == 1 else {})
    server_log = getattr(server.postgres, "logfile", None)
    for answer in (False, True):
        run.wait_balanced()  # the victim has its full share when hit
        run.partition(run.workers[1], net, answer=answer, max_seconds=nt + 10,
                      server_log=server_log)
    run.wait_spread()
    cool_down(run)

    def check(report: dict[str, Any]) -> list[str]:
        failures = []
        for f in report["faults"]:
            moved = f["moved_s"]
            if any(v is None or v > nt + MOVE_MARGIN for v in moved.values()):
                failures.append(f"{f['kind']}: slots of {f['victim']} not handled by another "
                                f"worker within {nt + MOVE_MARGIN}s of the blackhole: {moved}")
            taken = f.get("slots_owned_by_others_s")
            if taken is None or taken > nt + MOVE_MARGIN:
                failures.append(f"{f['kind']}: slots of {f['victim']} not owned by other "
                                f"workers within {nt + MOVE_MARGIN}s: {taken}")
            back = f.get("handles_after_heal_s")
            if back is None or back > REJOIN_BOUND[nt]:
                failures.append(f"{f['kind']}: {f['victim']} did not handle events again "
                                f"within {REJOIN_BOUND[nt]}s of the heal: {back}")
        return failures

    conclude(run, check)


# -- 4. pg_terminate_backend -----------------------------------------------------------


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
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


# -- 5b. transactional handlers ----------------------------------------------------------


@pytest.mark.parametrize("worker_flavour", ["sync", long_variant("async", id="async-long")],
                         indirect=True)
def test_transactional_effects_exactly_once(scenario: Scenario,
                                            conclude: Callable[[FaultRun], None],
                                            restartable_server: pgtest.PgServer) -> None:
    """Transactional handlers write each event's effect (a row, and its amount
    added to the key's balance) in the transaction that acks the batch, and
    some fail once or twice (their effect rolls back with their savepoint).
    A worker is SIGKILLed mid-handler, another has every session terminated,
    then the server crashes (immediate stop) and starts again. Checked beyond
    the usual: every effect applied exactly once, none of an always-failing
    event, and every key's balance equal to what its sent events add up to."""
    run = scenario(Workload(transactional=True, fail_once=0.1, fail_twice=0.05))
    run.start(each=lambda i: {"victim": True})
    run.sigkill(run.live_workers()[0])
    run.spawn(victim=True)
    run.wait_spread()
    run.terminate(run.live_workers()[0])
    run.wait_spread()
    run.restart(restartable_server, "immediate")
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


# -- 8. the pause policy ---------------------------------------------------------------


@pytest.mark.parametrize("worker_flavour", [long_variant("sync", id="sync-long"), "async"],
                         indirect=True)
@pytest.mark.parametrize("transactional", [long_variant(False, id="plain-long"),
                                           pytest.param(True, id="transactional")])
def test_pause_policy_under_kills_terminations_and_a_restart(
        scenario: Scenario, conclude: Callable[[FaultRun], None],
        restartable_server: pgtest.PgServer, transactional: bool) -> None:
    """The pause policy, with events failing once or twice and a key that always
    fails: a worker is SIGKILLed mid-handler (between a failure and the ack that
    holds its key, or while a piece of held events is out), another has every
    session terminated, then the server crashes (immediate stop) and starts
    again. Beyond the usual checks: after a failure nothing later of its key
    starts before it succeeded or was dead-lettered, and each always-failing
    event is dead-lettered once after max_retries + 1 attempts."""
    run = scenario(Workload(failure_policy="pause", transactional=transactional,
                            fail_once=0.12, fail_twice=0.06, doomed_every=20))
    run.start(each=lambda i: {"victim": True})
    run.sigkill(run.live_workers()[0])
    run.spawn(victim=True)
    run.wait_spread()
    run.terminate(run.live_workers()[0])
    run.wait_spread()
    run.restart(restartable_server, "immediate")
    run.wait_spread()
    cool_down(run)
    conclude(run)


# -- 9. by lease, behind a transaction pooler ---------------------------------------------


@pytest.fixture
def pooler() -> None:
    """Skip where pgbouncer is not installed (``make system-deps`` installs it)."""
    from pgbouncer import find_pgbouncer

    if find_pgbouncer() is None:
        pytest.skip("pgbouncer is not installed (`make system-deps` installs Debian's package)")


@pytest.mark.usefixtures("pooler")
@pytest.mark.parametrize("worker_flavour", ["sync", long_variant("async", id="async-long")],
                         indirect=True)
def test_by_lease_behind_a_transaction_pooler(scenario: Scenario,
                                              conclude: Callable[[FaultRun], None]) -> None:
    """The workers own their slots by lease (2 s), behind a PgBouncer in
    transaction mode that logs them in as their team, with transactional
    handlers, some failing once or twice. A worker is SIGKILLed mid-handler:
    its slots move once its lease expired. Then the ticker holder is frozen
    (SIGSTOP) for 4 s: its leases expire, its slots move, and after SIGCONT it
    starts no event of the slots it lost before it owns slots again (the zombie
    bound, from the expiry of its leases). Beyond the usual checks, every
    effect applied exactly once and every key's balance right."""
    run = scenario(Workload(ownership="lease", lease=2.0, transactional=True,
                            fail_once=0.1, fail_twice=0.05))
    run.start(each=lambda i: {"victim": True})
    run.sigkill(run.live_workers()[-1])
    run.spawn(victim=True)
    run.wait_spread()
    fault = run.sigstop(run.workers[0], 4, expect_session_end=True, latency_bound=True)
    if not fault.ticker:
        run.failures.append(f"{fault.victim} did not hold the ticker election when frozen")
    run.wait_spread()
    cool_down(run)
    conclude(run)


@pytest.mark.usefixtures("pooler")
@pytest.mark.parametrize("mode", [long_variant("immediate", id="immediate-long")])
def test_by_lease_through_a_server_restart_behind_a_pooler(
        scenario: Scenario, conclude: Callable[[FaultRun], None],
        restartable_server: pgtest.PgServer, mode: str) -> None:
    """By lease behind the pooler, the server crashes (immediate stop) and
    starts again: the pooler's server sessions all end, and the workers carry
    on through it with their leases (renewed, or taken anew)."""
    run = scenario(Workload(ownership="lease", lease=3.0, transactional=True))
    run.start(first={"victim": True})
    run.restart(restartable_server, mode)
    run.wait_spread()
    cool_down(run)
    conclude(run)


@pytest.mark.usefixtures("pooler")
@pytest.mark.parametrize("cuts", [long_variant(2, id="2-long")])
def test_proxy_cut_by_lease_behind_a_pooler(scenario: Scenario,
                                            conclude: Callable[[FaultRun], None],
                                            cuts: int) -> None:
    """By lease, a worker's connections to the pooler (all through a proxy) are
    closed on both sides mid-handler: its lanes end, and its control, on a new
    connection, ends their leases (it does not wait for them to expire); the
    zombie bound counts from their end."""
    run = scenario(Workload(ownership="lease", lease=2.0))
    net = run.network()
    run.start(each=lambda i: {"network": net, "victim": True} if i == 1 else {})
    for _ in range(cuts):
        run.cut(run.workers[1], net)
        run.wait_spread()
    cool_down(run)
    conclude(run)


@pytest.mark.usefixtures("pooler")
@pytest.mark.parametrize("lease", [long_variant(15.0, id="default-lease-long")])
def test_sigkill_by_lease_takes_over_within_the_default_lease(
        scenario: Scenario, conclude: Callable[[FaultRun], None], lease: float) -> None:
    """By lease with the default lease time (15 s), transactional handlers: a
    worker is SIGKILLed mid-handler; its slots move within the lease time."""
    run = scenario(Workload(ownership="lease", lease=lease, transactional=True))
    run.start(each=lambda i: {"victim": True})
    run.sigkill(run.live_workers()[-1])
    run.spawn(victim=True)
    run.wait_spread(timeout=lease + 30)
    cool_down(run)

    def check(report: dict[str, Any]) -> list[str]:
        return [f"{f['victim']}'s slots moved after {f['moved_s']} (lease {lease}s)"
                for f in report["faults"]
                if any(v is None or v > lease + MOVE_MARGIN for v in f["moved_s"].values())]

    conclude(run, check)


@pytest.mark.usefixtures("pooler")
@pytest.mark.parametrize(("end", "seconds"), [long_variant("heal", 5, id="heal-5-long"),
                                              long_variant("close", 4, id="close-4-long")])
def test_blackhole_by_lease_behind_a_pooler(scenario: Scenario,
                                            conclude: Callable[[FaultRun], None], end: str,
                                            seconds: float) -> None:
    """By lease (2 s), a worker's traffic to the pooler stops in both directions
    (sockets kept open), then flows again (heal) or its connections are closed
    (close). Its leases are not renewed: they expire and its slots move; its
    lanes see their leases lapse and start no further event (the zombie bound,
    from the expiry); after the heal it takes new leases and works again."""
    run = scenario(Workload(ownership="lease", lease=2.0))
    net = network_factories()["proxy"](run, None)
    run.start(each=lambda i: {"network": net, "victim": True} if i == 1 else {})
    run.blackhole(run.workers[1], net, seconds, end=end)
    run.wait_spread()
    cool_down(run)
    conclude(run)
