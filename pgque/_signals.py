"""SIGTERM and SIGINT for every service whose ``run()`` runs in the main thread.

One handler serves the whole process, and both flavours (the Worker and the
AsyncWorker, the Ticker, the tail): the first ``run()`` to register installs
it, keeping the handlers it replaces; a signal flags every registered service;
the last one to leave puts the original handlers back. So several
``AsyncWorker.run()`` gathered under one ``asyncio.run`` all stop on one
SIGTERM, and the first of them to return does not hand the others' SIGTERM
back to the default handler, which would kill the process.

Python runs signal handlers in the main thread, between two of its bytecodes,
and only the main thread may set one: a ``run()`` elsewhere registers nothing.
The handler takes no lock (the main thread may hold it when the signal comes):
:func:`register` and :func:`unregister` replace the tuple of services whole,
under the lock, and the handler reads whichever tuple is current.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Protocol

#: The signals that stop a service.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Signalled(Protocol):
    def _on_signal(self, signum: int) -> None:
        """Note the signal (plain assignments only: it runs in the handler)."""


_lock = threading.Lock()
_services: tuple[Signalled, ...] = ()
_previous: dict[int, Any] = {}  # the handlers replaced, to put back


def _handler(signum: int, frame: FrameType | None) -> None:
    for service in _services:
        service._on_signal(signum)


def register(service: Signalled) -> bool:
    """Have SIGTERM and SIGINT flag ``service`` until :func:`unregister`, installing
    the handler if it is the first. In the main thread only: elsewhere nothing
    is registered, and False is returned."""
    global _services
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        first = not _services
        _services = (*_services, service)  # before the handler: a signal finds it
        if first:
            for signum in SIGNALS:
                _previous[signum] = signal.signal(signum, _handler)
    return True


def unregister(service: Signalled) -> None:
    """Signals no longer flag ``service``; the last one to leave puts the original
    handlers back."""
    global _services
    with _lock:
        rest = tuple(s for s in _services if s is not service)
        if _services and not rest:
            # Before the tuple empties: a signal meanwhile still stops someone.
            for signum, previous in _previous.items():
                signal.signal(signum, previous)
            _previous.clear()
        _services = rest
