"""The suite's PostgreSQL, from pgque.testing (which chooses the server: see
``pgque.testing.open_server`` and docs/testing.md), plus what only this suite needs:

- a throwaway cluster preloads pg_cron when its binaries have it, for the cron
  tests, which run in database :data:`CRON_DB` (pg_cron serves one database);
- the helpers older tests call as functions of a server.
"""

from __future__ import annotations

import contextlib
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
    "TEMPLATE_DB",
    "ContainerServer",
    "ExternalServer",
    "LocalServer",
    "PgServer",
    "admin",
    "cluster_tmpdir",
    "create_database",
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


def create_template(server: PgServer) -> str:
    """(Re)create :data:`TEMPLATE_DB` with pgque installed; return its name."""
    return server.create_template(TEMPLATE_DB)


def scratch_databases(server: PgServer) -> set[str]:
    """The databases on ``server`` that pgque.testing named (for leak checks)."""
    with server.admin() as conn:
        rows = conn.execute("select datname from pg_database"
                            " where datname ~ '^pgque_(test|template)_'").fetchall()
    return {name for (name,) in rows}
