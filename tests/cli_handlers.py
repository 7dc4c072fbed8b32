"""Handlers for the ``pgque worker`` tests in test_cli.py and test_cli_worker.py
(imported by module path).

``record`` writes each event it handles into table ``cli_handled`` (created by
the test) of the database named by ``PGQUE_DSN``, with the handling process's
pid, on one connection per worker thread. ``apply`` is a transactional
handler, ``record_span`` an async one decoding into ``Job`` (see their
docstrings). The other names exist to be refused: ``NOT_CALLABLE`` is not a
function, ``NOT_A_TYPE`` no payload type.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import msgspec
import psycopg

import pgque

NOT_CALLABLE = 42
NOT_A_TYPE = object()

_local = threading.local()


def _connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["PGQUE_DSN"], autocommit=True)
        _local.conn = conn
    return conn


def record(message: pgque.Message[Any]) -> None:
    """Record the event; a redelivery (at least once) leaves the first row as it is."""
    _connection().execute(
        "insert into cli_handled (ev_id, type, key, payload, pid) "
        "values (%s, %s, %s, %s::jsonb, %s) on conflict (ev_id) do nothing",
        (message.id, message.type, message.partition_key, message.data, os.getpid()))


def apply(message: pgque.Message[Any], conn: psycopg.Connection[Any]) -> None:
    """Transactional: log the attempt on a connection of its own (it stays, with the
    worker transaction's start, now()), write the effect on the worker's ``conn`` (it
    commits with the ack), and fail the first attempt of an event whose payload has
    "fail", after writing: that effect must roll back."""
    row = conn.execute("select now()").fetchone()
    assert row is not None
    _connection().execute(
        "insert into cli_attempts (ev_id, retry_count, tx_now, at) "
        "values (%s, %s, %s, clock_timestamp())", (message.id, message.retry_count, row[0]))
    conn.execute("insert into cli_effects (ev_id, retry_count, pid, app) "
                 "values (%s, %s, pg_backend_pid(), current_setting('application_name'))",
                 (message.id, message.retry_count))
    if message.payload.get("fail") and message.retry_count == 0:
        raise RuntimeError("the first attempt fails")


class Job(msgspec.Struct):
    """The payload of the async handler's events."""

    n: int


_async_conn: psycopg.AsyncConnection[Any] | None = None
_async_lock: asyncio.Lock | None = None


async def record_span(message: pgque.Message[Job]) -> None:
    """Async: record when handling the event started and finished (database clock,
    table ``cli_spans``), taking 0.3 s in between, so that handlers running at the
    same time overlap; ``n`` is the payload's, decoded into Job."""
    global _async_conn, _async_lock
    if _async_lock is None:
        _async_lock = asyncio.Lock()
    async with _async_lock:  # the lanes' tasks share one connection
        if _async_conn is None:
            _async_conn = await psycopg.AsyncConnection.connect(os.environ["PGQUE_DSN"],
                                                                autocommit=True)
    assert isinstance(message.payload, Job)
    await _async_conn.execute(
        "insert into cli_spans (ev_id, key, n, started) values (%s, %s, %s, clock_timestamp())",
        (message.id, message.partition_key, message.payload.n))
    await asyncio.sleep(0.3)
    await _async_conn.execute("update cli_spans set finished = clock_timestamp() "
                              "where ev_id = %s", (message.id,))


class Refused(Exception):
    """A failure that retrying cannot heal (for --non-retryable)."""
