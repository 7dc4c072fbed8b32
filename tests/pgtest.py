"""The suite's PostgreSQL, from pgque.testing (which chooses the server: see
``pgque.testing.open_server`` and docs/testing.md), plus what only this suite needs:

- a throwaway cluster preloads pg_cron when its binaries have it, for the cron
  tests, which run in database :data:`CRON_DB` (pg_cron serves one database);
- the helpers older tests call as functions of a server.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from pathlib import Path
from typing import Any

import psycopg

from pgque.testing import (
    ContainerServer,
    ExternalServer,
    LocalServer,
    PgServer,
    cluster_tmpdir,
)
from pgque.testing._server import scratch_name

__all__ = [
    "CRON_DB",
    "INSTALLER",
    "TEMPLATE_DB",
    "ContainerServer",
    "ExternalServer",
    "LocalServer",
    "PgServer",
    "admin",
    "cluster_tmpdir",
    "create_database",
    "create_installer_template",
    "create_template",
    "drop_database",
    "has_pg_cron",
    "scratch_databases",
    "scratch_name",
    "server_settings",
]

CRON_DB = "pgque_cron"
#: The template create_template makes on a server of the suite's own (netns).
TEMPLATE_DB = "pgque_template"


def has_pg_cron(bindir: Path) -> bool:
    """Whether the PostgreSQL build in ``bindir`` has the pg_cron extension installed."""
    pg_config = bindir / "pg_config"
    if not pg_config.exists():
        return False
    try:
        libdir = subprocess.run([str(pg_config), "--pkglibdir"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return (Path(libdir) / "pg_cron.so").exists()


def server_settings(bindir: Path) -> dict[str, str]:
    """postgresql.conf settings of the suite's throwaway cluster of ``bindir``."""
    if not has_pg_cron(bindir):
        return {}
    return {"shared_preload_libraries": "pg_cron", "cron.database_name": CRON_DB}


def admin(server: PgServer) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
    """An autocommit superuser connection to the ``postgres`` database."""
    return server.admin()


def create_database(server: PgServer, name: str, template: str = "template0") -> None:
    """``create database name template template``."""
    server.create_database(name, template=template)


def drop_database(server: PgServer, name: str) -> None:
    """Drop ``name`` if it exists, a template too, disconnecting whoever is in it."""
    server.drop_database(name)


#: The login role that installs pgque in the suite's templates: the owner of the
#: database and nothing more, as docs/operations.md recommends. Every pgque
#: function is SECURITY DEFINER, so it runs as this role whoever calls it: a
#: superuser installer would hide what such an owner may not do (read other
#: sessions' statistics, say).
INSTALLER = "pgque_suite_installer"


def create_installer_template(server: PgServer, name: str | None = None,
                              setup: Any = None) -> str:
    """A template with pgque installed by :data:`INSTALLER` (made, or given a new
    password, here; the pgque roles too, which only a superuser may make)."""
    password = secrets.token_hex(12)
    with server.admin() as conn:
        for role in ("pgque_reader", "pgque_writer", "pgque_admin"):
            if not conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone():
                conn.execute(f"create role {role} nologin")
        if conn.execute("select 1 from pg_roles where rolname = %s", (INSTALLER,)).fetchone():
            conn.execute(f"alter role {INSTALLER} password '{password}'")
        else:
            conn.execute(f"create role {INSTALLER} login nosuperuser nocreaterole nocreatedb"
                         f" password '{password}'")
    return server.create_template(name, setup=setup, installer=INSTALLER,
                                  installer_password=password)


def create_template(server: PgServer) -> str:
    """(Re)create :data:`TEMPLATE_DB` with pgque installed by :data:`INSTALLER`;
    return its name."""
    return create_installer_template(server, TEMPLATE_DB)


def scratch_databases(server: PgServer) -> set[str]:
    """The databases on ``server`` that pgque.testing named (for leak checks)."""
    with server.admin() as conn:
        rows = conn.execute("select datname from pg_database"
                            " where datname ~ '^pgque_(test|template)_'").fetchall()
    return {name for (name,) in rows}
