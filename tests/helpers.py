"""Small helpers shared by the tests (no fixtures here; see conftest.py)."""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import pytest

import pgque

T = TypeVar("T")

#: Whether the long variants run: ``PGQUE_TEST_LONG=1`` (``make test-long``).
LONG = os.environ.get("PGQUE_TEST_LONG") == "1"


def long_variant(*values: Any, id: str | None = None) -> Any:
    """A parameter set of a test's long form (bigger, or waiting longer), marked
    ``long``: it runs only with PGQUE_TEST_LONG=1 (``make test-long``), while the
    test's short form runs in every ``make test``. (The fault suite has its own,
    test_faults.long_variant.)"""
    return pytest.param(*values, id=id, marks=[
        pytest.mark.long,
        pytest.mark.skipif(not LONG, reason="long variant: PGQUE_TEST_LONG=1 (make test-long)")])


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


def dump_state(dsn: str | None = None) -> None:
    """Print every thread's stack and, given a DSN, what the server's sessions are
    doing: called when a test times out, so a hang can be diagnosed from the log."""
    faulthandler.dump_traceback(all_threads=True)
    if dsn is None:
        return
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            for row in conn.execute(
                    "select pid, application_name, state, wait_event_type, wait_event, "
                    "left(query, 120) from pg_stat_activity where datname = current_database()"):
                print("session:", row, flush=True)
            for view in ("queue_info", "consumer_info", "partition_slot_status"):
                for row in conn.execute(f"select * from pgque.{view}"):
                    print(f"{view}:", row, flush=True)
            for row in conn.execute("select tick_queue, tick_id, tick_time, tick_snapshot, "
                                    "tick_event_seq from pgque.tick order by tick_id desc "
                                    "limit 5"):
                print("tick:", row, flush=True)
    except Exception as exc:
        print("could not read pg_stat_activity:", exc, flush=True)


def wait_for(probe: Callable[[], T | None], *, timeout: float = 10.0,
             interval: float = 0.02, what: str = "condition", dsn: str | None = None) -> T:
    """Poll probe until it returns something truthy, or fail after timeout seconds
    (dumping threads, and sessions when ``dsn`` is given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            dump_state(dsn)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scalar(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first column of the first row of a query."""
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def backends(conn: psycopg.Connection[Any]) -> int:
    """Client sessions on this database other than ``conn``'s own. An autovacuum
    worker is listed with the database's name too, and comes and goes on its own."""
    return int(scalar(conn, "select count(*) from pg_stat_activity"
                            " where datname = current_database() and pid <> pg_backend_pid()"
                            " and backend_type = 'client backend'"))


def refused(call: Callable[[], Any],
            error: type[Exception] = psycopg.errors.InsufficientPrivilege) -> bool:
    """Whether call raises error, or, for a raw psycopg call, the server error with
    error's SQLSTATE (pgque's classes carry theirs)."""
    try:
        call()
    except error:
        return True
    except psycopg.Error as exc:
        if exc.sqlstate is not None and exc.sqlstate == getattr(error, "sqlstate", None):
            return True
        raise
    return False


def owned_group(client: pgque.Client, per_tick: int, *, ticks: int = 1, slots: int = 4,
                **queue: Any) -> dict[int, list[int]]:
    """Queue q (``queue`` its create_queue options) with group g of ``slots`` slots,
    all claimed by ``client``, and ``ticks`` ticks of ``per_tick`` events over 30
    keys; returns each slot's event ids in send order."""
    client.create_queue("q", **queue)
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    n = 0
    for _ in range(ticks):
        rows = [("e", {"n": n + i}, f"k{(n + i) % 30}") for i in range(per_tick)]
        for (_type, _payload, key), ev in zip(rows, client.send_batch("q", rows), strict=True):
            by_slot[scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, slots))].append(ev)
        n += per_tick
        client.tick("q")
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    return by_slot
