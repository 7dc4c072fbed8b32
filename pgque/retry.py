"""When a failed event comes back, and which failures not to retry at all.

A Worker's ``retry_after`` says how long a failed event waits before it is
handed out again: a fixed delay, a :class:`Backoff` that grows with the
event's retry count (under the pause policy, the failures of its key's head),
or a mapping from exception class to either, so that a timeout is retried
soon and a rate limit later. A handler that knows retrying cannot help (a
payload that will never parse) raises :class:`NonRetryable`, or an exception
of a class given as the Worker's ``non_retryable``: its event goes to the dead
letters at once, and under the pause policy its key moves on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["Backoff", "NonRetryable", "RetryDelay", "delay_for"]


class NonRetryable(Exception):
    """Raised by a handler whose event must not be retried: the Worker sends it
    to the dead letters at once (the exception's text is the reason)."""


@dataclass(frozen=True)
class Backoff:
    """An exponential backoff: the n-th retry (n = the event's retry count, from
    0) waits ``initial * factor ** n`` seconds, at most ``maximum``, spread by
    up to ``jitter`` of itself either way so that keys that failed together do
    not come back together. ``Backoff(5, factor=1)`` is a fixed 5 s."""

    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 300.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.initial < 0 or self.factor < 1 or self.maximum < self.initial:
            raise ValueError("Backoff needs 0 <= initial <= maximum and factor >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("Backoff's jitter is a share: at least 0, below 1")

    def __call__(self, retry_count: int) -> float:
        """The delay in seconds before retry number ``retry_count`` + 1."""
        # The exponent is capped so that a large retry count cannot overflow.
        base = min(self.maximum, self.initial * self.factor ** min(retry_count, 64))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


#: What a Worker's ``retry_after`` may be.
RetryDelay = (float | timedelta | Backoff
              | Mapping[type[BaseException], "float | timedelta | Backoff"])


def delay_for(retry_after: RetryDelay, retry_count: int, exc: BaseException) -> float:
    """The seconds a failed event waits, by ``retry_after``: for a mapping, the
    first entry whose exception class ``exc`` is an instance of (none: 5 s, the
    Worker's default)."""
    if isinstance(retry_after, Mapping):
        chosen: float | timedelta | Backoff = next(
            (delay for kind, delay in retry_after.items() if isinstance(exc, kind)), 5.0)
    else:
        chosen = retry_after
    if isinstance(chosen, Backoff):
        return chosen(retry_count)
    return chosen.total_seconds() if isinstance(chosen, timedelta) else float(chosen)


def check_retry_after(retry_after: RetryDelay) -> None:
    """ValueError for a negative delay anywhere in ``retry_after``."""
    delays = list(retry_after.values()) if isinstance(retry_after, Mapping) else [retry_after]
    for delay in delays:
        if isinstance(delay, Backoff):
            continue  # checked when made
        if (delay.total_seconds() if isinstance(delay, timedelta) else delay) < 0:
            raise ValueError("retry_after must not be negative")
