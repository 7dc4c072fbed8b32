"""Small helpers shared by the tests (no fixtures here; see conftest.py)."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pgtest
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

T = TypeVar("T")

#: Whether the long variants run: ``PGQUE_TEST_LONG=1`` (``make test-long``).
LONG = os.environ.get("PGQUE_TEST_LONG") == "1"


def long_variant(*values: Any, id: str | None = None) -> Any:
    """A parameter set of a test's long form (bigger, or waiting longer), marked
    ``long``: it runs only with PGQUE_TEST_LONG=1 (``make test-long``), while the
    test's short form runs in every ``make test``. (The fault suite has its own,
    test_faults.long_variant.)"""
    return pytest.param(*values, id=id, marks=[
        pytest.mark.long,
        pytest.mark.skipif(not LONG, reason="long variant: PGQUE_TEST_LONG=1 (make test-long)")])


def drain(client: pgque.Client, queue: str, consumer: str, *,
          max_events: int | None = None, tick: bool = True) -> list[pgque.Message[Any]]:
    """Receive and ack until no batch is ready; returns the messages in order.

    With tick, forces a tick first, so everything committed before the call is
    delivered by the time it returns.
    """
    if tick:
        client.tick(queue)
    received: list[pgque.Message[Any]] = []
    while (batch := client.receive(queue, consumer, max_events=max_events)) is not None:
        received.extend(batch.messages)
        client.ack(batch)
    return received


def dump_state(dsn: str | None = None) -> None:
    """Print every thread's stack and, given a DSN, what the server's sessions are
    doing: called when a test times out, so a hang can be diagnosed from the log."""
    faulthandler.dump_traceback(all_threads=True)
    if dsn is None:
        return
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            for row in conn.execute(
                    "select pid, application_name, state, wait_event_type, wait_event, "
                    "left(query, 120) from pg_stat_activity where datname = current_database()"):
                print("session:", row, flush=True)
            for view in ("queue_info", "consumer_info", "partition_slot_status"):
                for row in conn.execute(f"select * from pgque.{view}"):
                    print(f"{view}:", row, flush=True)
            for row in conn.execute("select tick_queue, tick_id, tick_time, tick_snapshot, "
                                    "tick_event_seq from pgque.tick order by tick_id desc "
                                    "limit 5"):
                print("tick:", row, flush=True)
    except Exception as exc:
        print("could not read pg_stat_activity:", exc, flush=True)


def wait_for(probe: Callable[[], T | None], *, timeout: float = 10.0,
             interval: float = 0.02, what: str = "condition", dsn: str | None = None) -> T:
    """Poll probe until it returns something truthy, or fail after timeout seconds
    (dumping threads, and sessions when ``dsn`` is given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            dump_state(dsn)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scalar(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first column of the first row of a query."""
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def backends(conn: psycopg.Connection[Any]) -> int:
    """Client sessions on this database other than ``conn``'s own. An autovacuum
    worker is listed with the database's name too, and comes and goes on its own."""
    return int(scalar(conn, "select count(*) from pg_stat_activity"
                            " where datname = current_database() and pid <> pg_backend_pid()"
                            " and backend_type = 'client backend'"))


def refused(call: Callable[[], Any],
            error: type[Exception] = psycopg.errors.InsufficientPrivilege) -> bool:
    """Whether call raises error, or, for a raw psycopg call, the server error with
    error's SQLSTATE (pgque's classes carry theirs)."""
    try:
        call()
    except error:
        return True
    except psycopg.Error as exc:
        if exc.sqlstate is not None and exc.sqlstate == getattr(error, "sqlstate", None):
            return True
        raise
    return False


def owned_group(client: pgque.Client, per_tick: int, *, ticks: int = 1, slots: int = 4,
                **queue: Any) -> dict[int, list[int]]:
    """Queue q (``queue`` its create_queue options) with group g of ``slots`` slots,
    all claimed by ``client``, and ``ticks`` ticks of ``per_tick`` events over 30
    keys; returns each slot's event ids in send order."""
    client.create_queue("q", **queue)
    client.subscribe_slots("q", "g", slots=slots)
    client.maintenance()
    by_slot: dict[int, list[int]] = {k: [] for k in range(slots)}
    n = 0
    for _ in range(ticks):
        rows = [("e", {"n": n + i}, f"k{(n + i) % 30}") for i in range(per_tick)]
        for (_type, _payload, key), ev in zip(rows, client.send_batch("q", rows), strict=True):
            by_slot[scalar(client.conn, "select pgque.slot_of(%s, %s)", (key, slots))].append(ev)
        n += per_tick
        client.tick("q")
    for slot in range(slots):
        assert client.claim_slot("q", "g", slot)
    return by_slot


# -- advisory locks, as any role reads them in pg_locks ----------------------------------------


def signed(value: int, bits: int) -> int:
    """An unsigned half of a key as pg_locks shows it, as the advisory functions take it."""
    half: int = 2 ** (bits - 1)
    return (value + half) % (2 * half) - half


def advisory_keys(conn: psycopg.Connection[Any], pid: int, *, mode: str | None = "ExclusiveLock",
                  size: int | None = None) -> list[tuple[int, ...]]:
    """The advisory keys session pid holds (granted) in mode (any mode for None), as any
    role may read them in pg_locks, in the form the advisory functions take: (bigint,)
    for a one-key lock, (int, int) for a two-integer one; only those of ``size`` (1 or
    2) when given. In pg_locks' order of (classid, objid, objsubid)."""
    keys: list[tuple[int, ...]] = []
    for classid, objid, objsubid in conn.execute(
            "select classid::bigint, objid::bigint, objsubid::int from pg_locks"
            " where locktype = 'advisory' and granted and pid = %s"
            "   and (%s::text is null or mode = %s) and (%s::int is null or objsubid = %s)"
            " order by 1, 2, 3", (pid, mode, mode, size, size)):
        keys.append((signed((classid << 32) | objid, 64),) if objsubid == 1
                    else (signed(classid, 32), signed(objid, 32)))
    return keys


def waits_on_advisory_lock(conn: psycopg.Connection[Any], pid: int) -> bool:
    """Whether session pid waits for an advisory lock now."""
    return bool(scalar(conn, "select exists (select 1 from pg_locks where pid = %s"
                             " and locktype = 'advisory' and not granted)", (pid,)))


# -- the command line, run as a subprocess -----------------------------------------------------

CLI = [sys.executable, "-m", "pgque.cli"]
TESTS_DIR = str(Path(__file__).resolve().parent)
#: A DSN nothing answers at.
BAD_DSN = "postgresql://nobody@127.0.0.1:1/x"


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: ours, minus anything that would change its behaviour."""
    env = {k: v for k, v in os.environ.items() if k not in ("PGQUE_DSN", "PGQUE_DEBUG")}
    env.update(extra)
    return env


def run_cli(*args: str, input: str | None = None, timeout: float = 60,
            **env: str) -> subprocess.CompletedProcess[str]:
    """One run of the CLI with args (and env added to its environment), to its end."""
    return subprocess.run([*CLI, *args], input=input, capture_output=True, text=True,
                          timeout=timeout, env=cli_env(**env))


@contextmanager
def cli_process(*args: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """The CLI running in the background; killed if the test leaves it running."""
    with subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, env=cli_env(**env)) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a run that must have succeeded."""
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The run failed with ``code`` and said why in one line, without a traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# -- installs: the catalog they leave, frozen releases, planted code --------------------------

CATALOG_QUERIES = {
    "functions": """
        select p.oid::regprocedure::text, pg_get_functiondef(p.oid), p.proacl::text,
               p.prosecdef, p.proconfig::text
          from pg_proc p where p.pronamespace = 'pgque'::regnamespace order by 1""",
    "relations": """
        select c.relname, c.relkind, c.reloptions::text, c.relacl::text,
               -- A column's place among the live ones: the numbers of columns
               -- dropped before it (an event table made before 0.2) are history.
               (select count(*) from pg_attribute b where b.attrelid = c.oid and b.attnum > 0
                   and not b.attisdropped and b.attnum <= a.attnum),
               a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid)
          from pg_class c
          left join pg_attribute a on a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped
          left join pg_attrdef d on d.adrelid = c.oid and d.adnum = a.attnum
         where c.relnamespace = 'pgque'::regnamespace order by 1, 5""",
    "indexes": "select indexname, indexdef from pg_indexes where schemaname = 'pgque' order by 1",
    "constraints": """
        select conrelid::regclass::text, conname, pg_get_constraintdef(oid)
          from pg_constraint where connamespace = 'pgque'::regnamespace order by 1, 2""",
    "views": """
        select viewname, definition from pg_views where schemaname = 'pgque' order by 1""",
    "schema": "select nspname, nspowner::regrole::text, nspacl::text from pg_namespace "
              "where nspname = 'pgque'",
    "roles": "select rolname, rolcanlogin from pg_roles where rolname like 'pgque\\_%' order by 1",
}


def catalog(conn: psycopg.Connection[Any]) -> dict[str, list[Any]]:
    """What an install made, by kind (CATALOG_QUERIES): equal after an install that
    changed nothing."""
    return {name: conn.execute(sql).fetchall() for name, sql in CATALOG_QUERIES.items()}


def drop_role(dsn: str, role: str) -> None:
    """Drop a test role after dropping what it owns in dsn's database."""
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"drop owned by {role} cascade")
        su.execute(f"drop role if exists {role}")


# Functions and operators a role without any pgque grant plants in public, where
# PostgreSQL 14 (and databases upgraded from it) lets every role create. Each
# would record that it ran, as whoever called it, and return the right answer.
PLANTS = [
    """create function public.format(text, text) returns text language plpgsql as $$
       begin insert into public.pwned values ('format'); return $2; end $$""",
    """create function public.pg_advisory_xact_lock(integer) returns void language plpgsql as $$
       begin insert into public.pwned values ('pg_advisory_xact_lock'); end $$""",
    """create function public.now() returns timestamptz language plpgsql as $$
       begin insert into public.pwned values ('now'); return pg_catalog.now(); end $$""",
    """create function public.pwn_eq(name, text) returns boolean language plpgsql as $$
       begin insert into public.pwned values ('='); return pg_catalog.nameeqtext($1, $2); end $$""",
    "create operator public.= (leftarg = name, rightarg = text, function = public.pwn_eq)",
]


# Two commits on main called themselves pgque 0.1.0, with different tables: 3bd2224
# (the first, without pgque.batch_nack) and 09e6af5. Their install scripts, frozen,
# by commit: upgrades start from either. The tests that need one 0.1.0 take the later.
BASELINES_0_1 = {commit: Path(__file__).resolve().parent / "data" / f"pgque-0.1.0-{commit}.sql"
                 for commit in ("3bd2224", "09e6af5")}


def install_0_1(dsn: str, commit: str = "09e6af5") -> None:
    """Install the 0.1.0 of that commit, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINES_0_1[commit].read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.1.0"


# The install script of pgque 0.2.0 as it landed (2f0bb29), frozen: it installs 0.2.0
# into an empty database and upgrades a 0.1.0 as that release did, wrongly over
# 3bd2224 (it records migration 1 without making pgque.batch_nack).
BASELINE_0_2 = Path(__file__).resolve().parent / "data" / "pgque-0.2.0-2f0bb29.sql"


def install_0_2(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.2.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_2.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.2.0"


# The install script of pgque 0.3.0 as it landed (14bd90f), frozen.
BASELINE_0_3 = Path(__file__).resolve().parent / "data" / "pgque-0.3.0-14bd90f.sql"


def install_0_3(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.3.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_3.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.3.0"


# The install script of pgque 0.4.0 as it landed (a77e4ac), frozen: migrations 1
# to 6, the cursor log and the ticks still plain tables.
BASELINE_0_4 = Path(__file__).resolve().parent / "data" / "pgque-0.4.0-a77e4ac.sql"


def install_0_4(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.4.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_4.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.4.0"


# The install script of pgque 0.5.0 as it first landed (a562c71), frozen:
# migrations 1 to 7, the engine's state in rotating tables (the 0.5.0 that
# landed later, 346c4f5, has the same migrations: the same catalog).
BASELINE_0_5 = Path(__file__).resolve().parent / "data" / "pgque-0.5.0-a562c71.sql"


def install_0_5(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.5.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_5.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.5.0"


# The install script of pgque 0.6.0 as it landed (0234eb9), frozen: migrations 1
# to 8, the pause policy.
BASELINE_0_6 = Path(__file__).resolve().parent / "data" / "pgque-0.6.0-0234eb9.sql"


def install_0_6(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.6.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_6.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.6.0"


# The install script of pgque 0.7.0 as it landed (6a5fdd9), frozen: migrations 1
# to 9, delayed and idempotent sends.
BASELINE_0_7 = Path(__file__).resolve().parent / "data" / "pgque-0.7.0-6a5fdd9.sql"


def install_0_7(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.7.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_7.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.7.0"


# The install script of pgque 0.8.0 as it was given its number (f051aa3; its
# SQL that of 76e0fc3), frozen: migrations 1 to 9, receive_slots' set path.
BASELINE_0_8 = Path(__file__).resolve().parent / "data" / "pgque-0.8.0-f051aa3.sql"


def install_0_8(dsn: str) -> None:
    """Install (or upgrade to) 0.8.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_8.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.8.0"


# The install script of pgque 0.9.0 as it landed (c74d5c8), frozen: migrations 1
# to 10, the sleeping ticker.
BASELINE_0_9 = Path(__file__).resolve().parent / "data" / "pgque-0.9.0-c74d5c8.sql"


def install_0_9(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.9.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_9.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.9.0"


# The install script of pgque 0.10.0 as it landed (8cbaeaa), frozen: migrations
# 1 to 11, settled ticks and the hot-queue ticker.
BASELINE_0_10 = Path(__file__).resolve().parent / "data" / "pgque-0.10.0-8cbaeaa.sql"


def install_0_10(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.10.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_10.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.10.0"


# The install script of pgque 0.11.0 as it last landed (05850e1), frozen: migrations
# 1 to 11 (its earlier commits differ from it in code only, which every
# install replaces), batch readers that return rows.
BASELINE_0_11 = Path(__file__).resolve().parent / "data" / "pgque-0.11.0-05850e1.sql"


def install_0_11(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.11.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_11.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.11.0"


# The landed 0.12.0 (f5a937b): migrations 1 to 12, the record of handler calls.
BASELINE_0_12 = Path(__file__).resolve().parent / "data" / "pgque-0.12.0-f5a937b.sql"


def install_0_12(dsn: str) -> None:
    """Install (or upgrade to) the landed 0.12.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_12.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.12.0"


# The landed 0.13.0 (fedea2c, never landed: its CI failed; frozen all the same): migrations 1
# to 12, the exporter's metrics() and slot_skew.
BASELINE_0_13 = Path(__file__).resolve().parent / "data" / "pgque-0.13.0-fedea2c.sql"


def install_0_13(dsn: str) -> None:
    """Install (or upgrade to) 0.13.0, in one transaction, as its installer did."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(BASELINE_0_13.read_bytes())
        assert scalar(conn, "select pgque.version()") == "0.13.0"


@contextmanager
def scratch_database(pg_server: pgtest.PgServer) -> Iterator[str]:
    """A new empty database on the test server, dropped at the end; yields its DSN."""
    name = pgtest.scratch_name("e")
    pgtest.create_database(pg_server, name)
    try:
        yield pg_server.dsn(name)
    finally:
        pgtest.drop_database(pg_server, name)


def _keep_going(fn: Any, stop: threading.Event, errors: list[str]) -> threading.Thread:
    """Run fn until stop, recording (and riding over) its failures: the docs allow a
    call to fail once while the install replaces the code."""
    def run() -> None:
        while not stop.is_set():
            try:
                fn()
            except psycopg.Error as exc:
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    t = threading.Thread(target=run)
    t.start()
    return t


def installs_under(dsn: str, fn: Any, n: int = 20) -> tuple[list[str], list[str]]:
    """n installs into dsn while another thread calls fn over and over; returns the
    installs' failures and fn's."""
    stop = threading.Event()
    side: list[str] = []
    t = _keep_going(fn, stop, side)
    failed: list[str] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            for _ in range(n):
                try:
                    pgque.install(c)
                except psycopg.Error as exc:
                    failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    finally:
        stop.set()
        t.join(60)
    return failed, side


# -- slots: keys that route to one, a slot's cursor --------------------------------------------


def slot_keys(conn: Any, slot: int, slots: int, count: int = 1, prefix: str = "k") -> list[str]:
    """The first ``count`` keys prefix0, prefix1, ... that route to ``slot`` of ``slots``."""
    keys: list[str] = []
    n = 0
    while len(keys) < count:
        key = f"{prefix}{n}"
        if int(scalar(conn, "select pgque.slot_of(%s, %s)", (key, slots))) == slot:
            keys.append(key)
        n += 1
    return keys


def slot_cursor(client: pgque.Client, consumer: str) -> tuple[Any, ...]:
    """(cur_last_tick, cur_batch) of subscription ``consumer``'s current cursor."""
    row = client.conn.execute(
        "select c.cur_last_tick, c.cur_batch from pgque.subscription s"
        " cross join lateral pgque._current_cursor(s.sub_id) c"
        " where s.sub_consumer = %s", (consumer,)).fetchone()
    assert row is not None
    return tuple(row)


# -- services run in a thread ------------------------------------------------------------------


def run_in_thread(service: Any) -> tuple[threading.Thread, list[BaseException]]:
    """``service.run()`` (a Worker's or a Ticker's) in a thread of its own: the thread
    and what run() raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            service.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, name="run", daemon=True)
    runner.start()
    return runner, raised


# -- a Worker's slots and lanes, as the server shows them ---------------------------------------


def first_value(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first column of the first row of a query, or None when there is no row."""
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]


def slots_drained(conn: psycopg.Connection[Any]) -> bool:
    """Whether every slot of every group has nothing pending, no open batch and no
    retry waiting (and there is a slot)."""
    return bool(scalar(conn, "select coalesce(bool_and(pending_events = 0 and open_batch_id is "
                             "null and retries_waiting = 0), false) "
                             "from pgque.partition_slot_status"))


def lane_pids(conn: psycopg.Connection[Any], name: str) -> set[int]:
    """The backend pids of the lanes of the worker called ``name``."""
    return {r[0] for r in conn.execute(
        "select pid from pg_stat_activity where application_name like %s",
        (f"{name}-lane%",))}


def queue_with_effects(client: pgque.Client, conn: psycopg.Connection[Any], slots: int = 1,
                       **config: Any) -> None:
    """Queue q (ticker_max_lag 0, and ``config``), its group g of ``slots`` slots, and
    table effects (ev_id, payload, pid) for handlers to write to."""
    client.create_queue("q", ticker_max_lag=0, **config)
    client.subscribe_slots("q", "g", slots=slots)
    conn.execute("create table effects (ev_id bigint, payload int, pid int)")


# -- teams, an admin and an outsider, each a login role ------------------------------------------

#: The statement timeout of a World's sessions: a stall fails the test instead of hanging it.
VICTIM_TIMEOUT_MS = 3000


@dataclass
class World:
    """Roles of one test: team a, team b (reader + writer each), an admin and an
    outsider (login, no pgque grant); DSNs with a statement timeout; superuser DSN."""

    su: psycopg.Connection[Any]
    su_dsn: str
    roles: dict[str, str]
    dsns: dict[str, str]
    extra_roles: list[str]

    def client(self, kind: str) -> pgque.Client:
        return pgque.connect(self.dsns[kind])

    def raw(self, kind: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsns[kind], autocommit=autocommit)

    def dsn_for(self, user: str, *options: str) -> str:
        params = conninfo_to_dict(self.su_dsn)
        opts = " ".join([f"-c statement_timeout={VICTIM_TIMEOUT_MS}", *options])
        return make_conninfo(**{**params, "user": user, "options": opts})  # type: ignore[arg-type]

    def make_role(self, name: str, ddl: str = "") -> str:
        """Creates a role dropped after the test (ddl: the rest of CREATE ROLE)."""
        self.su.execute(f"create role {sql.Identifier(name).as_string(self.su)} {ddl}")
        self.extra_roles.append(name)
        return name


@contextmanager
def world_of(dsn: str) -> Iterator[World]:
    """A World on dsn's database, with queue q; its roles (and what they own) are
    dropped at the end, after their sessions are ended."""
    suffix = uuid.uuid4().hex[:8]
    grants = {"a": "pgque_reader, pgque_writer", "b": "pgque_reader, pgque_writer",
              "admin": "pgque_admin", "outsider": None}
    roles = {kind: f"pgque_rv_{kind}_{suffix}" for kind in grants}
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("select pgque.create_queue('q')")
        w = World(su, dsn, roles, {}, [])
        try:
            for kind, role in roles.items():
                su.execute(f"create role {role} login")
                if grants[kind]:
                    su.execute(f"grant {grants[kind]} to {role}")
                w.dsns[kind] = w.dsn_for(role)
            yield w
        finally:
            # Sessions of these roles may still be open (a failed test): end them first.
            names = list(roles.values()) + w.extra_roles
            su.execute("select pg_terminate_backend(pid) from pg_stat_activity "
                       "where usename = any(%s) and pid <> pg_backend_pid()", (names,))
            for name in reversed(names):
                ident = sql.Identifier(name).as_string(su)
                with suppress(psycopg.Error):
                    su.execute(f"drop owned by {ident}")
                with suppress(psycopg.Error):
                    su.execute(f"drop role if exists {ident}")


def sqlstate_of(call: Callable[[], Any]) -> str | None:
    """The SQLSTATE call fails with (a server error's, or a pgque error's), or None
    when it succeeds."""
    try:
        call()
    except psycopg.Error as exc:
        return exc.sqlstate
    except pgque.PgqueError as exc:
        return getattr(exc, "sqlstate", None)
    return None


# -- events as other sessions see them -----------------------------------------------------------


def dbname(dsn: str) -> str:
    """The database a DSN names."""
    return str(conninfo_to_dict(dsn)["dbname"])


def committed_ids(conn: psycopg.Connection[Any], ids: list[int]) -> list[int]:
    """Which of ``ids`` (events of queue 1) another session sees committed, ascending."""
    return [r[0] for r in conn.execute(
        "select ev_id from pgque.event_1 where ev_id = any(%s) order by ev_id", (ids,))]
