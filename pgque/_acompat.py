"""Both flavours of the few primitives that differ between threads and asyncio
by more than a keyword (as psycopg_pool's ``_acompat``).

The async source code calls the ``a``-prefixed flavour; tools/async_to_sync.py
renames each to the plain one in the sync code it generates. Everything with
a one-to-one twin (``asyncio.Lock`` and ``threading.Lock``...) is renamed
directly instead.
"""

from __future__ import annotations

import asyncio
import threading
import time


def caller() -> object:
    """Who is calling: the current thread."""
    return threading.get_ident()


def acaller() -> object:
    """Who is calling: the current task (None outside a running event loop)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def pause(delay: float, stop: threading.Event | None) -> bool:
    """Sleep ``delay`` seconds, less when ``stop`` is set meanwhile; True when it is."""
    if stop is None:
        time.sleep(delay)
        return False
    return stop.wait(delay)


async def apause(delay: float, stop: asyncio.Event | None) -> bool:
    """Sleep ``delay`` seconds, less when ``stop`` is set meanwhile; True when it is."""
    if stop is None:
        await asyncio.sleep(delay)
        return False
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        return False
    return True
