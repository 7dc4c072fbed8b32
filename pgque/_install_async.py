# The source of pgque/_install.py, which tools/async_to_sync.py generates  # async-only
# from this file (`make twins`): edit this one, then regenerate.  # async-only
"""Installing, upgrading and uninstalling the engine over a psycopg AsyncConnection:
the I/O of :mod:`pgque.schema`, over the script :mod:`pgque._script` builds.

``pgque.install(conn)`` and ``pgque.uninstall(conn)`` (:mod:`pgque.schema`)
document the contract; the clients' ``install`` and ``uninstall`` call these.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import psycopg
from psycopg import AsyncConnection

from pgque._script import PIN_SEARCH_PATH, install_script

# Concurrent installers serialize on the row of pgque.install_lock, which the
# guard takes before it writes any catalog row. Into an empty database (or one
# whose install predates that table) they may still race on CREATE SCHEMA or
# CREATE TABLE: the losers fail with a unique violation once the winner
# commits. An install that waited behind an uninstall finds the table it waited
# for, or the schema, gone. Either way the failing statement rolled the
# transaction back, and it runs again: it then finds the schema (or its
# absence) as it now is. An upgrade that the server picked as a deadlock's
# victim (a migration locks tables live workers read; it tries not to wait
# while holding one, see migration 7) runs again the same way. A few attempts
# are plenty.
_INSTALL_ATTEMPTS = 5
_RETRIED = (psycopg.errors.UniqueViolation, psycopg.errors.UndefinedTable,
            psycopg.errors.InvalidSchemaName, psycopg.errors.DeadlockDetected)


# pgque's roles that may use schema pgque. Every install drops and creates
# pgque's functions and views, their grants with them; the schema's USAGE is
# the one grant that lasts from one install to the next. So a role that lacks
# it before an install and has it after is one the install granted pgque's
# privileges to: one created since the last install (by a superuser, where the
# installer may not create roles), or whose grant was revoked. Read before the
# guard takes the install lock: an installer that waited for another's grants
# reports them too.
_ROLES_WITH_USAGE = """
    select r.rolname::text
      from pg_catalog.pg_roles r
     where r.rolname in ('pgque_reader', 'pgque_writer', 'pgque_admin')
       and exists (select from pg_catalog.pg_namespace n, pg_catalog.aclexplode(n.nspacl) a
                    where n.nspname = 'pgque' and a.grantee = r.oid
                      and a.privilege_type = 'USAGE')
     order by 1"""


class Installed(NamedTuple):
    """What one install did."""

    before: str | None
    """The version installed before (None: pgque was not installed)."""
    granted: tuple[str, ...]
    """pgque's roles that got their grants in this install, having had none
    (every role of a first install)."""


async def install_report(conn: AsyncConnection[Any]) -> Installed:
    """Install or upgrade pgque in one transaction; the version installed before,
    and the roles it granted pgque's privileges to that had none."""
    script = install_script().encode()
    for attempt in range(1, _INSTALL_ATTEMPTS + 1):
        try:
            async with conn.transaction(), conn.cursor() as cur:
                await cur.execute(PIN_SEARCH_PATH)
                await cur.execute(_ROLES_WITH_USAGE)
                had_usage = {row[0] for row in await cur.fetchall()}
                await cur.execute(script)
                # Set by the guard, after it checked who owns schema pgque.
                await cur.execute("select pg_catalog.current_setting('pgque.installed_before')")
                row = await cur.fetchone()
                await cur.execute(_ROLES_WITH_USAGE)
                granted = tuple(r[0] for r in await cur.fetchall() if r[0] not in had_usage)
            return Installed((row[0] if row else "") or None, granted)
        except _RETRIED:
            if attempt == _INSTALL_ATTEMPTS:
                raise
    raise AssertionError("not reached")


async def install(conn: AsyncConnection[Any]) -> str | None:
    """Install or upgrade pgque in one transaction; the version installed before."""
    report = await install_report(conn)
    return report.before


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
