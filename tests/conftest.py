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
