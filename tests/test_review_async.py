"""Review of the AsyncWorker (issue 11, part 4): five defects of the Worker's two
flavours and their service loop. Each test failed on the reviewed code (commit
022c4ee) and passes with its fix; the docstring names the defect."""

from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Coroutine
from typing import Any

import faults
import psycopg
import pytest
from helpers import scalar, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque import lifecycle_async


def _queue(client: pgque.Client, events: int = 3) -> list[int]:
    """Queue q, group g of one slot, ``events`` events of one key, ticked."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    ids = client.send_batch("q", [("e", n, "k") for n in range(events)])
    client.tick("q")
    return ids


def _run_in_thread(worker: Any) -> tuple[threading.Thread, list[BaseException]]:
    """``worker.run()`` in a thread of its own: the thread and what run() raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, name="run", daemon=True)
    runner.start()
    return runner, raised


# -- 1. a plain handler that returns a coroutine (sync Worker) ----------------------


@pytest.mark.parametrize("transactional", [False, True])
def test_a_plain_handler_that_returns_a_coroutine_stops_the_worker_unacked(
        client: pgque.Client, dsn: str, transactional: bool) -> None:
    """Defect 1: the sync Worker refused an ``async def`` handler, but a plain
    function returning a coroutine (``lambda m: work(m)``) had every event
    counted as handled and its batch acked, though no work ran. Now the
    coroutine is closed (no "never awaited" warning), nothing of the batch is
    acked, and the worker stops: run() raises HandlerReturnedAwaitable (a
    TypeError naming pgque.AsyncWorker), kept in worker.error."""
    ids = _queue(client)
    ran: list[int] = []
    made: list[Coroutine[Any, Any, None]] = []

    async def work(message: pgque.Message[Any]) -> None:
        ran.append(message.id)

    def handler(message: pgque.Message[Any], *conn: Any) -> Any:
        coroutine = work(message)
        made.append(coroutine)
        return coroutine

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=1, handler=handler,
                          transactional=transactional, ticker=False, retry_after=100)
    runner, raised = _run_in_thread(worker)
    runner.join(10)
    if runner.is_alive():
        worker.stop()
    assert not runner.is_alive(), f"still running after {worker.handled} events handled"
    assert [type(e) for e in raised] == [pgque.HandlerReturnedAwaitable]
    assert worker.error is raised[0]
    assert isinstance(worker.error, TypeError) and "pgque.AsyncWorker" in str(worker.error)
    assert worker.handled == 0 and worker.failed == 0
    assert ran == [] and len(made) == 1
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED
    # Not acked, nothing nacked: the whole batch is delivered again, first time.
    assert client.claim_slot("q", "g", 0)
    batch = client.receive_partitioned("q", "g", slot=0, slots=1)
    assert batch is not None and [m.id for m in batch.messages] == ids
    assert [m.retry_count for m in batch.messages] == [0, 0, 0]


# -- 2. SIGTERM with several run()s in one process ---------------------------------

_TWO_RUNS = textwrap.dedent("""
    import asyncio, sys, time
    import pgque

    dsn, variant = sys.argv[1], sys.argv[2]

    async def handler(message):
        pass

    async def main():
        workers = [pgque.AsyncWorker(dsn, queue="q", consumer=f"g{i}", slots=1,
                                     handler=handler, ticker=False, name=f"w{i}")
                   for i in range(2)]
        runs = [asyncio.create_task(w.run()) for w in workers]
        deadline = time.monotonic() + 30
        while not all(w.owned_slots for w in workers):
            assert time.monotonic() < deadline, "the workers never got their slots"
            await asyncio.sleep(0.02)
        if variant == "one-first":
            workers[0].request_stop()
            await runs[0]
            print("first stopped", flush=True)
        print("ready", flush=True)
        await asyncio.gather(*runs)
        print("stopped", [w.error for w in workers], flush=True)

    asyncio.run(main())
""")


@pytest.mark.parametrize("variant", ["together", "one-first"])
def test_one_sigterm_stops_every_run_of_the_process(client: pgque.Client, dsn: str,
                                                    variant: str) -> None:
    """Defect 2: each AsyncService.run() installed a SIGTERM handler of its own, so
    with two AsyncWorkers run under one asyncio.run one SIGTERM stopped only the
    last one installed (the other ran on), and the first run() to return put
    back the default handler: a SIGTERM then killed the process instead of
    stopping the other worker. Now one handler, installed by the first run(),
    flags every running service, and the last one to leave restores the
    original: both stop cleanly and the process exits 0."""
    client.create_queue("q")
    proc = subprocess.Popen([sys.executable, "-c", _TWO_RUNS, dsn, variant],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if variant == "one-first":
            assert proc.stdout.readline().strip() == "first stopped"
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("a worker went on running after SIGTERM")
        assert proc.returncode == 0, f"ended by signal {-proc.returncode}"
        assert out.strip() == "stopped [None, None]"
    finally:
        proc.kill()
        proc.wait()


def test_the_signal_registry_flags_every_service_and_restores_the_original() -> None:
    """Defect 2, the registry both flavours share (pgque/_signals.py): a signal
    flags every registered service, the handler stays while one is left, the
    original comes back after the last, and a thread other than the main one
    registers nothing (only the main thread may set a handler)."""
    from pgque import _signals

    class Service:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def _on_signal(self, signum: int) -> None:
            self.seen.append(signum)

    def deliver(signum: int, *services: Service) -> None:
        counts = [len(s.seen) for s in services]
        signal.raise_signal(signum)
        wait_for(lambda: all(len(s.seen) > n for s, n in zip(services, counts, strict=True)),
                 timeout=5, what="the signal to be noted")

    original_calls: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: original_calls.append(signum))
    mine = signal.getsignal(signal.SIGTERM)
    try:
        first, second = Service(), Service()
        assert _signals.register(first) and _signals.register(second)
        deliver(signal.SIGTERM, first, second)
        _signals.unregister(first)
        deliver(signal.SIGTERM, second)
        assert first.seen == [signal.SIGTERM] and second.seen == [signal.SIGTERM] * 2
        assert signal.getsignal(signal.SIGTERM) is not mine
        _signals.unregister(second)
        assert signal.getsignal(signal.SIGTERM) is mine
        signal.raise_signal(signal.SIGTERM)
        wait_for(lambda: original_calls, timeout=5, what="the original handler to run")
        registered: list[bool] = []
        elsewhere = threading.Thread(target=lambda: registered.append(
            _signals.register(Service())))
        elsewhere.start()
        elsewhere.join()
        assert registered == [False] and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, original)


# -- 3. a cancelled lane task (AsyncWorker) ------------------------------------------


def test_a_cancelled_lane_nacks_nothing_and_acks_nothing(client: pgque.Client,
                                                         dsn: str) -> None:
    """Defect 3: the AsyncWorker's lane took the CancelledError raised into its
    handler when the lane task itself was cancelled for a failure of the event:
    it nacked the event (charging a retry) and went on with the batch, acking
    it. Now the lane re-raises: nothing is nacked or acked, the lane ends, and
    the slot's next lane gets the whole batch again, retry counts 0."""
    ids = _queue(client)

    async def main() -> tuple[list[tuple[int, int]], int, int]:
        calls: list[tuple[int, int]] = []
        in_handler = asyncio.Event()

        async def handler(message: pgque.Message[Any]) -> None:
            calls.append((message.id, message.retry_count))
            if len(calls) == 1:
                in_handler.set()
                await asyncio.Event().wait()  # until cancelled

        worker: pgque.AsyncWorker[Any] = pgque.AsyncWorker(
            dsn, queue="q", consumer="g", slots=1, handler=handler, ticker=False,
            retry_after=100, rebalance_interval=0.1, name="cancel-test")
        async with worker:
            await asyncio.wait_for(in_handler.wait(), 20)
            lane = next(t for t in asyncio.all_tasks() if t.get_name() == "cancel-test-lane1")
            lane.cancel()
            await asyncio.wait({lane}, timeout=10)
            assert lane.done()
            failed_at_cancel = worker.failed
            deadline = time.monotonic() + 20
            while len(calls) < 1 + len(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        return calls, failed_at_cancel, worker.failed

    calls, failed_at_cancel, failed = asyncio.run(main())
    assert failed_at_cancel == 0 and failed == 0
    # The first try cut short; then the whole batch again, none of it a retry.
    assert calls == [(ids[0], 0), *((i, 0) for i in ids)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert scalar(conn, "select sum(retries_waiting) from pgque.partition_slot_status") == 0


# -- 4. a connection attempt orphaned by a cancelled run() ----------------------------


def test_a_cancelled_connect_closes_the_connection_it_was_opening(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 4 (a real connection): AsyncService.connect cancelled (not stopped)
    while its attempt ran left the attempt going, and the connection it made
    was never closed. Now the attempt is cancelled and, should it complete
    anyway, its connection goes to the abandon callback, which closes it."""
    opened: list[psycopg.AsyncConnection[Any]] = []
    over = threading.Event()  # the attempt ended: connected, failed or cancelled
    real = lifecycle_async.open_connection_async

    async def recording(*args: Any, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        try:
            conn = await real(*args, **kwargs)
        finally:
            over.set()
        opened.append(conn)  # kept, so that only a close() can end its session
        return conn

    monkeypatch.setattr(lifecycle_async, "open_connection_async", recording)
    app = "pgque-cancelled-connect"

    async def main() -> None:
        service = lifecycle_async.AsyncService(app)
        task = asyncio.get_running_loop().create_task(service.connect(dsn))
        await asyncio.sleep(0)  # the attempt task is made and started
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while not (over.is_set() and all(c.closed for c in opened)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert over.is_set()
    assert all(c.closed for c in opened), "the connection made after the cancel stays open"
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(lambda: not scalar(conn, "select count(*) from pg_stat_activity "
                                          "where application_name = %s", (app,)),
                 what="the abandoned session to end", dsn=dsn)


# -- 5. a missing database, retried for ever ---------------------------------------------


@pytest.mark.both_workers
@pytest.mark.parametrize("missing", ["dbname", "user"])
def test_a_worker_that_never_connects_stops_after_connect_timeout(
        dsn: str, missing: str) -> None:
    """Defect 5: libpq reports every connection failure without an SQLSTATE (a
    missing database or role alike), so the service loop took them for an
    outage and retried for ever. Now a service that has never connected since
    it started gives up once connect_timeout has passed without a first
    connection: run() raises the ConnectError (worker.error keeps it)."""
    params = conninfo_to_dict(dsn)
    params[missing] = "pgque_no_such_" + missing
    worker = pgque.Worker(make_conninfo(**params), queue="q", consumer="g", slots=1,
                          handler=lambda message: None, connect_timeout=1)
    started = time.monotonic()
    runner, raised = _run_in_thread(worker)
    runner.join(15)
    took = time.monotonic() - started
    if runner.is_alive():
        worker.stop()
    assert not runner.is_alive(), "still retrying after 15 s"
    assert [type(e) for e in raised] == [pgque.ConnectError]
    assert worker.error is raised[0]
    assert 1 <= took < 12


def test_a_ticker_that_never_connects_stops_after_connect_timeout(dsn: str) -> None:
    """Defect 5, for the Ticker (a service of its own): it retried a missing
    database for ever too; now its run() raises the ConnectError."""
    ticker = pgque.Ticker(make_conninfo(dsn, dbname="pgque_no_such_dbname"),
                          connect_timeout=1)
    runner, raised = _run_in_thread(ticker)
    runner.join(15)
    if runner.is_alive():
        ticker.stop()
    assert not runner.is_alive(), "still retrying after 15 s"
    assert [type(e) for e in raised] == [pgque.ConnectError]
    assert ticker.error is raised[0]


@pytest.mark.both_workers
def test_a_worker_that_connected_retries_an_outage_longer_than_connect_timeout(
        client: pgque.Client, dsn: str) -> None:
    """Defect 5, the other half: once a service has connected, an outage is retried
    for ever (with backoff), however long it lasts: here three times
    connect_timeout, with every connection attempt held unanswered."""
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


def test_cancelling_run_stops_every_lane_and_closes_every_session(client: pgque.Client,
                                                                  dsn: str) -> None:
    """A probe that held (noted as open in an earlier session): cancelling the
    task of ``AsyncWorker.run()`` while its lanes handle events ends the task
    with CancelledError, and then no handler runs again, no task of the
    worker is left on the loop, and none of its sessions stays open."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=4)
    client.send_batch("q", [("e", n, f"k{n}") for n in range(400)])
    client.tick("q")

    def sessions() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return int(scalar(conn, "select count(*) from pg_stat_activity"
                                    " where application_name like 'cancel-run%%'"))

    async def main() -> tuple[int, int, list[str]]:
        calls: list[int] = []

        async def handler(message: pgque.Message[Any]) -> None:
            calls.append(message.id)
            await asyncio.sleep(0.002)

        worker: pgque.AsyncWorker[Any] = pgque.AsyncWorker(
            dsn, queue="q", consumer="g", slots=4, handler=handler, ticker=False,
            name="cancel-run")
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 20
        while len(calls) < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(calls) >= 40, "the worker did not start handling"
        assert sessions() > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
        at_cancel = len(calls)
        await asyncio.sleep(0.5)  # a lane still running would handle more by now
        left = [t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return at_cancel, len(calls), left

    at_cancel, after, left = asyncio.run(main())
    assert after == at_cancel and left == []
    assert sessions() == 0
