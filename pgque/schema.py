"""The engine's install script: assembled from ``sql/*.sql`` and run in one transaction.

The SQL files are the source of truth. In a wheel they are shipped as
``pgque/sql``; in a source checkout they are read from the repository's ``sql/``
folder. Installing is idempotent: running it again changes nothing.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["install", "install_script", "uninstall"]

# The first statement of the install transaction, also at the top of the script:
# every name the install resolves comes from pg_catalog, never from a schema
# another role can create in (public on PostgreSQL 14), and temporary objects
# cannot shadow anything.
PIN_SEARCH_PATH = "set local search_path = pg_catalog, pg_temp"

# Serializes concurrent installers (several workers starting at once would
# otherwise race on CREATE OR REPLACE FUNCTION, which rewrites pg_proc rows).
_INSTALL_LOCK = 0x7067_7169  # 'pgqi'


def _sql_files() -> list[tuple[str, str]]:
    packaged = resources.files("pgque").joinpath("sql")
    if packaged.is_dir():
        entries = [(p.name, p.read_text("utf-8")) for p in packaged.iterdir()]
    else:
        source = Path(__file__).resolve().parent.parent / "sql"
        entries = [(p.name, p.read_text("utf-8")) for p in source.iterdir()]
    return sorted((name, text) for name, text in entries if name.endswith(".sql"))


def install_script() -> str:
    """Return the whole install script: every ``sql/*.sql`` file in name order.

    Run it in one transaction (``psql -1 -f``): its first statement pins
    ``search_path`` for that transaction only.
    """
    parts = [f"-- ===== {name} =====\n{text}" for name, text in _sql_files()]
    return "\n".join([f"{PIN_SEARCH_PATH};\n", *parts])


def install(conn: psycopg.Connection[Any]) -> None:
    """Install or upgrade the pgque engine in the connected database, in one transaction.

    Works for a non-superuser that owns the database (roles it may not create
    are skipped with a notice). Safe to run concurrently and repeatedly.
    """
    script = install_script()
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(PIN_SEARCH_PATH)
        cur.execute("select pg_catalog.pg_advisory_xact_lock(%s::bigint)", (_INSTALL_LOCK,))
        cur.execute(script.encode())


def uninstall(conn: psycopg.Connection[Any]) -> None:
    """Drop schema pgque with every queue, event and cursor in it. Roles are kept."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(PIN_SEARCH_PATH)
        cur.execute("select pg_catalog.pg_advisory_xact_lock(%s::bigint)", (_INSTALL_LOCK,))
        cur.execute("drop schema if exists pgque cascade")
