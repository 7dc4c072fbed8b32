"""Review of the AsyncWorker (issue 11, part 4): five defects of the Worker's two
flavours and their service loop. Each test failed on the reviewed code (commit
022c4ee) and passes with its fix; the docstring names the defect."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

import pgque


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
