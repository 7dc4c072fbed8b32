"""Handlers for the ``pgque worker`` tests in test_cli.py (imported by module path).

``record`` writes each event it handles into table ``cli_handled`` (created by
the test) of the database named by ``PGQUE_DSN``, with the handling process's
pid, on one connection per worker thread. The other names exist to be
refused: ``NOT_CALLABLE`` is not a function.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg

import pgque

NOT_CALLABLE = 42

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
