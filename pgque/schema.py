"""The engine's install script, and installing, upgrading and uninstalling it.

The SQL lives in this package, in three parts run in this order, in one
transaction:

``sql/guard.sql``
    Who may install (the schema's owner), one installer at a time, the roles,
    and the table of applied migrations.
``sql/migrations/NNNN_name.sql``
    The tables and their data, changed forward only: each migration runs once
    per database, in number order, and is recorded in ``pgque.migration``.
    A 0.1.0 install predates that table, so it gets every migration: the
    first creates only what is missing, since the two commits that called
    themselves 0.1.0 made different tables (see guard.sql). A 0.1.0 that the
    landed 0.2.0 upgraded has the first recorded without having had it, and
    gets it again.
``sql/manifest.txt``
    The order of everything else: ``sql/install/`` (steps of the install:
    dropping the old code, writing the generated code, grants) around
    ``sql/code/<layer>/*.sql``, everything stateless (functions, procedures,
    views, types), by topic. The code is dropped and created again on every
    run, so an upgraded database has exactly a fresh install's code.

So one script installs into an empty database, upgrades an older install in
place, and changes nothing when run again; it refuses (PQ018) a database that
a newer pgque has migrated.
"""

from __future__ import annotations

from typing import Any

import psycopg

from pgque import _install
from pgque._script import Migration, install_script, migrations

__all__ = ["Migration", "install", "install_script", "migrations", "uninstall"]


def install(conn: psycopg.Connection[Any]) -> str | None:
    """Install pgque in the connected database, or upgrade it, in one transaction.

    Returns the version that was installed before (None for a fresh install).
    Works for a non-superuser that owns the database (roles it may not create
    are skipped with a notice). Safe to run concurrently and repeatedly.
    """
    # The I/O is in pgque/_install.py, generated from pgque/_install_async.py
    # (as the sync client is from the async one).
    return _install.install(conn)


def uninstall(conn: psycopg.Connection[Any]) -> None:
    """Drop schema pgque with every queue, event and cursor in it. Roles are kept.

    Waits for installs in progress, and installs that start meanwhile wait for
    it: it locks pgque.install_lock exclusively before it drops anything.
    """
    _install.uninstall(conn)
