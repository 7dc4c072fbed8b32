"""Behind a transaction-mode pooler the single-owner promise cannot hold: fail loudly.

A slot is owned through a session advisory lock. PgBouncer in transaction mode
runs each transaction of a client on whichever server session is free, so the
lock a client took stays with a server session that other clients use next,
and the client's next call may land on a session that holds nothing. The
Worker, the Ticker and ``Client.claim_slot`` must notice and raise
:class:`pgque.SessionUnstable` (a configuration error: never retried), while
the same code behind a *session*-mode pooler must work as on a direct
connection (no false positive).

The ``pgbouncer`` fixtures (conftest.py, tests/pgbouncer.py) skip where
pgbouncer is not installed (``make system-deps``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from psycopg.conninfo import conninfo_to_dict

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)

#: How long a misconfigured Worker or Ticker may take to give up.
STOP_DEADLINE = 10.0
EVENTS = 300
KEYS = 41
SLOTS = 8

# The words a SessionUnstable message should contain to point the user at the cause.
POOLER_WORDS = re.compile(r"pooler|pgbouncer|session", re.IGNORECASE)


def dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def make_group(client: pgque.Client) -> list[int]:
    """Queue q, group g of SLOTS slots, EVENTS events over KEYS keys; returns their ids."""
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=200)
    client.subscribe_slots("q", "g", slots=SLOTS)
    return client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}") for i in range(EVENTS)])


class Recorder:
    """A handler that records what it handled, and any two handlers of one
    partition key that ran at the same time (two owners of one slot)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handled: list[int] = []
        self.running: Counter[str] = Counter()
        self.overlaps: list[tuple[str, int]] = []

    def __call__(self, message: pgque.Message[Any]) -> None:
        key = message.partition_key or ""
        with self.lock:
            self.running[key] += 1
            if self.running[key] > 1:
                self.overlaps.append((key, message.id))
        try:
            time.sleep(0.001)  # widen the window in which two owners would overlap
        finally:
            with self.lock:
                self.running[key] -= 1
                self.handled.append(message.id)


@contextlib.contextmanager
def churn(dsn: str, clients: int = 1) -> Iterator[None]:
    """Keep some of the pooler's server sessions busy with short transactions,
    so that consecutive transactions of any other client land on different
    server sessions (as they do under real traffic)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
                    while not stop.is_set():
                        with conn.transaction():
                            conn.execute("select pg_sleep(0.02)")
                        time.sleep(0.005)
            except psycopg.Error:
                stop.wait(0.1)  # the test database is being dropped, or the like

    threads = [threading.Thread(target=loop, daemon=True, name=f"churn-{i}")
               for i in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)


def assert_session_unstable(error: BaseException | None, who: str) -> None:
    assert isinstance(error, pgque.SessionUnstable), f"{who} stopped with {error!r}"
    assert POOLER_WORDS.search(str(error)), f"{who}: the message does not say why: {error}"


def test_two_workers_behind_a_transaction_pooler_stop_with_session_unstable(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    recorder = Recorder()
    workers = [pgque.Worker(pooled, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                            concurrency=2, ticker=False, poll_interval=0.05,
                            rebalance_interval=0.1, connect_timeout=5, name=f"pooled-{n}")
               for n in "ab"]
    # Ticks come from a direct connection: only the workers are behind the pooler.
    with pgque.Ticker(dsn, maintenance_interval=0.5), churn(pooled):
        for worker in workers:
            worker.start()
        try:
            wait_for(lambda: all(w.wait_stopped(0) for w in workers), timeout=STOP_DEADLINE,
                     what="both pooled workers to stop by themselves", dsn=dsn)
        finally:
            for worker in workers:
                worker.stop(timeout=10)
    for worker in workers:
        assert_session_unstable(worker.error, worker.name)
    assert not recorder.overlaps, f"one key handled by two owners at once: {recorder.overlaps}"


def test_workers_that_gave_up_behind_the_pooler_leave_no_slot_locked(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """The locks a pooled worker took stay with the pooler's server sessions
    after the worker is gone (a transaction-mode pooler resets nothing), and the
    pooler would keep those sessions for its server_idle_timeout (10 minutes by
    default). The worker's sessions carry an idle_session_timeout of about its
    network_timeout, so the server ends them, and frees the slots, once they
    fall silent: a misconfigured process blocks the others for that long only."""
    ids = make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    recorder = Recorder()
    workers = [pgque.Worker(pooled, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                            concurrency=2, ticker=False, poll_interval=0.05,
                            rebalance_interval=0.1, connect_timeout=5, network_timeout=4,
                            name=f"pooled-{n}")
               for n in "ab"]
    with pgque.Ticker(dsn, maintenance_interval=0.5):
        with churn(pooled):
            for worker in workers:
                worker.start()
            try:
                wait_for(lambda: all(w.wait_stopped(0) for w in workers),
                         timeout=STOP_DEADLINE, what="both pooled workers to stop", dsn=dsn)
            finally:
                for worker in workers:
                    worker.stop(timeout=10)
        direct = pgque.Worker(dsn, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                              ticker=False, poll_interval=0.05, rebalance_interval=0.1,
                              name="direct")
        with direct:
            wait_for(lambda: len(direct.owned_slots) == SLOTS, timeout=STOP_DEADLINE,
                     what="a direct worker to own every slot", dsn=dsn)
            wait_for(lambda: set(recorder.handled) >= set(ids), timeout=30,
                     what="every event handled", dsn=dsn)


def test_run_raises_session_unstable_behind_a_transaction_pooler(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """run() (the foreground loop, as the CLI uses it) raises instead of retrying."""
    make_group(client)
    worker = pgque.Worker(pgbouncer.dsn(dbname(dsn)), queue="q", consumer="g", slots=SLOTS,
                          handler=Recorder(), ticker=False, poll_interval=0.05,
                          rebalance_interval=0.1, connect_timeout=5)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    with pgque.Ticker(dsn), churn(pgbouncer.dsn(dbname(dsn))):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(STOP_DEADLINE)
        if thread.is_alive():
            worker.stop(timeout=10)
            pytest.fail(f"run() did not give up within {STOP_DEADLINE}s behind the pooler")
    [error] = outcome
    assert_session_unstable(error, "Worker.run()")


def test_claim_slot_from_two_clients_behind_a_transaction_pooler_raises(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """Two clients whose calls share one server session: each "claims" slot 0
    (a session advisory lock is reentrant, so both would succeed) and receives.
    At least one must get SessionUnstable, and never may both receive the slot."""
    make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    errors: list[pgque.SessionUnstable] = []
    received: list[str] = []
    with pgque.connect(pooled, pool_size=0) as a, pgque.connect(pooled, pool_size=0) as b:
        clients = {"a": a, "b": b}
        claimed: dict[str, bool] = {}
        for name, c in clients.items():
            try:
                claimed[name] = c.claim_slot("q", "g", 0)
            except pgque.SessionUnstable as exc:
                errors.append(exc)
        client.tick("q")
        for name, c in clients.items():
            if not claimed.get(name):
                continue
            try:
                if c.receive_partitioned("q", "g", slot=0, slots=SLOTS) is not None:
                    received.append(name)
            except pgque.SessionUnstable as exc:
                errors.append(exc)
    assert errors, f"no SessionUnstable: claims {claimed}, received by {received}"
    assert len(received) < 2, "both clients received slot 0 as its owner"
    for error in errors:
        assert_session_unstable(error, "claim_slot/receive_partitioned")


def test_receive_on_another_server_session_than_the_claim_raises(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """The claim's server session is pinned by someone else's open transaction,
    so the owner's next call runs on a session that does not hold the lock:
    SessionUnstable, not a plain SlotNotOwned."""
    make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    with pgque.connect(pooled, pool_size=0) as owner, \
            psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as other:
        try:
            assert owner.claim_slot("q", "g", 0)
        except pgque.SessionUnstable:
            return  # noticed already at the claim: fine too
        client.tick("q")
        with other.transaction():
            # The only idle server session is the claim's: this transaction holds it.
            other.execute("select 1")
            with pytest.raises(pgque.SessionUnstable) as info:
                owner.receive_partitioned("q", "g", slot=0, slots=SLOTS)
    assert_session_unstable(info.value, "receive_partitioned")


def test_ticker_behind_a_transaction_pooler_stops_and_does_not_block_a_direct_one(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """A Ticker behind a transaction pooler stops with SessionUnstable; the
    election lock it left on the pooler's server session goes with that
    session's idle timeout, so a correctly connected ticker then takes over."""
    make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    ticker = pgque.Ticker(pooled, connect_timeout=5, maintenance_interval=0.2,
                          network_timeout=4)
    with churn(pooled):
        ticker.start()
        try:
            wait_for(lambda: not ticker.alive, timeout=STOP_DEADLINE,
                     what="the pooled ticker to stop by itself", dsn=dsn)
        finally:
            ticker.stop(timeout=10)
    assert_session_unstable(ticker.error, "Ticker")
    with pgque.Ticker(dsn) as direct:
        assert direct.wait_active(STOP_DEADLINE), \
            "the ticker lock is still held by the pooler's server session"


def test_workers_behind_a_session_pooler_work_normally(
        client: pgque.Client, dsn: str, pgbouncer_session: Any) -> None:
    """No false positive: a session-mode pooler keeps each client on one server
    session (but still hides the backend pid: BackendKeyData is pgbouncer's)."""
    ids = make_group(client)
    pooled = pgbouncer_session.dsn(dbname(dsn))
    recorder = Recorder()
    workers = [pgque.Worker(pooled, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                            concurrency=2, ticker=False, poll_interval=0.05,
                            rebalance_interval=0.1, connect_timeout=5, name=f"session-{n}")
               for n in "ab"]
    with pgque.Ticker(dsn):
        for worker in workers:
            worker.start()
        try:
            wait_for(lambda: len(recorder.handled) >= EVENTS or any(
                w.wait_stopped(0) for w in workers), timeout=60,
                what="all events handled through the session pooler", dsn=dsn)
            more = client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}") for i in range(100)])
            wait_for(lambda: len(recorder.handled) >= EVENTS + 100 or any(
                w.wait_stopped(0) for w in workers), timeout=60,
                what="the second wave handled", dsn=dsn)
            for worker in workers:
                assert not worker.wait_stopped(0), f"{worker.name} stopped: {worker.error!r}"
        finally:
            for worker in workers:
                worker.stop(timeout=30)
    for worker in workers:
        assert worker.error is None, f"{worker.name}: {worker.error!r}"
    assert sorted(recorder.handled) == sorted(ids + more)
    assert not recorder.overlaps
    assert sum(w.handled for w in workers) == EVENTS + 100


def test_ticker_behind_a_session_pooler_ticks(
        client: pgque.Client, dsn: str, pgbouncer_session: Any) -> None:
    make_group(client)
    with pgque.Ticker(pgbouncer_session.dsn(dbname(dsn))) as ticker:
        wait_for(lambda: ticker.ticks > 0, timeout=STOP_DEADLINE,
                 what="a tick through the session pooler", dsn=dsn)
        assert ticker.alive
    assert ticker.error is None


def test_a_pin_reset_on_its_own_session_comes_back_and_another_pin_still_raises(
        client: pgque.Client, dsn: str) -> None:
    """No false positive when the pin's setting is reset on the pinned session
    itself (RESET ALL here; the rollback of the pinning transaction is
    tests/test_review_issue24.py): the next check puts the token back. A backend
    that another client pinned since, or another backend, still raises."""
    make_group(client)
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as other:
        owner = pgque.Client(conn)
        assert owner.claim_slot("q", "g", 0)
        conn.execute("reset all")
        assert owner.claim_slot("q", "g", 0)
        assert scalar(conn, "select current_setting('pgque.session_token')") != ""
        pid = owner.pinned_pid
        with pytest.raises(psycopg.Error) as info:  # another backend, with no token
            other.execute("select pgque.session_checked('q', %s, 'someone')", (pid,))
        assert info.value.sqlstate == "PQ025"
        conn.execute("select pgque.pin_session('someone-else')")  # another client's pin
        with pytest.raises(pgque.SessionUnstable):
            owner.release_slot("q", "g", 0)
