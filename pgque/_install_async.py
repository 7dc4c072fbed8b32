# The source of pgque/_install.py, which tools/async_to_sync.py generates  # async-only
# from this file (`make twins`): edit this one, then regenerate.  # async-only
"""Installing, upgrading and uninstalling the engine over a psycopg AsyncConnection:
the I/O of :mod:`pgque.schema`, which builds the install script.

``pgque.install(conn)`` and ``pgque.uninstall(conn)`` (:mod:`pgque.schema`)
document the contract; the clients' ``install`` and ``uninstall`` call these.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import AsyncConnection

from pgque.schema import PIN_SEARCH_PATH, install_script

# Concurrent installers serialize on the row of pgque.install_lock, which the
# guard takes before it writes any catalog row. Into an empty database (or one
# whose install predates that table) they may still race on CREATE SCHEMA or
# CREATE TABLE: the losers fail with a unique violation once the winner
# commits. An install that waited behind an uninstall finds the table it waited
# for, or the schema, gone. Either way the failing statement rolled the
# transaction back, and it runs again: it then finds the schema (or its
# absence) as it now is. A few attempts are plenty.
_INSTALL_ATTEMPTS = 5
_RETRIED = (psycopg.errors.UniqueViolation, psycopg.errors.UndefinedTable,
            psycopg.errors.InvalidSchemaName)


async def install(conn: AsyncConnection[Any]) -> str | None:
    """Install or upgrade pgque in one transaction; the version installed before."""
    script = install_script().encode()
    for attempt in range(1, _INSTALL_ATTEMPTS + 1):
        try:
            async with conn.transaction(), conn.cursor() as cur:
                await cur.execute(PIN_SEARCH_PATH)
                await cur.execute(script)
                # Set by the guard, after it checked who owns schema pgque.
                await cur.execute("select pg_catalog.current_setting('pgque.installed_before')")
                row = await cur.fetchone()
            return (row[0] if row else "") or None
        except _RETRIED:
            if attempt == _INSTALL_ATTEMPTS:
                raise
    return None  # not reached


async def uninstall(conn: AsyncConnection[Any]) -> None:
    """Drop schema pgque, after the installs in progress (see pgque.schema.uninstall)."""
    async with conn.transaction(), conn.cursor() as cur:
        await cur.execute(PIN_SEARCH_PATH)
        await cur.execute("""
            do $uninstall$
            begin
                if to_regclass('pgque.install_lock') is not null then
                    lock table pgque.install_lock in access exclusive mode;
                end if;
            exception when undefined_table then
                null;  -- another uninstall dropped it while this one waited
            end
            $uninstall$""")
        await cur.execute("drop schema if exists pgque cascade")
