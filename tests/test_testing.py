"""pgque.testing: the plugin as a user loads it (pytest in a subprocess, on test
files of the user's own), the runner without pytest, and run_worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from doc_blocks import extract
from helpers import scalar
from psycopg.conninfo import make_conninfo

import pgque
from pgque.testing import LocalServer, run_worker

ROOT = Path(__file__).resolve().parent.parent
TESTING_DOC = ROOT / "docs" / "testing.md"


def documented_files() -> dict[str, str]:
    """The example files of docs/testing.md: python blocks whose first line is
    ``# <file name>.py``, by file name."""
    blocks, _ = extract(TESTING_DOC)
    files = {}
    for block in blocks:
        first = block.code.splitlines()[0]
        if block.language == "python" and re.fullmatch(r"# \w+\.py", first):
            files[first[2:]] = block.code
    return files


def run_pytest(directory: Path, *args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess, in ``directory`` (its own rootdir: an empty pytest.ini),
    importing this checkout's pgque; ``env`` changes ours (None removes a variable)."""
    (directory / "pytest.ini").write_text("[pytest]\n")
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                          environ.get("PYTHONPATH")]))
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        environ.pop(name, None)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=directory, env=environ, capture_output=True, text=True,
                          timeout=240, check=False)


def passed(result: subprocess.CompletedProcess[str], count: int) -> str:
    """The output of a pytest run that passed ``count`` tests, or fail showing it."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(rf"\b{count} passed\b", output), output
    return output


# -- the plugin, as a user loads it ----------------------------------------------------


def test_the_documented_example_passes_under_the_plugin(tmp_path: Path,
                                                        pg_server: pgtest.PgServer) -> None:
    """docs/testing.md's conftest.py and test module, as they stand, on our server
    (given as PGQUE_TEST_DSN); they leave no database behind on it."""
    files = documented_files()
    assert set(files) == {"conftest.py", "test_thumbnails.py"}
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    before = pgtest.scratch_databases(pg_server)

    output = passed(run_pytest(tmp_path, "-q", PGQUE_TEST_DSN=pg_server.dsn()), 3)

    assert f"pgque test server: PGQUE_TEST_DSN PostgreSQL {pg_server.major_version}" in output
    assert pgtest.scratch_databases(pg_server) == before


OWN_SERVER_CONFTEST = '''
import pytest


@pytest.fixture(scope="session")
def pgque_server_settings():
    return lambda bindir: {"work_mem": "7MB", "application_name": bindir.name}
'''

OWN_SERVER_TESTS = '''
import threading

import pgque
from pgque.testing import run_worker


def test_settings_reach_the_cluster(pgque_client):
    assert pgque_client.conn.execute("show work_mem").fetchone() == ("7MB",)


def test_major_version(pgque_server):
    assert pgque_server.major_version == {major}


def test_each_test_has_a_database_of_its_own(pgque_client, pgque_dsn):
    pgque_client.create_queue("q")  # fails with QueueExists if a database were shared
    pgque_client.subscribe_slots("q", "g", slots=2)
    pgque_client.send_batch("q", [("e", n, str(n)) for n in range(10)])
    run = run_worker(pgque_dsn, queue="q", consumer="g", slots=2, handler=lambda m: None)
    assert sorted(m.payload for m in run.handled) == list(range(10))


def test_again_a_database_of_its_own(pgque_client):
    pgque_client.create_queue("q")
'''


def test_the_plugin_starts_a_server_of_its_own(tmp_path: Path,
                                               pg_server: pgtest.PgServer) -> None:
    """Without PGQUE_TEST_DSN, a throwaway cluster of the binaries our own run uses
    (``-p pgque.testing``, the settings fixture overridden), deleted at the end."""
    if not isinstance(pg_server, LocalServer):
        pytest.skip(f"the suite runs no throwaway cluster here ({pg_server.description})")
    (tmp_path / "conftest.py").write_text(OWN_SERVER_CONFTEST)
    (tmp_path / "test_own.py").write_text(OWN_SERVER_TESTS.format(major=pg_server.major_version))

    result = run_pytest(tmp_path, "-p", "pgque.testing", "-v",
                        PGQUE_TEST_DSN=None, PGQUE_TEST_BINDIR=str(pg_server.postgres.bindir))

    output = passed(result, 4)
    match = re.search(r"pgque test server: \w+ PostgreSQL (\d+) at .* data in (\S+)\)", output)
    assert match is not None, output
    assert int(match[1]) == pg_server.major_version
    assert not Path(match[2]).exists(), "the throwaway cluster's files outlived the run"


def test_the_plugin_starts_nothing_for_tests_that_do_not_ask(tmp_path: Path) -> None:
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    output = passed(run_pytest(tmp_path, "-p", "pgque.testing",
                               PGQUE_TEST_DSN="postgresql://nobody@127.0.0.1:1/none"), 1)
    assert "pgque test server" not in output


def test_a_server_that_cannot_start_fails_the_tests_that_need_it(tmp_path: Path) -> None:
    """Each test that asks says why."""
    (tmp_path / "test_fails.py").write_text(
        "def test_one(pgque_dsn):\n    pass\n\ndef test_two(pgque_client):\n    pass\n")
    result = run_pytest(tmp_path, "-p", "pgque.testing", "-q",
                        PGQUE_TEST_DSN="postgresql://nobody@127.0.0.1:1/none")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "2 errors" in output, output
    assert output.count("no pgque test server") >= 2, output


# -- imports -----------------------------------------------------------------------------


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120, check=False)


def test_import_pgque_imports_neither_pytest_nor_pgque_testing() -> None:
    result = python("import sys, pgque; print(sorted({'pytest', 'pgque.testing'} & "
                    "set(sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_pgque_testing_works_without_pytest(pg_server: pgtest.PgServer) -> None:
    """With pytest missing, the module imports without its fixtures, and the runner
    does a test's work: server, template, scratch database, worker."""
    code = """
import sys
sys.modules["pytest"] = None  # as if it were not installed
import pgque, pgque.testing
from pgque.testing import open_server, run_worker
assert not hasattr(pgque.testing, "pgque_dsn")
with open_server() as server:
    template = server.create_template()
    try:
        with server.scratch_database(template=template) as dsn:
            with pgque.connect(dsn) as client:
                client.create_queue("q")
                client.subscribe_slots("q", "g", slots=1)
                client.send("q", "e", 1)
            run = run_worker(dsn, queue="q", consumer="g", events=1, handler=lambda m: None)
            print([m.payload for m in run.handled])
    finally:
        server.drop_database(template)
assert "pytest" not in [name for name, module in sys.modules.items() if module]
"""
    before = pgtest.scratch_databases(pg_server)
    result = python(code, PGQUE_TEST_DSN=pg_server.dsn())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1]"
    assert pgtest.scratch_databases(pg_server) == before


# -- the server's databases ----------------------------------------------------------------


def test_templates_and_scratch_databases(pg_server: pgtest.PgServer) -> None:
    made: list[str] = []

    def setup(conn: psycopg.Connection[Any]) -> None:
        conn.execute("create table app_table (x int)")
        made.append(scalar(conn, "select current_database()"))

    template = pg_server.create_template(setup=setup)
    try:
        assert made == [template] and template.startswith("pgque_template_")
        with pg_server.admin() as admin:
            assert admin.execute("select datistemplate, datallowconn from pg_database"
                                 " where datname = %s", (template,)).fetchone() == (True, False)
        with pg_server.scratch_database(template=template, prefix="pgque_test_copy") as copy:
            with psycopg.connect(copy) as conn:
                name = scalar(conn, "select current_database()")
                assert name.startswith("pgque_test_copy_")
                assert scalar(conn, "select to_regclass('public.app_table') is not null")
                assert scalar(conn, "select pgque.version()") == pgque.__version__
            holder = psycopg.connect(copy)  # a session left in it does not stop the drop
        assert name not in pgtest.scratch_databases(pg_server)
        with holder, pytest.raises(psycopg.OperationalError):
            holder.execute("select 1")
        # A name given again replaces the database of that name.
        assert pg_server.create_template(template) == template
        with pg_server.scratch_database(template=template) as copy, psycopg.connect(copy) as conn:
            assert scalar(conn, "select to_regclass('public.app_table')") is None
    finally:
        pg_server.drop_database(template)
    assert template not in pgtest.scratch_databases(pg_server)
    pg_server.drop_database(template)  # gone already: nothing to do


def test_a_failing_template_setup_leaves_no_template(pg_server: pgtest.PgServer) -> None:
    before = pgtest.scratch_databases(pg_server)

    def setup(conn: psycopg.Connection[Any]) -> None:
        conn.execute("select no_such_function()")

    with pytest.raises(psycopg.errors.UndefinedFunction):
        pg_server.create_template(setup=setup)
    assert pgtest.scratch_databases(pg_server) == before


# -- run_worker ---------------------------------------------------------------------------


@pytest.fixture
def queue(client: pgque.Client) -> str:
    client.create_queue("q")
    client.subscribe_slots("q", "g", slots=3)
    return "q"


def test_run_worker_until_so_many_events(client: pgque.Client, dsn: str, queue: str) -> None:
    client.send_batch(queue, [("e", n, f"k{n % 5}") for n in range(20)])
    seen: list[int] = []
    lock = threading.Lock()

    def handle(message: pgque.Message[Any]) -> None:
        with lock:
            seen.append(message.payload)

    run = run_worker(dsn, queue=queue, consumer="g", slots=3, events=20, handler=handle)
    assert sorted(m.payload for m in run.handled) == sorted(seen) == list(range(20))
    assert run.failed == []
    assert not run.worker.alive and run.worker.owned_slots == frozenset()
    # Everything handled was acked: nothing waits for the group any more.
    assert [r.pending_events for r in client.partition_slot_status(queue)] == [0, 0, 0]


def test_run_worker_drains_and_counts_failures(client: pgque.Client, dsn: str,
                                               queue: str) -> None:
    """Without events: until nothing is left, retries included."""
    client.send_batch(queue, [("e", n, f"k{n}") for n in range(6)])

    def handle(message: pgque.Message[Any]) -> None:
        if message.payload == 3 and message.retry_count == 0:
            raise ValueError("first try of 3")

    run = run_worker(dsn, queue=queue, consumer="g", slots=3, handler=handle, retry_after=0)
    assert sorted(m.payload for m in run.handled) == list(range(6))
    [(message, error)] = run.failed
    assert (message.payload, message.retry_count, str(error)) == (3, 0, "first try of 3")
    assert [m.retry_count for m in run.handled if m.payload == 3] == [1]
    rows = client.partition_slot_status(queue)
    assert [(r.pending_events, r.retries_waiting, r.open_batch_id) for r in rows] \
        == [(0, 0, None)] * 3


def test_run_worker_drains_an_empty_queue_at_once(client: pgque.Client, dsn: str,
                                                  queue: str) -> None:
    run = run_worker(dsn, queue=queue, consumer="g", slots=3, handler=lambda m: None)
    assert run.handled == [] and run.failed == []


def test_run_worker_raises_what_stopped_the_worker(client: pgque.Client, dsn: str,
                                                   queue: str) -> None:
    with pytest.raises(pgque.QueueNotFound):
        run_worker(dsn, queue="missing", consumer="g", handler=lambda m: None, events=1)
    with pytest.raises(pgque.SlotCountMismatch):
        run_worker(dsn, queue=queue, consumer="g", slots=2, handler=lambda m: None)


def test_run_worker_times_out(client: pgque.Client, dsn: str, queue: str) -> None:
    client.send(queue, "e", 1)
    with pytest.raises(TimeoutError, match=r"waited 2 s for 2 handler calls \(1 handled, 0 failed"):
        run_worker(dsn, queue=queue, consumer="g", slots=3, events=2, timeout=2,
                   handler=lambda m: None)
    with pytest.raises(ValueError, match="events"):
        run_worker(dsn, queue=queue, consumer="g", events=0, handler=lambda m: None)


def test_run_worker_drains_for_a_role_that_is_not_an_admin(dsn: str, reader_role: str) -> None:
    """run_worker tells "drained" also under a role that is not an admin (the
    application's own pgque_reader, something else ticking, as docs/testing.md
    allows with ticker=False): it returns once the group is drained."""
    with pgque.connect(dsn) as admin:
        admin.create_queue("q")
    reader_dsn = make_conninfo(dsn, user=reader_role)
    with pgque.connect(reader_dsn) as owner:
        owner.subscribe_slots("q", "g", slots=2)
    with pgque.connect(dsn) as admin:
        admin.send_batch("q", [("e", {"n": n}, f"k{n}") for n in range(5)])
    with pgque.Ticker(dsn):
        run = run_worker(reader_dsn, queue="q", consumer="g", slots=2,
                         handler=lambda message: None, ticker=False, timeout=10)
    assert len(run.handled) == 5
