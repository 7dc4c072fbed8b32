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

# Concurrent installers serialize on the row of pgque.install_lock, which the
# script takes before it writes any catalog row (see sql/00_schema.sql). Into
# an empty database (or one whose install predates that table) they may still
# race on CREATE SCHEMA or CREATE TABLE: the losers fail with a unique
# violation once the winner commits. An install that waited behind an
# uninstall finds the table it waited for, or the schema, gone. Either way the
# failing statement rolled the transaction back, and it runs again: it then
# finds the schema (or its absence) as it now is. A few attempts are plenty.
_INSTALL_ATTEMPTS = 5
_RETRIED = (psycopg.errors.UniqueViolation, psycopg.errors.UndefinedTable,
            psycopg.errors.InvalidSchemaName)


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
    script = install_script().encode()
    for attempt in range(1, _INSTALL_ATTEMPTS + 1):
        try:
            with conn.transaction(), conn.cursor() as cur:
                cur.execute(PIN_SEARCH_PATH)
                cur.execute(script)
            return
        except _RETRIED:
            if attempt == _INSTALL_ATTEMPTS:
                raise


def uninstall(conn: psycopg.Connection[Any]) -> None:
    """Drop schema pgque with every queue, event and cursor in it. Roles are kept.

    Waits for installs in progress, and installs that start meanwhile wait for
    it: it locks pgque.install_lock exclusively before it drops anything.
    """
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(PIN_SEARCH_PATH)
        cur.execute("""
            do $uninstall$
            begin
                if to_regclass('pgque.install_lock') is not null then
                    lock table pgque.install_lock in access exclusive mode;
                end if;
            exception when undefined_table then
                null;  -- another uninstall dropped it while this one waited
            end
            $uninstall$""")
        cur.execute("drop schema if exists pgque cascade")
