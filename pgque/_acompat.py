"""Both flavours of the few primitives that differ between threads and asyncio
by more than a keyword (as psycopg_pool's ``_acompat``).

The async source code calls the ``a``-prefixed flavour; tools/async_to_sync.py
renames each to the plain one in the sync code it generates. Everything with
a one-to-one twin (``asyncio.Lock`` and ``threading.Lock``...) is renamed
directly instead.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import select
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, TypeAlias, TypeVar

from pgque.errors import HandlerReturnedAwaitable

R = TypeVar("R")
M = TypeVar("M")


def caller() -> object:
    """Who is calling: the current thread."""
    return threading.get_ident()


def acaller() -> object:
    """Who is calling: the current task (None outside a running event loop)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def pause(delay: float | None, stop: threading.Event | None) -> bool:
    """Sleep ``delay`` seconds, less when ``stop`` is set meanwhile; True when it is.
    A ``delay`` of None waits for ``stop`` without a limit."""
    if stop is None:
        time.sleep(delay or 0.0)
        return False
    return stop.wait(delay)


async def apause(delay: float | None, stop: asyncio.Event | None) -> bool:
    """Sleep ``delay`` seconds, less when ``stop`` is set meanwhile; True when it is.
    A ``delay`` of None waits for ``stop`` without a limit."""
    if stop is None:
        await asyncio.sleep(delay or 0.0)
        return False
    if stop.is_set():  # wait_for with no time left gives up without a look
        return True
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        return False
    return True


def notified(conn: Any, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for notifications on ``conn`` (a psycopg
    connection that LISTENs); returns how many came (0 on timeout), as soon as
    any has. The wait is select()'s: psycopg's ``notifies(timeout=...)`` spends
    about a millisecond of CPU at the end of every wait (its C wait loop spins
    through the last fraction of a millisecond), which, at five waits a second,
    was a third of an idle worker's CPU. Its ``timeout=0`` is a cheap look."""
    return len(notified_payloads(conn, timeout))


def notified_payloads(conn: Any, timeout: float) -> list[str]:
    """:func:`notified`, for the payloads of the notifications that came."""
    payloads = [n.payload for n in conn.notifies(timeout=0)]  # received meanwhile, or buffered
    if not payloads and select.select([conn.fileno()], [], [], max(0.0, timeout))[0]:
        payloads = [n.payload for n in conn.notifies(timeout=0)]
    return payloads


async def anotified(conn: Any, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for notifications on ``conn`` (a psycopg
    connection that LISTENs); returns how many came (0 on timeout), as soon as
    any has."""
    count = 0
    async for _ in conn.notifies(timeout=timeout, stop_after=1):
        count += 1
    return count


# -- the services' concurrency: a thread each in sync code, a task each under asyncio

#: What a handler returns: anything but an awaitable, which the worker ignores
#: (under asyncio, an awaitable of anything; see handler_result).
HandlerResult: TypeAlias = object
AHandlerResult: TypeAlias = Awaitable[object]

#: What spawn returns, to join.
Spawned: TypeAlias = threading.Thread
ASpawned: TypeAlias = "asyncio.Task[None]"

def spawn(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    """Run ``target(*args)`` in a daemon thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def aspawn(target: Callable[..., Awaitable[None]], *args: Any, name: str) -> asyncio.Task[None]:
    """Run ``target(*args)`` in a task of the running loop."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 11):
        return loop.create_task(_none(target(*args)), name=name)
    return _CancelNoted(_none(target(*args)), loop=loop, name=name)


class _CancelNoted(asyncio.Task):  # type: ignore[type-arg]
    """Before Python 3.11 (no Task.cancelling()), a task of aspawn notes that it
    was asked to cancel, for acancelled."""

    cancel_requested = False

    def cancel(self, *args: Any, **kwargs: Any) -> bool:
        self.cancel_requested = True
        return super().cancel(*args, **kwargs)


def cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` means that the calling thread is being cancelled: never
    (threads are not cancelled)."""
    return False


def acancelled(exc: BaseException) -> bool:
    """Whether ``exc`` means that the calling task is being cancelled, rather than
    a CancelledError the awaited code raised on its own (say that of an inner
    timeout it let escape), which is just its failure."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    if task is None:
        return False
    if sys.version_info >= (3, 11):
        return task.cancelling() > 0
    # Python 3.10: only a task of aspawn knows (a lane's, the worker's own).
    return bool(getattr(task, "cancel_requested", False))


async def _none(awaitable: Awaitable[None]) -> None:
    await awaitable


def running(thread: threading.Thread) -> bool:
    """Whether a spawned thread still runs."""
    return thread.is_alive()


def arunning(task: asyncio.Task[None]) -> bool:
    """Whether a spawned task still runs."""
    return not task.done()


def join(thread: threading.Thread, timeout: float | None = None) -> None:
    """Wait up to ``timeout`` for a spawned thread to end (not for the caller itself)."""
    if thread is not threading.current_thread():
        thread.join(timeout)


async def ajoin(task: asyncio.Task[None], timeout: float | None = None) -> None:
    """Wait up to ``timeout`` for a spawned task to end (not for the caller itself)."""
    if task is not asyncio.current_task():
        await asyncio.wait({task}, timeout=timeout)


def run_blocking(target: Callable[..., R], *args: Any) -> R:
    """Call ``target(*args)``: here it may block."""
    return target(*args)


async def arun_blocking(target: Callable[..., R], *args: Any) -> R:
    """Call ``target(*args)`` in a thread, so its blocking does not hold the loop."""
    return await asyncio.to_thread(target, *args)


def call_interruptibly(attempt: Callable[[], R], stopping: Callable[[], bool],
                       abandon: Callable[[R], object], *, poll: float, name: str) -> R | None:
    """``attempt()`` in a helper thread, polled every ``poll`` seconds: its result,
    or None as soon as ``stopping()`` (the result, when it comes, goes to ``abandon``).
    Interrupted meanwhile (KeyboardInterrupt), it hands the result over the same
    way, then lets the interruption through."""
    outcome: Future[R] = Future()

    def run() -> None:
        try:
            outcome.set_result(attempt())
        except BaseException as exc:
            outcome.set_exception(exc)

    def hand_over() -> None:
        outcome.add_done_callback(
            lambda done: done.exception() is None and abandon(done.result()))

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        while True:
            try:
                return outcome.result(timeout=poll)
            except FutureTimeout:
                if stopping():
                    hand_over()
                    return None
    except BaseException:  # the attempt's own error, for which hand_over does nothing
        hand_over()
        raise


async def acall_interruptibly(attempt: Callable[[], Awaitable[R]], stopping: Callable[[], bool],
                              abandon: Callable[[R], object], *, poll: float,
                              name: str) -> R | None:
    """``await attempt()`` in a task, polled every ``poll`` seconds: its result, or
    None as soon as ``stopping()`` (the result, when it comes, goes to ``abandon``,
    whose coroutine, if it returns one, is run in a task of its own). Cancelled
    meanwhile, it cancels the attempt too, hands over what the attempt returns
    anyway (it may have been done already) the same way, and re-raises."""
    task = asyncio.get_running_loop().create_task(_value(attempt()), name=name)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if stopping():
                task.add_done_callback(lambda finished: _abandon(finished, abandon))
                return None
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(lambda finished: _abandon(finished, abandon))
        raise


async def _value(awaitable: Awaitable[R]) -> R:
    return await awaitable


def _abandon(task: asyncio.Task[R], abandon: Callable[[R], object]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    result = abandon(task.result())
    if inspect.isawaitable(result):
        asyncio.get_running_loop().create_task(_value(result))


def take_if_free(lock: threading.Lock) -> bool:
    """Take ``lock`` if nobody holds it; whether it was taken (a connection's
    lock: another thread's call is in flight). Give it back with let_go.
    Two calls, not a context manager: the Worker checks its session between
    any two events, and a ``with`` cost more than the check it guards."""
    return lock.acquire(blocking=False)


def let_go(lock: threading.Lock) -> None:
    """Release what take_if_free took."""
    lock.release()


def atake_if_free(lock: asyncio.Lock) -> bool:
    """Whether nobody holds ``lock`` (a connection's lock: another task's call is
    in flight). Nothing is taken: the caller does not await before alet_go,
    so no other task runs meanwhile."""
    return not lock.locked()


def alet_go(lock: asyncio.Lock) -> None:
    """Nothing to release (see atake_if_free)."""


def handler_result(result: object) -> None:
    """Check what a Worker's handler returned: anything but an awaitable. A plain
    function that returns a coroutine (``lambda m: work(m)``, ``work`` an async
    def) passes check_handler, but nobody would await its work: the coroutine
    is closed (so no "never awaited" warning) and HandlerReturnedAwaitable,
    which stops the worker before it acks the batch."""
    if result is not None and inspect.isawaitable(result):  # None: most handlers
        _refuse_awaitable(result, "pgque.Worker calls its handler without awaiting, so that "
                                  "work would never run; the batch is not acked. Use "
                                  "pgque.AsyncWorker with an async def handler")


async def ahandler_result(result: Awaitable[object]) -> None:
    """Await what an AsyncWorker's handler returned: the handling itself. What
    that gives back must not be awaitable either: ``return work(m)`` in an
    async def, an ``await`` forgotten, would leave the work undone."""
    value = await result
    if inspect.isawaitable(value):
        _refuse_awaitable(value, "the handler returned it un-awaited (a missing await), so "
                                 "that work would never run; the batch is not acked")


def _refuse_awaitable(result: Awaitable[object], why: str) -> None:
    """Close a coroutine a handler left behind (no "never awaited" warning) and
    raise HandlerReturnedAwaitable, which stops the worker before its ack."""
    if inspect.iscoroutine(result):
        name = getattr(result, "__qualname__", type(result).__name__)
        result.close()
        what = f"a coroutine ({name})"
    else:
        what = f"an awaitable ({type(result).__name__})"
    raise HandlerReturnedAwaitable(f"the handler returned {what} instead of handling the "
                                   f"event: {why}")


def _is_coroutine_function(handler: object) -> bool:
    # Also an object whose class's __call__ is an async def.
    return (inspect.iscoroutinefunction(handler)
            or inspect.iscoroutinefunction(type(handler).__call__))


def check_handler(handler: object) -> None:
    """A Worker's handler is a plain function: an async one would only make
    coroutines that nobody awaits, and every event would count as handled."""
    if not callable(handler):
        raise TypeError(f"the handler must be callable, not {type(handler).__name__}")
    if _is_coroutine_function(handler):
        raise TypeError("the handler is an async function: pgque.Worker calls it without "
                        "awaiting; use pgque.AsyncWorker for it")


def acheck_handler(handler: object) -> None:
    """An AsyncWorker's handler is an async function (``async def``): a plain one
    would block the event loop, and with it every lane of the worker."""
    if not callable(handler):
        raise TypeError(f"the handler must be callable, not {type(handler).__name__}")
    if not _is_coroutine_function(handler):
        raise TypeError("the handler of pgque.AsyncWorker must be an async function "
                        "(async def); use pgque.Worker for a plain function")


# -- keys in parallel inside a batch (Worker(key_concurrency=k))


def _groups(items: Sequence[M], key: Callable[[M], Hashable]) -> list[list[int]]:
    """The positions of ``items`` grouped by key, each group in order, the
    groups in the order of their first item."""
    groups: dict[Hashable, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(key(item), []).append(index)
    return list(groups.values())


class KeyRunner:
    """Runs the items of a batch with up to ``limit`` keys at once and never two
    items of one key at once: each key's items one after another, in order, on
    one of the lane's ``limit`` threads (kept for the lane's life, so that a
    handler's thread-local state lasts), which take the keys in turn. The
    first exception stops every key at its next item and is raised once the
    running items have returned."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def run(self, items: Sequence[M], key: Callable[[M], Hashable],
            handle: Callable[[int, M], None]) -> None:
        """``handle(position, item)`` for every item, keys in parallel."""
        groups = _groups(items, key) if self.limit > 1 else []
        if len(groups) <= 1:  # one at a time: no grouping by key to do
            for index, item in enumerate(items):
                handle(index, item)
            return
        stop = threading.Event()
        turns = iter(groups)  # next() under the GIL: each group goes to one thread
        take = threading.Lock()

        def run_groups() -> None:
            # One call per thread, taking groups until none is left: a future per
            # thread and batch, not per event.
            while not stop.is_set():
                with take:
                    indexes = next(turns, None)
                if indexes is None:
                    return
                for index in indexes:
                    if stop.is_set():
                        return
                    try:
                        handle(index, items[index])
                    except BaseException:
                        stop.set()
                        raise

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.limit, thread_name_prefix=self.name)
        futures = [self._pool.submit(run_groups) for _ in range(min(self.limit, len(groups)))]
        wait_futures(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error

    def close(self) -> None:
        """Let the threads go (after the items in hand)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class AKeyRunner:
    """Runs the items of a batch with up to ``limit`` keys at once and never two
    items of one key at once: each key's items one after another, in order, in
    one of ``limit`` tasks that take the keys in turn. The first exception
    stops every key at its next item and is raised once the running items
    have returned; a cancel of the caller cancels them all."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self.name = name

    async def run(self, items: Sequence[M], key: Callable[[M], Hashable],
                  handle: Callable[[int, M], Awaitable[None]]) -> None:
        """``await handle(position, item)`` for every item, keys in parallel."""
        groups = _groups(items, key) if self.limit > 1 else []
        if len(groups) <= 1:  # one at a time: no grouping by key to do
            for index, item in enumerate(items):
                await handle(index, item)
            return
        stop = asyncio.Event()
        turns = iter(groups)

        async def run_groups() -> None:
            # limit tasks, each taking groups until none is left: a task per
            # key at once, not per event.
            for indexes in turns:
                for index in indexes:
                    if stop.is_set():
                        return
                    try:
                        await handle(index, items[index])
                    except BaseException:
                        stop.set()
                        raise

        # Through aspawn, so that acancelled tells a cancel of these tasks apart.
        tasks = [aspawn(run_groups, name=f"{self.name}{n}")
                 for n in range(min(self.limit, len(groups)))]
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            raise
        for task in tasks:
            if task.cancelled():  # by nobody but us: never take its items as handled
                raise RuntimeError(f"{task.get_name()} was cancelled")
            error = task.exception()
            if error is not None:
                raise error

    async def close(self) -> None:
        """Nothing to let go: the tasks end with their batch."""


class Pieces:
    """Runs a lane's batch pieces side by side, each ``start(target, *args)`` on
    one of the lane's daemon threads (kept while the lane lives, so a piece
    does not pay for a new thread; up to ``limit``: one per slot the lane may
    own). Daemon threads, like the lanes': a process that exits without
    stopping its Worker does not wait for them."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a piece (below 0: pieces waiting for a thread)

    def start(self, target: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._idle <= 0 and len(self._threads) < self.limit:
                self._threads.append(spawn(self._serve, name=f"{self.name}{len(self._threads)}"))
            else:
                self._idle -= 1  # one of them takes it
        self._jobs.put((target, args))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            target, args = job
            try:
                target(*args)
            finally:
                with self._lock:
                    self._idle += 1

    def cancel(self) -> None:
        """Nothing to do: threads are not cancelled (see cancelled)."""

    def close(self) -> None:
        """Wait for the pieces in hand, then let the threads go."""
        with self._lock:
            threads, self._threads = self._threads, []
            self._idle = 0
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()


class APieces:
    """Runs a lane's batch pieces side by side, each ``start(target, *args)`` in a
    task of the running loop (``limit`` is the threaded flavour's)."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self.name = name
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, target: Callable[..., Awaitable[None]], *args: Any) -> None:
        task = aspawn(target, *args, name=self.name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        """Cancel the pieces in hand (the lane that runs them is cancelled)."""
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Wait for the pieces in hand."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))
