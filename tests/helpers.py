"""Small helpers shared by the tests (no fixtures here; see conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pgque

T = TypeVar("T")


def drain(client: pgque.Client, queue: str, consumer: str, *,
          max_events: int | None = None, tick: bool = True) -> list[pgque.Message[Any]]:
    """Receive and ack until no batch is ready; returns the messages in order.

    With tick, forces a tick first, so everything committed before the call is
    delivered by the time it returns.
    """
    if tick:
        client.tick(queue)
    received: list[pgque.Message[Any]] = []
    while (batch := client.receive(queue, consumer, max_events=max_events)) is not None:
        received.extend(batch.messages)
        client.ack(batch)
    return received


def wait_for(probe: Callable[[], T | None], *, timeout: float = 10.0,
             interval: float = 0.02, what: str = "condition") -> T:
    """Poll probe until it returns something truthy, or fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scalar(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first column of the first row of a query."""
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]
