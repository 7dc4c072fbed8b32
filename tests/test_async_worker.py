"""The AsyncWorker's own cases, on asyncio (the Worker's tests run against it too:
modules marked both_workers, see conftest.py): a cancelled lane, run() or connect
acks, nacks and leaves open nothing; one SIGTERM stops every run() of a process;
and a sync Worker handed a coroutine stops and names the AsyncWorker."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Coroutine
from typing import Any

import psycopg
import pytest
from helpers import run_in_thread, scalar, wait_for

import pgque
from pgque import lifecycle_async


def queue_of_one_key(client: pgque.Client, events: int = 3) -> list[int]:
    """Queue q, group g of one slot, ``events`` events of one key, ticked."""
    client.create_queue("q", ticker_max_lag=0)
    client.subscribe_slots("q", "g", slots=1)
    ids = client.send_batch("q", [("e", n, "k") for n in range(events)])
    client.tick("q")
    return ids


# -- a coroutine handed to the sync Worker ---------------------------------------------------


@pytest.mark.parametrize("transactional", [False, True])
def test_a_plain_handler_that_returns_a_coroutine_stops_the_worker_unacked(
        client: pgque.Client, dsn: str, transactional: bool) -> None:
    """A sync Worker's handler that is a plain function returning a coroutine
    (``lambda m: work(m)``) stops the worker: the coroutine is closed unrun (no
    "never awaited" warning), nothing of the batch is acked or nacked, and run()
    raises HandlerReturnedAwaitable (a TypeError naming pgque.AsyncWorker), kept in
    worker.error."""
    ids = queue_of_one_key(client)
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
    runner, raised = run_in_thread(worker)
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


def test_an_async_handler_that_returns_a_coroutine_is_not_acked(
        client: pgque.Client, dsn: str) -> None:
    """The AsyncWorker's handler that returns a coroutine unawaited (``async def
    handle(m): return work(m)``, a forgotten await) does not get its event acked
    with no work done: either the work runs, or the event stays pending."""
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=1)
    ran: list[int] = []

    async def work(message: pgque.Message[Any]) -> None:
        ran.append(message.id)

    async def handle(message: pgque.Message[Any]) -> Any:
        return work(message)  # forgot the await

    [ev] = client.send_batch("q", [("e", None, "k")])

    async def main() -> pgque.AsyncWorker[Any]:
        worker: pgque.AsyncWorker[Any] = pgque.AsyncWorker(
            dsn, queue="q", consumer="g", slots=1, handler=handle, retry_after=100)
        task = asyncio.get_running_loop().create_task(worker.run())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not task.done() and worker.handled == 0:
            await asyncio.sleep(0.05)
        if not task.done():
            await worker.stop()
        with contextlib.suppress(Exception):
            await task
        return worker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "never awaited"
        worker = asyncio.run(main())
    # Either the event was really handled, or it was not acked (still pending).
    pending = scalar(client.conn, "select pending_events from pgque.partition_slot_status")
    assert ran == [ev] or (worker.handled == 0 and pending == 1), (
        f"handled={worker.handled} ran={ran} pending={pending}")

# -- SIGTERM with several run()s in one process ----------------------------------------------


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
    """Two AsyncWorkers under one asyncio.run, stopped together or one first: one
    SIGTERM stops every run() still going, cleanly, and the process exits 0. One
    handler serves every running service of the process; the last one to leave
    puts the original back."""
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
    """The signal registry both flavours share (pgque/_signals.py): a signal flags
    every registered service, the handler stays while one is left, the original
    comes back after the last, and a thread other than the main one registers
    nothing (only the main thread may set a handler)."""
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


# -- cancellation ----------------------------------------------------------------------------


def test_a_cancelled_lane_nacks_nothing_and_acks_nothing(client: pgque.Client,
                                                         dsn: str) -> None:
    """A lane task cancelled while its handler runs ends with the CancelledError: the
    event is not nacked (no retry charged), nothing of the batch is acked, and the
    slot's next lane gets the whole batch again, retry counts 0."""
    ids = queue_of_one_key(client)

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


def test_a_cancelled_connect_closes_the_connection_it_was_opening(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncService.connect cancelled (not stopped) while its attempt runs cancels
    the attempt, and should the attempt complete anyway, its connection goes to the
    abandon callback, which closes it: no session is left behind."""
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


def test_cancelling_run_stops_every_lane_and_closes_every_session(client: pgque.Client,
                                                                  dsn: str) -> None:
    """Cancelling the task of ``AsyncWorker.run()`` while its lanes handle events ends
    the task with CancelledError; then no handler runs again, no task of the worker
    is left on the loop, and none of its sessions stays open."""
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
