"""Fixtures: one PostgreSQL server per run, a fresh database per test.

How the server is chosen is described in ``tests/pgtest.py``. Fixtures:

- ``pg_server`` (session): the :class:`pgtest.PgServer`;
- ``restartable_server``: the same, or a skip when it cannot be restarted;
- ``template_db`` (session): name of a template database with pgque installed;
- ``dsn``: a fresh database cloned from the template, dropped after the test;
- ``empty_dsn``: a fresh database without pgque (from template0);
- ``conn``: an autocommit connection to ``dsn``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pgtest
import psycopg
import pytest
from hypothesis import HealthCheck, settings

import pgque

settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,  # database round trips make timings too noisy for deadlines
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)

# The run's server, started on first need: by the report header, or by the first
# test that asks for it. Shared through these globals because the header hook
# runs before any fixture exists.
_server: pgtest.PgServer | None = None
_server_error: str | None = None
_announced = False


def _get_server() -> pgtest.PgServer:
    global _server, _server_error
    if _server is None:
        if _server_error is not None:  # don't retry a failed start for every test
            raise RuntimeError(_server_error)
        try:
            _server = pgtest.open_server()
        except Exception as exc:
            _server_error = f"no test server: {exc}"
            raise
    return _server


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Start the server now, to name it in the header (not shown with -q)."""
    global _announced
    if config.option.collectonly:
        return []
    try:
        server = _get_server()
    except Exception as exc:
        return [f"pgque test server: failed to start: {str(exc).splitlines()[0]}"]
    _announced = True
    return [f"pgque test server: {server.description}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the server at the end when the header was not shown (-q, --no-header)."""
    if _server is not None and not _announced:
        terminalreporter.write_line(f"pgque test server: {_server.description}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the server if this run started one."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


@pytest.fixture(scope="session")
def pg_server() -> pgtest.PgServer:
    """The run's server: ``.dsn(dbname)``, ``.major_version``, ``.restartable``, ``.restart()``."""
    return _get_server()


@pytest.fixture
def restartable_server(pg_server: pgtest.PgServer) -> pgtest.PgServer:
    """``pg_server``, or skip the test when it cannot be restarted (external, container)."""
    if not pg_server.restartable:
        pytest.skip(f"cannot restart {pg_server.description}")
    return pg_server


@pytest.fixture(scope="session")
def template_db(pg_server: pgtest.PgServer) -> Iterator[str]:
    """Name of the template database with pgque installed (created once per run)."""
    name = pgtest.create_template(pg_server)
    yield name
    pgtest.drop_database(pg_server, name)


@pytest.fixture
def dsn(pg_server: pgtest.PgServer, template_db: str) -> Iterator[str]:
    """DSN of a fresh database with pgque installed, dropped after the test."""
    name = pgtest.scratch_name("t")
    pgtest.create_database(pg_server, name, template=template_db)
    yield pg_server.dsn(name)
    pgtest.drop_database(pg_server, name)


@pytest.fixture
def empty_dsn(pg_server: pgtest.PgServer) -> Iterator[str]:
    """DSN of a fresh database without pgque, dropped after the test."""
    name = pgtest.scratch_name("e")
    pgtest.create_database(pg_server, name, template="template0")
    yield pg_server.dsn(name)
    pgtest.drop_database(pg_server, name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to ``dsn``, closed after the test."""
    connection = psycopg.connect(dsn, autocommit=True)
    try:
        yield connection
    finally:
        connection.close()


@pytest.fixture
def client(dsn: str) -> Iterator[pgque.Client]:
    """A pgque client connected to ``dsn`` (autocommit), closed after the test."""
    with pgque.connect(dsn) as c:
        yield c


def _pgbouncer(server: pgtest.PgServer, pool_mode: str, pool_size: int) -> Iterator[Any]:
    from pgbouncer import PgBouncer, PgBouncerUnavailable

    bouncer = PgBouncer(server.dsn(), pool_mode=pool_mode, pool_size=pool_size)  # type: ignore[arg-type]
    try:
        bouncer.start()
    except PgBouncerUnavailable as exc:
        pytest.skip(f"no pgbouncer: {exc}")
    try:
        yield bouncer
    finally:
        bouncer.close()


@pytest.fixture(scope="session")
def pgbouncer(pg_server: pgtest.PgServer) -> Iterator[Any]:
    """A transaction-mode PgBouncer (2 server connections per database) in front of
    the test server: ``.dsn(dbname)``. Skips where pgbouncer cannot run (tests/pgbouncer.py)."""
    yield from _pgbouncer(pg_server, "transaction", 2)


@pytest.fixture(scope="session")
def pgbouncer_session(pg_server: pgtest.PgServer) -> Iterator[Any]:
    """The same in session mode, with room for 40 server connections per database."""
    yield from _pgbouncer(pg_server, "session", 40)


@pytest.fixture(scope="session")
def netns_server(pg_server: pgtest.PgServer) -> Iterator[Any]:
    """A network namespace on veth links and a PostgreSQL (the run's binaries)
    listening on them, with pgque's template: a ``netns.LinkServer`` whose
    ``.link`` (``netns.NetnsLink``) can ``blackhole()``/``heal()``/``cut()`` and
    ``popen()`` processes inside. Skips where that cannot work (tests/netns.py)."""
    import netns

    reason = netns.unavailable()
    if reason:
        pytest.skip(f"no network namespace: {reason}")
    bindir = getattr(getattr(pg_server, "postgres", None), "bindir", None)
    with netns.NetnsLink() as link, netns.LinkServer(
            link, bindir=bindir, tmpdir=pgtest.cluster_tmpdir()) as server:
        pgtest.create_template(server)
        yield server


@pytest.fixture
def netns_dsn(netns_server: Any) -> Iterator[str]:
    """127.0.0.1 DSN of a fresh pgque database on ``netns_server`` (it works inside
    the namespace too, over the link that is never cut); ``netns_server.link.dsn(it)``
    is its twin over the link that blackhole() cuts. Heals and kills what the test
    started in the namespace afterwards."""
    name = pgtest.scratch_name("n")
    pgtest.create_database(netns_server, name, template=pgtest.TEMPLATE_DB)
    try:
        yield netns_server.dsn(name)
    finally:
        netns_server.link.stop()
        pgtest.drop_database(netns_server, name)
