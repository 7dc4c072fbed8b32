"""Run the sync Client's tests against the AsyncClient (test-only).

:class:`Loop` runs an event loop in a background thread and mirrors each thread
that calls into it with one task on that loop: the calls of one thread run, one
after another, inside its task, as they would run one after another on the
thread. So the AsyncClient sees the same callers a Client would (the task that
made a client is the one that may join a transaction open on its connection,
as the thread that made a Client is).

:class:`Synced` gives an async object the sync object's face: a coroutine a
method returns is run in the caller's task and its result wrapped again; an
async context manager or iterator becomes a sync one. Wrapped, an AsyncClient
answers the Client's calls, and its ``conn`` (an AsyncConnection) answers
``execute(...).fetchone()``, ``cursor()``, ``transaction()`` and ``info`` as a
Connection does, on the same server session. A call given a sync psycopg
Connection (``send(..., conn=conn)``) skips the test: the AsyncClient takes an
AsyncConnection there (tests/test_async_client.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import psycopg
import psycopg_pool
import pytest

import pgque

# Objects whose async methods are wrapped (anything else comes back as it is).
_WRAPPED = (pgque.AsyncClient, psycopg.AsyncConnection, psycopg.AsyncCursor,
            psycopg.AsyncTransaction, psycopg_pool.AsyncConnectionPool)


class Loop:
    """An event loop in a thread of its own, with one task per calling thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="async-twin",
                                        daemon=True)
        self._thread.start()
        self._lanes: dict[int, asyncio.Queue[Any]] = {}
        self._lock = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` in the calling thread's task; its result, or its exception."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a Synced call from the loop's own thread would deadlock")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._lane().put_nowait, (coro, done))
        return done.result()

    def _lane(self) -> asyncio.Queue[Any]:
        with self._lock:
            lane = self._lanes.get(threading.get_ident())
            if lane is None:
                lane = self._lanes[threading.get_ident()] = asyncio.Queue()
                asyncio.run_coroutine_threadsafe(self._serve(lane), self.loop)
            return lane

    async def _serve(self, lane: asyncio.Queue[Any]) -> None:
        while True:
            coro, done = await lane.get()
            try:
                result = await coro
            except BaseException as exc:
                done.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                done.set_result(result)

    def wrap(self, value: Any) -> Any:
        """The sync face of ``value`` (a coroutine is run first)."""
        if asyncio.iscoroutine(value):
            value = self.run(value)
        if isinstance(value, _WRAPPED) or hasattr(value, "__aenter__"):
            return Synced(self, value)
        return value

    def close(self) -> None:
        """Cancel the tasks and stop the loop (clients left open are not closed)."""
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


def unwrap(value: Any) -> Any:
    return value.target if isinstance(value, Synced) else value


class Synced:
    """The sync face of an async object (see the module docstring)."""

    def __init__(self, loop: Loop, target: Any) -> None:
        self.loop = loop
        self.target = target

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.target, name)
        if callable(value) and not isinstance(value, type):
            def call(*args: Any, **kwargs: Any) -> Any:
                args = tuple(unwrap(a) for a in args)
                kwargs = {k: unwrap(v) for k, v in kwargs.items()}
                if any(isinstance(a, psycopg.Connection) for a in (*args, *kwargs.values())):
                    # An AsyncClient cannot write in a sync connection's transaction;
                    # tests/test_async_client.py covers its own (AsyncConnection) case.
                    pytest.skip(f"{name}() is given a psycopg.Connection: sync only")
                return self.loop.wrap(value(*args, **kwargs))
            return call
        return self.loop.wrap(value)

    def __enter__(self) -> Any:
        return self.loop.wrap(self.target.__aenter__())

    def __exit__(self, *exc: Any) -> Any:
        return self.loop.run(self.target.__aexit__(*exc))

    def __iter__(self) -> Iterator[Any]:
        iterator = self.target.__aiter__()
        while True:
            try:
                yield self.loop.wrap(self.loop.run(iterator.__anext__()))
            except StopAsyncIteration:
                return

    def __repr__(self) -> str:
        return f"Synced({self.target!r})"


def connect(loop: Loop, dsn: str, **kwargs: Any) -> Any:
    """``pgque.connect`` for the async twin: an AsyncClient, with the sync face."""
    return loop.wrap(pgque.connect_async(dsn, **kwargs))


def client_over(loop: Loop, client_class: Any, conn: Any, *args: Any, **kwargs: Any) -> Any:
    """``pgque.Client(conn)``; for a connection with the sync face (a transactional
    AsyncWorker handler's), an AsyncClient over it, with the sync face."""
    if isinstance(conn, Synced):
        return Synced(loop, pgque.AsyncClient(conn.target, *args, **kwargs))
    return client_class(conn, *args, **kwargs)


class SyncedWorker:
    """``pgque.Worker``'s face over a ``pgque.AsyncWorker`` run on a :class:`Loop`.

    The test's handler is a plain function that may block (an Event, a sleep):
    it runs in a thread of its own while its lane's task awaits it, as the
    Worker runs it in the lane's thread; a transactional one gets the lane's
    AsyncConnection with the sync face. Everything else, the worker's own
    waits, calls and errors, is the AsyncWorker's. Its methods that return
    coroutines are run on the loop; ``start`` and ``request_stop`` run there too.
    """

    def __init__(self, loop: Loop, dsn: str, *, handler: Any, transactional: bool = False,
                 **options: Any) -> None:
        self.loop = loop
        # Not the loop's default executor: its few threads would let a test
        # whose handlers all block (waiting for each other) hang.
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                              thread_name_prefix="handler")
        if not callable(handler):
            threaded: Any = handler  # the AsyncWorker's own check refuses it
        elif transactional:
            async def threaded(message: Any, conn: Any) -> Any:
                return await asyncio.get_running_loop().run_in_executor(
                    self._threads, handler, message, Synced(loop, conn))
        else:
            async def threaded(message: Any) -> Any:
                return await asyncio.get_running_loop().run_in_executor(
                    self._threads, handler, message)
        self.target = pgque.AsyncWorker(dsn, handler=threaded, transactional=transactional,
                                        **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)  # alive, error, handled, owned_slots...

    def _on_loop(self, function: Any) -> Any:
        async def call() -> Any:
            return function()
        return self.loop.run(call())

    def start(self) -> None:
        self._on_loop(self.target.start)

    def request_stop(self) -> None:
        self._on_loop(self.target.request_stop)

    def run(self) -> None:
        self.loop.run(self.target.run())

    def stop(self, timeout: float | None = 30.0) -> None:
        self.loop.run(self.target.stop(timeout))

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return bool(self.loop.run(self.target.wait_stopped(timeout)))

    def wait(self, until: Any = None, *, timeout: float | None = None) -> bool:
        return bool(self.loop.run(self.target.wait(until, timeout=timeout)))

    def __enter__(self) -> SyncedWorker:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.run(self.target.__aexit__(*exc))  # the AsyncWorker's own exit

    def __class_getitem__(cls, item: Any) -> Any:
        return cls  # pgque.Worker[Any](...)
