"""The pytest plugin of pgque.testing: hooks and fixtures (loaded as ``pgque.testing``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import pgque
from pgque.testing._deployment import Deployment
from pgque.testing._server import PgServer, ServerSettings, TemplateSetup, open_server

__all__ = [
    "pgque_client",
    "pgque_deployment",
    "pgque_deployment_template",
    "pgque_dsn",
    "pgque_server",
    "pgque_server_settings",
    "pgque_template",
    "pgque_template_setup",
    "pytest_report_header",
    "pytest_terminal_summary",
    "pytest_unconfigure",
    "session_server",
]


@dataclass
class _Run:
    """The server of one pytest run, started on first need."""

    server: PgServer | None = None
    error: str | None = None  # why it failed to start: not tried again for every test
    announced: bool = False  # named in the report header already


_RUN = pytest.StashKey[_Run]()


def _run(config: pytest.Config) -> _Run:
    return config.stash.setdefault(_RUN, _Run())


def session_server(config: pytest.Config, *, settings: ServerSettings = None) -> PgServer:
    """The run's server (what fixture ``pgque_server`` gives), started by
    :func:`~pgque.testing.open_server` on the first call, with ``settings``; for
    hooks, which run before any fixture. It is stopped when pytest ends."""
    run = _run(config)
    if run.server is None:
        if run.error is not None:
            raise RuntimeError(run.error)
        try:
            run.server = open_server(settings=settings)
        except Exception as exc:
            run.error = f"no pgque test server: {type(exc).__name__}: {exc}"
            raise RuntimeError(run.error) from exc
    return run.server


@pytest.hookimpl(trylast=True)
def pytest_report_header(config: pytest.Config) -> list[str]:
    """Name the server in the header when something started it already (the plugin
    itself starts it for the first test that needs it)."""
    run = _run(config)
    if run.server is None:
        return []
    run.announced = True
    return [f"pgque test server: {run.server.description}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    """Name the server at the end, unless the header did."""
    run = _run(config)
    if run.server is not None and not run.announced:
        terminalreporter.write_line(f"pgque test server: {run.server.description}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the server, if this run started one."""
    run = _run(config)
    if run.server is not None:
        server, run.server = run.server, None
        server.close()


@pytest.fixture(scope="session")
def pgque_server_settings() -> ServerSettings:
    """postgresql.conf settings for a throwaway cluster the plugin starts: a
    mapping, or a function of the binaries' ``bin`` directory that returns one.
    None; override it in your conftest.py."""
    return None


@pytest.fixture(scope="session")
def pgque_server(request: pytest.FixtureRequest,
                 pgque_server_settings: ServerSettings) -> PgServer:
    """The run's PostgreSQL server (a :class:`~pgque.testing.PgServer`), chosen by
    :func:`~pgque.testing.open_server`: started for the first test that needs
    it, stopped at the end of the run."""
    return session_server(request.config, settings=pgque_server_settings)


@pytest.fixture(scope="session")
def pgque_template_setup() -> TemplateSetup | None:
    """What to add to the template after pgque is installed: a function called
    with an autocommit connection to it. None; override it in your conftest.py
    to give every test's database your tables."""
    return None


@pytest.fixture(scope="session")
def pgque_template(pgque_server: PgServer,
                   pgque_template_setup: TemplateSetup | None) -> Iterator[str]:
    """The name of the run's template database: pgque installed, then
    ``pgque_template_setup``. Made once per run, dropped at its end."""
    name = pgque_server.create_template(setup=pgque_template_setup)
    yield name
    pgque_server.drop_database(name)


@pytest.fixture
def pgque_dsn(pgque_server: PgServer, pgque_template: str) -> Iterator[str]:
    """The superuser DSN of a database of the test's own, a copy of the template;
    dropped after the test, with whatever sessions are still in it."""
    with pgque_server.scratch_database(template=pgque_template) as dsn:
        yield dsn


@pytest.fixture
def pgque_client(pgque_dsn: str) -> Iterator[pgque.Client]:
    """A :class:`pgque.Client` connected to ``pgque_dsn`` (autocommit), closed after
    the test."""
    with pgque.connect(pgque_dsn) as client:
        yield client


@pytest.fixture(scope="session")
def pgque_deployment_template(pgque_server: PgServer,
                              pgque_template_setup: TemplateSetup | None
                              ) -> Iterator[Deployment]:
    """The recommended deployment's roles and template (a :class:`~pgque.testing.Deployment`):
    pgque installed by a database owner who is no superuser, then
    ``pgque_template_setup`` run as that owner. Made once per run."""
    deployment = Deployment.create(pgque_server, setup=pgque_template_setup)
    yield deployment
    deployment.drop()


@pytest.fixture
def pgque_deployment(pgque_deployment_template: Deployment) -> Iterator[Deployment]:
    """The recommended deployment with a database of the test's own (a copy of
    the template): ``.dsn(role)`` connects as its owner, ticker, producer, a
    team's login (``.login(team)``) or the outsider."""
    with pgque_deployment_template.database() as deployment:
        yield deployment
