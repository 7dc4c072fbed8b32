"""pgque/_acompat.py: each primitive's two flavours behave alike (no database)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest

from pgque import _acompat


def test_pause_sees_a_stop_set_before_it_even_with_no_time_left() -> None:
    """Waits with nothing left to wait (a deadline just passed) must still see a
    set stop: the asyncio flavour once gave up without a look, and a worker
    waiting for its end never saw it."""
    stop = threading.Event()
    stop.set()
    assert _acompat.pause(0, stop) is True
    assert _acompat.pause(0.0, threading.Event()) is False

    async def flavour() -> tuple[bool, bool]:
        stop = asyncio.Event()
        stop.set()
        return await _acompat.apause(0, stop), await _acompat.apause(0.0, asyncio.Event())

    assert asyncio.run(flavour()) == (True, False)


def test_pause_returns_when_the_stop_is_set_meanwhile() -> None:
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert _acompat.pause(10, stop) is True
    assert time.monotonic() - started < 5

    async def flavour() -> bool:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        return await _acompat.apause(10, stop)

    assert asyncio.run(flavour()) is True


def test_spawn_join_and_running() -> None:
    release = threading.Event()
    thread = _acompat.spawn(release.wait, name="t")
    assert _acompat.running(thread)
    _acompat.join(thread, 0.01)
    assert _acompat.running(thread)
    release.set()
    _acompat.join(thread)
    assert not _acompat.running(thread)

    async def flavour() -> list[bool]:
        release = asyncio.Event()

        async def wait() -> None:
            await release.wait()

        task = _acompat.aspawn(wait, name="t")
        seen = [_acompat.arunning(task)]
        await _acompat.ajoin(task, 0.01)
        seen.append(_acompat.arunning(task))
        release.set()
        await _acompat.ajoin(task)
        seen.append(_acompat.arunning(task))
        return seen

    assert asyncio.run(flavour()) == [True, True, False]


def test_call_interruptibly_gives_up_on_a_stop_and_hands_over_a_late_result() -> None:
    abandoned: list[Any] = []
    arrived = threading.Event()

    def slow() -> str:
        time.sleep(0.3)
        return "late"

    def abandon(value: Any) -> None:
        abandoned.append(value)
        arrived.set()

    assert _acompat.call_interruptibly(slow, lambda: True, abandon, poll=0.01, name="c") is None
    assert arrived.wait(5) and abandoned == ["late"]
    assert _acompat.call_interruptibly(lambda: "now", lambda: False, abandon, poll=0.01,
                                       name="c") == "now"

    async def flavour() -> tuple[Any, Any, list[Any]]:
        closed: list[Any] = []

        async def aslow() -> str:
            await asyncio.sleep(0.2)
            return "late"

        async def close(value: Any) -> None:
            closed.append(value)

        async def now() -> str:
            return "now"

        gave_up = await _acompat.acall_interruptibly(aslow, lambda: True, close, poll=0.01,
                                                     name="c")
        await asyncio.sleep(0.4)  # the late result arrives; its abandon coroutine runs
        done = await _acompat.acall_interruptibly(now, lambda: False, close, poll=0.01,
                                                  name="c")
        return gave_up, done, closed

    assert asyncio.run(flavour()) == (None, "now", ["late"])


def test_handlers_of_the_wrong_flavour_are_refused() -> None:
    async def coroutine_handler(message: Any) -> None:
        pass

    def plain_handler(message: Any) -> None:
        pass

    class AsyncCallable:
        async def __call__(self, message: Any) -> None:
            pass

    with pytest.raises(TypeError, match="AsyncWorker"):
        _acompat.check_handler(coroutine_handler)
    with pytest.raises(TypeError, match="AsyncWorker"):
        _acompat.check_handler(AsyncCallable())
    with pytest.raises(TypeError, match="async def"):
        _acompat.acheck_handler(plain_handler)
    with pytest.raises(TypeError, match="callable"):
        _acompat.acheck_handler(None)
    _acompat.check_handler(plain_handler)
    _acompat.acheck_handler(coroutine_handler)
    _acompat.acheck_handler(AsyncCallable())


def test_call_interruptibly_hands_over_the_attempt_when_the_caller_is_cancelled() -> None:
    """Review of the AsyncWorker, defect 4: a caller cancelled (not stopped) while
    the attempt ran left the attempt's task going, and what it made (a
    connection) never reached ``abandon``: nobody closed it. Now the attempt is
    cancelled, and what it returns anyway goes to ``abandon``. The sync flavour
    hands it over the same way when the wait is interrupted (KeyboardInterrupt)."""

    async def flavour() -> tuple[list[Any], list[str]]:
        abandoned: list[Any] = []
        handed = asyncio.Event()
        events: list[str] = []

        def abandon(value: Any) -> None:
            abandoned.append(value)
            handed.set()

        async def stubborn() -> str:  # completes although cancelled, as a connect may
            events.append("started")
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                events.append("cancelled")
            await asyncio.sleep(0.05)
            return "late"

        async def cancellable() -> str:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                events.append("gave up")
                raise
            return "never"

        for attempt in (stubborn, cancellable):
            caller = asyncio.get_running_loop().create_task(_acompat.acall_interruptibly(
                attempt, lambda: False, abandon, poll=0.01, name="c"))
            await asyncio.sleep(0.05)  # the attempt runs
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
        await asyncio.wait_for(handed.wait(), 5)
        await asyncio.sleep(0.1)  # nothing more comes
        return abandoned, events

    assert asyncio.run(flavour()) == (["late"], ["started", "cancelled", "gave up"])

    abandoned: list[Any] = []
    arrived = threading.Event()

    def slow() -> str:
        time.sleep(0.3)
        return "late"

    def abandon(value: Any) -> None:
        abandoned.append(value)
        arrived.set()

    def interrupted() -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _acompat.call_interruptibly(slow, interrupted, abandon, poll=0.01, name="c")
    assert arrived.wait(5) and abandoned == ["late"]


def test_cancelled_tells_a_cancelled_task_from_a_handler_s_own_cancelled_error() -> None:
    """Review of the AsyncWorker, defect 3's primitive: under asyncio, a
    CancelledError means the task is being cancelled only when it is (a handler
    may raise one of its own, say an inner timeout's it let escape); in threads
    nothing is ever cancelled."""
    assert _acompat.cancelled(asyncio.CancelledError()) is False

    async def flavour() -> tuple[bool, bool, list[bool]]:
        own = False
        try:
            raise asyncio.CancelledError()
        except asyncio.CancelledError as exc:
            own = _acompat.acancelled(exc)
        other = _acompat.acancelled(ValueError())
        seen: list[bool] = []
        waiting = asyncio.Event()

        async def victim() -> None:
            try:
                waiting.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError as exc:
                seen.append(_acompat.acancelled(exc))
                raise

        task = _acompat.aspawn(victim, name="victim")
        await waiting.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return own, other, seen

    assert asyncio.run(flavour()) == (False, False, [True])


ITEMS = [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("a", 2), ("d", 0), ("c", 1)]


def _key(item: tuple[str, int]) -> str:
    return item[0]


class _Trace:
    """What a KeyRunner did: each key's items in the order run, overlaps of one
    key, and the most items running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[str, list[int]] = {}
        self.running: dict[str, int] = {}
        self.overlaps = 0
        self.now = 0
        self.most = 0

    def enter(self, item: tuple[str, int]) -> None:
        with self.lock:
            self.order.setdefault(item[0], []).append(item[1])
            self.running[item[0]] = self.running.get(item[0], 0) + 1
            self.overlaps += self.running[item[0]] > 1
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self, item: tuple[str, int]) -> None:
        with self.lock:
            self.running[item[0]] -= 1
            self.now -= 1


@pytest.mark.parametrize("limit", [1, 3])
def test_key_runner_runs_keys_in_parallel_each_key_in_order(limit: int) -> None:
    trace, atrace = _Trace(), _Trace()
    runner = _acompat.KeyRunner(limit, "t")

    def handle(index: int, item: tuple[str, int]) -> None:
        assert ITEMS[index] == item
        trace.enter(item)
        time.sleep(0.01)
        trace.leave(item)

    try:
        runner.run(ITEMS, _key, handle)
    finally:
        runner.close()

    async def flavour() -> None:
        arunner = _acompat.AKeyRunner(limit, "t")

        async def ahandle(index: int, item: tuple[str, int]) -> None:
            assert ITEMS[index] == item
            atrace.enter(item)
            await asyncio.sleep(0.01)
            atrace.leave(item)

        await arunner.run(ITEMS, _key, ahandle)
        await arunner.close()

    asyncio.run(flavour())
    for t in (trace, atrace):
        assert t.order == {"a": [0, 1, 2], "b": [0, 1], "c": [0, 1], "d": [0]}
        assert t.overlaps == 0
        assert t.most == limit  # four keys: as many at once as allowed


def test_key_runner_stops_every_key_at_the_first_error_and_raises_it() -> None:
    ran: list[tuple[str, int]] = []

    def handle(index: int, item: tuple[str, int]) -> None:
        ran.append(item)
        if item == ("a", 0):
            raise KeyError("boom")
        time.sleep(0.02)

    runner = _acompat.KeyRunner(2, "t")
    with pytest.raises(KeyError, match="boom"):
        runner.run(ITEMS, _key, handle)
    runner.close()
    assert ("a", 1) not in ran and len(ran) < len(ITEMS)

    aran: list[tuple[str, int]] = []

    async def flavour() -> None:
        async def ahandle(index: int, item: tuple[str, int]) -> None:
            aran.append(item)
            if item == ("a", 0):
                raise KeyError("boom")
            await asyncio.sleep(0.02)

        with pytest.raises(KeyError, match="boom"):
            await _acompat.AKeyRunner(2, "t").run(ITEMS, _key, ahandle)

    asyncio.run(flavour())
    assert ("a", 1) not in aran and len(aran) < len(ITEMS)


def test_a_cancelled_key_runner_cancels_its_keys() -> None:
    cancelled: list[str] = []

    async def flavour() -> None:
        going = asyncio.Event()

        async def ahandle(index: int, item: tuple[str, int]) -> None:
            going.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(item[0])
                raise

        task = asyncio.ensure_future(_acompat.AKeyRunner(3, "t").run(ITEMS, _key, ahandle))
        await going.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(flavour(), 10))
    assert sorted(cancelled) == ["a", "b", "c"]
