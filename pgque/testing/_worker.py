"""Run a real Worker in a test until it has done what the test waits for."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import psycopg

from pgque.types import Message
from pgque.worker import Worker

__all__ = ["WorkerRun", "run_worker"]

T = TypeVar("T")

_POLL = 0.05  # seconds between looks at the group while draining, and at the worker's thread

# Whether the group has nothing left to do: every one of its slots subscribed,
# no event waiting for any slot, no batch open, no failed event waiting to be retried.
_DRAINED = """
select count(*) = %(slots)s
       and coalesce(bool_and(pending_events = 0 and open_batch_id is null
                             and retries_waiting = 0), false)
  from pgque.partition_slot_status
 where queue_name = %(queue)s and consumer_name = %(consumer)s
"""


@dataclass
class WorkerRun(Generic[T]):
    """What :func:`run_worker` saw, once its worker has stopped."""

    #: The stopped Worker.
    worker: Worker[T]
    #: The messages whose handler call returned, in the order the calls ended.
    handled: list[Message[T]] = field(default_factory=list)
    #: The messages whose handler call raised, with the exception, in the same order.
    failed: list[tuple[Message[T], BaseException]] = field(default_factory=list)


def run_worker(dsn: str, *, queue: str, consumer: str, handler: Callable[[Message[T]], object],
               slots: int = 1, events: int | None = None, payload_type: type[T] | None = None,
               timeout: float = 30.0, **options: Any) -> WorkerRun[T]:
    """Run a :class:`~pgque.Worker` of group ``consumer`` (``slots`` slots) on
    ``queue`` until it is done, stop it and return what it handled.

    Done means: with ``events``, that many handler calls have ended (returned
    or raised); without, the group is drained: no event waits for any of its
    slots, no batch is open and no failed event waits to be retried (so retries
    are waited for until they succeed or become dead letters; pass
    ``retry_after=0`` to make that quick). The Worker subscribes the group on
    start, at the present: subscribe it (``subscribe_slots``) before sending
    what it should see. Stopping finishes the batches in hand, so a few more
    than ``events`` may be handled, and acks them.

    ``options`` go to the Worker (``retry_after``, ``concurrency``, ...); it runs
    its own Ticker unless told ``ticker=False``, and draining needs something
    to tick. Raises the error that stopped the worker on its own (an unknown
    queue, another slot count), or TimeoutError after ``timeout`` seconds.
    """
    if events is not None and events < 1:
        raise ValueError("events must be at least 1")
    lock = threading.Lock()
    done = threading.Event()
    run: WorkerRun[T]

    def counted(message: Message[T]) -> object:
        try:
            result = handler(message)
        except BaseException as exc:
            with lock:
                run.failed.append((message, exc))
                calls = len(run.handled) + len(run.failed)
            if events is not None and calls >= events:
                done.set()
            raise
        with lock:
            run.handled.append(message)
            calls = len(run.handled) + len(run.failed)
        if events is not None and calls >= events:
            done.set()
        return result

    worker = Worker(dsn, queue=queue, consumer=consumer, slots=slots, handler=counted,
                    payload_type=payload_type, **options)
    run = WorkerRun(worker)
    goal = f"{events} handler calls" if events is not None else "the group to drain"
    deadline = time.monotonic() + timeout
    reached = False
    worker.start()
    try:
        with contextlib.ExitStack() as stack:
            probe = None
            if events is None:
                probe = stack.enter_context(psycopg.connect(dsn, autocommit=True))
            while worker.alive:
                if probe is None:
                    reached = done.is_set()
                else:
                    row = probe.execute(_DRAINED, {"slots": slots, "queue": queue,
                                                   "consumer": consumer}).fetchone()
                    reached = bool(row and row[0])
                left = deadline - time.monotonic()
                if reached or left <= 0:
                    break
                done.wait(min(_POLL, left))
    finally:
        worker.stop()
    if events is not None:
        reached = done.is_set()  # also when the count was reached as the loop ended
    if worker.error is not None:
        raise worker.error
    if worker.alive:
        raise RuntimeError(f"{worker.name} did not stop")
    if not reached:
        with lock:
            seen = f"{len(run.handled)} handled, {len(run.failed)} failed"
        if time.monotonic() < deadline:  # ended on its own without an error: not expected
            raise RuntimeError(f"{worker.name} stopped before {goal} ({seen})")
        raise TimeoutError(f"{worker.name}: waited {timeout} s for {goal} ({seen})")
    return run
