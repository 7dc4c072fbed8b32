"""Installing: idempotent, concurrent-safe (with other installs, uninstalls,
maintenance and queues made and dropped), and possible for a non-superuser owner;
safe from what other roles planted (a squatter's schema, functions in public, the
script run without one transaction), and refusing to drop objects of others built
on pgque's code."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pgtest
import psycopg
import pytest
from helpers import (
    CATALOG_QUERIES,
    PLANTS,
    catalog,
    drain,
    drop_role,
    install_0_1,
    installs_under,
    run_cli,
    scalar,
    scratch_database,
)
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque


def test_install_twice_changes_nothing(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        pgque.install(conn)
        first = catalog(conn)
        assert len(first["functions"]) > 20
        pgque.install(conn)
        second = catalog(conn)
    for name in CATALOG_QUERIES:
        assert first[name] == second[name], f"{name} changed on the second install"


def test_install_keeps_queues_and_events(empty_dsn: str) -> None:
    with pgque.connect(empty_dsn) as client:
        assert client.install() == pgque.__version__
        client.create_queue("q")
        client.subscribe("q", "c")
        sent = client.send("q", "e", {"kept": True})
        client.install()
        assert [m.id for m in drain(client, "q", "c")] == [sent]


def test_concurrent_installs(empty_dsn: str) -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True) as conn:
                pgque.install(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_uninstall_then_install(empty_dsn: str) -> None:
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.create_queue("q")
        client.uninstall()
        assert client.conn.execute(
            "select count(*) from pg_namespace where nspname = 'pgque'").fetchone() == (0,)
        client.install()
        assert client.queue_info() == []


def test_install_by_non_superuser_database_owner(dsn: str) -> None:
    """The installer needs no superuser and no CREATEROLE: owning the database is enough."""
    suffix = uuid.uuid4().hex[:8]
    owner, database = f"pgque_owner_{suffix}", f"owned_{suffix}"
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {owner} login nosuperuser nocreaterole nocreatedb")
        su.execute(f"create database {database} owner {owner}")
        try:
            owner_dsn = make_conninfo(**{**params, "user": owner, "dbname": database})
            with pgque.connect(owner_dsn) as client:
                client.install()
                client.install()
                client.create_queue("q")
                client.subscribe("q", "c")
                sent = client.send_batch("q", [("e", 1), ("e", 2)])
                assert [m.id for m in drain(client, "q", "c")] == sent
                assert client.maintenance("q") is not None
                owner_of = client.conn.execute(
                    "select nspowner::regrole::text from pg_namespace where nspname = 'pgque'"
                ).fetchone()
                assert owner_of == (owner,)
        finally:
            su.execute(f"drop database if exists {database} with (force)")
            su.execute(f"drop role if exists {owner}")


def test_install_never_runs_what_others_planted_in_public(empty_dsn: str) -> None:
    """The install pins search_path for its whole transaction: a superuser installing
    with public first on its path calls nothing another role planted there."""
    planter = f"pgque_planter_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        su.execute(f"create role {planter} login")
        su.execute("grant create on schema public to public")  # PostgreSQL 14's default
    try:
        with psycopg.connect(make_conninfo(**{**params, "user": planter}),
                             autocommit=True) as p:
            p.execute("create table public.pwned (what text)")
            p.execute("grant insert on public.pwned to public")
            for plant in PLANTS:
                p.execute(plant)
            p.execute("grant execute on all functions in schema public to public")
        with psycopg.connect(empty_dsn, autocommit=True,
                             options="-c search_path=public,pg_catalog") as conn:
            pgque.install(conn)
            pgque.install(conn)
            # What the install stored (defaults, views) must not call them either.
            with pgque.Client(conn) as client:
                client.create_queue("q")
                client.subscribe("q", "c")
                client.send("q", "e", 1)
                assert [m.payload for m in drain(client, "q", "c")] == [1]
            ran = conn.execute("select what from public.pwned").fetchall()
        assert ran == []
    finally:
        drop_role(empty_dsn, planter)


def test_install_refuses_a_schema_someone_else_owns(empty_dsn: str) -> None:
    """A role with CREATE on the database that made schema pgque first: the install
    refuses with PQ013, and nothing the squatter put there runs."""
    squatter = f"pgque_squatter_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        su.execute(f"create role {squatter} login")
        su.execute(f"grant create on database {params['dbname']} to {squatter}")
    try:
        squatter_dsn = make_conninfo(**{**params, "user": squatter})
        with psycopg.connect(squatter_dsn, autocommit=True) as s:
            s.execute("create schema pgque")
            s.execute("grant usage on schema pgque to public")
            s.execute("create table pgque.pwned (what text)")
            s.execute("grant insert on pgque.pwned to public")
            s.execute("""create function pgque.version() returns text language plpgsql as $$
                         begin insert into pgque.pwned values ('version'); return '0'; end $$""")
            s.execute("""create function pgque._check_name(text, text) returns void
                         language plpgsql as $$
                         begin insert into pgque.pwned values ('_check_name'); end $$""")
        with pgque.connect(empty_dsn) as client, pytest.raises(pgque.SchemaNotOwned) as caught:
            client.install()
        assert caught.value.sqlstate == "PQ013"
        assert "pgque" in str(caught.value)
        with psycopg.connect(squatter_dsn, autocommit=True) as s:
            assert s.execute("select what from pgque.pwned").fetchall() == []
            assert s.execute("select nspowner::regrole::text from pg_namespace "
                             "where nspname = 'pgque'").fetchone() == (squatter,)
    finally:
        drop_role(empty_dsn, squatter)


def test_install_refuses_an_object_someone_else_owns_in_its_schema(dsn: str) -> None:
    """An object of another role inside schema pgque (made while it had CREATE there)
    makes a reinstall refuse too: CREATE OR REPLACE would keep that role the owner."""
    squatter = f"pgque_squatter_{uuid.uuid4().hex[:8]}"
    params = conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {squatter} login")
        su.execute(f"grant usage, create on schema pgque to {squatter}")
    try:
        with psycopg.connect(make_conninfo(**{**params, "user": squatter}),
                             autocommit=True) as s:
            s.execute("create function pgque._pwn() returns void language sql as $$ $$")
        with psycopg.connect(dsn, autocommit=True) as conn:
            with pytest.raises(psycopg.Error) as caught:
                pgque.install(conn)
            assert caught.value.sqlstate == "PQ013"
    finally:
        drop_role(dsn, squatter)


# -- upgrades ----------------------------------------------------------------------------

def test_upgrade_from_0_1_keeps_queues_ticking_and_maintained(
        empty_dsn: str, pg_server: pgtest.PgServer) -> None:
    """Queues made by 0.1 get the lock rows ticks and maintenance now take, and the
    upgraded catalog is the one a fresh install makes."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        first = client.send("q", "e", "fails")
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None and [m.id for m in batch] == [first]
        client.ack(batch, nack=batch.messages, retry_after=0)
        second = client.send("q", "e", "pending")

        assert client.install() == pgque.__version__
        assert client.conn.execute(
            "select ql_purpose from pgque.queue_lock order by 1").fetchall() == [
                ("maint",), ("tick",)]
        assert ("q", "retry", 1) in client.maintenance()
        assert client.ticker() == 1
        assert [m.id for m in drain(client, "q", "c")] == [first, second]
        assert client.tick("q") > 0
        upgraded = catalog(client.conn)

    with scratch_database(pg_server) as fresh_dsn, pgque.connect(fresh_dsn) as fresh:
        fresh.install()
        fresh.create_queue("q")
        fresh.install()  # as over the upgraded queue (the install sets its tables' ACLs)
        installed = catalog(fresh.conn)
    for name in CATALOG_QUERIES:
        assert upgraded[name] == installed[name], f"{name} differs after the upgrade"


def test_concurrent_upgrades_from_0_1(empty_dsn: str) -> None:
    """0.1 has no install lock table: concurrent upgraders race to create it, and the
    losers run the install again."""
    install_0_1(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
    test_concurrent_installs(empty_dsn)
    with pgque.connect(empty_dsn) as client:
        assert scalar(client.conn, "select pgque.version()") == pgque.__version__
        assert scalar(client.conn, "select count(*) from pgque.queue_lock") == 2
        assert client.ticker("q") in (0, 1)


@pytest.mark.skipif(shutil.which("psql") is None, reason="no psql")
def test_psql_runs_the_install_script(empty_dsn: str, tmp_path: Path) -> None:
    """The documented path: psql -1 -f of the assembled script, into an empty
    database, over an install, and over 0.1."""
    script = tmp_path / "pgque.sql"
    script.write_text(pgque.install_script())

    def psql() -> None:
        result = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-1", "-f",
                                 str(script), "-d", empty_dsn],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

    psql()
    psql()
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        client.uninstall()
    install_0_1(empty_dsn)
    psql()
    with pgque.connect(empty_dsn) as client:
        assert scalar(client.conn, "select pgque.version()") == pgque.__version__
        client.create_queue("q")
        assert client.tick("q") > 0


def test_install_names_objects_of_others_built_on_its_code(empty_dsn: str) -> None:
    """Every install drops and recreates pgque's views and functions: a view of
    yours over one of them would go too, so the install refuses and names it, and
    changes nothing."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.create_queue("q")
        client.conn.execute("create view public.lagging as select * from pgque.consumer_info")
        before = catalog(client.conn)
        with pytest.raises(pgque.DependentObjects, match=r"public\.lagging"):
            client.install()
        assert catalog(client.conn) == before
        assert client.conn.execute("select count(*) from public.lagging").fetchone() == (0,)
        client.conn.execute("drop view public.lagging")
        client.install()
        assert client.send("q", "e", 1) > 0


@pytest.mark.superuser_install  # it installs again as the superuser
def test_installing_again_with_queues_and_groups_changes_no_catalog_row(dsn: str) -> None:
    """With queues and groups of several slot counts, and their maintenance done,
    an install (twice) changes no catalog row and leaves no maintenance due."""
    with pgque.connect(dsn) as client:
        for n, slots in enumerate((2, 5, 16)):
            client.create_queue(f"q{n}")
            client.subscribe_slots(f"q{n}", "g", slots=slots)
            client.subscribe_slots(f"q{n}", "h", slots=3)
        client.maintenance()
        assert client.maintenance() == []
        before = catalog(client.conn)
        client.install()
        assert catalog(client.conn) == before
        assert client.maintenance() == []
        client.install()
        assert catalog(client.conn) == before


# -- a squatter's pgque.version() never runs as the installer ---------------------------------


def _role_dsn(dsn: str, role: str) -> str:
    return make_conninfo(**{**conninfo_to_dict(dsn), "user": role})


def _squat(dsn: str) -> str:
    """A role with CREATE on the database makes schema pgque first, with a
    version() that counts its calls in a sequence (nextval is not rolled back)."""
    squatter = f"pgque_squatter_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {squatter} login")
        su.execute(f"grant create on database {conninfo_to_dict(dsn)['dbname']} to {squatter}")
    with psycopg.connect(_role_dsn(dsn, squatter), autocommit=True) as s:
        s.execute("create schema pgque")
        s.execute("grant usage on schema pgque to public")
        s.execute("create sequence pgque.ran")
        s.execute("grant usage, select on sequence pgque.ran to public")
        s.execute("create table pgque.ran_as (who text, super text)")
        s.execute("grant insert on pgque.ran_as to public")
        s.execute("""create function pgque.version() returns text language plpgsql as $$
                     begin
                         perform nextval('pgque.ran');
                         insert into pgque.ran_as
                         values (current_user, current_setting('is_superuser'));
                         return '0.0.1';
                     end $$""")
    return squatter


def test_install_never_calls_a_squatters_version_function(empty_dsn: str) -> None:
    """A role with CREATE on the database that made schema pgque first, with a
    pgque.version() of its own, gets none of its code run as the installer
    (usually a superuser): install() refuses with PQ013 before anything calls into
    schema pgque. (The squatter's version() counts its calls in a sequence, which
    the refused install's rollback would not undo.)"""
    squatter = _squat(empty_dsn)
    try:
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            with pytest.raises(psycopg.Error) as caught:
                pgque.install(conn)
            assert caught.value.sqlstate == "PQ013"
            assert scalar(conn, "select is_called from pgque.ran") is False, \
                "the squatter's pgque.version() ran as the installer"
    finally:
        drop_role(empty_dsn, squatter)


def test_cli_install_never_calls_a_squatters_version_function(empty_dsn: str) -> None:
    """The same through `pgque install`: it fails, saying why (PQ013), and the
    squatter's version() never ran (it would record, committed, that it ran as the
    installer)."""
    squatter = _squat(empty_dsn)
    try:
        out = run_cli("install", "--dsn", empty_dsn)
        assert out.returncode != 0
        assert "PQ013" in out.stderr or "cannot be installed" in out.stderr, out.stderr
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            ran = conn.execute("select who, super from pgque.ran_as").fetchall()
        assert ran == [], f"the squatter's code ran, committed, as {ran}"
    finally:
        drop_role(empty_dsn, squatter)


# -- objects of others built on pgque's code ---------------------------------------------------


def test_a_table_column_of_an_array_of_pgque_type_is_refused_not_dropped(
        empty_dsn: str) -> None:
    """A user table with a column of type pgque.batch_event[] (the array type of
    pgque's composite type) is built on pgque's code: the install refuses
    (DependentObjects, naming the table), and the column stays."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute("create table public.keep (id int, evs pgque.batch_event[])")
        client.conn.execute("insert into public.keep values (1, array[null::pgque.batch_event])")
        refused = None
        try:
            client.install()
        except pgque.DependentObjects as exc:
            refused = exc
        cols = client.conn.execute(
            "select attname from pg_attribute where attrelid = 'public.keep'::regclass "
            "and attnum > 0 and not attisdropped order by attnum").fetchall()
        assert cols == [("id",), ("evs",)], f"column evs silently dropped: {cols}"
        assert refused is not None and "keep" in str(refused)


def test_a_function_taking_an_array_of_a_pgque_view_row_is_refused(empty_dsn: str) -> None:
    """A user function taking pgque.queue_info[] (the array type of a pgque view's row
    type): the install refuses, naming it, and the function stays."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute("create function public.nqueues(pgque.queue_info[]) returns int "
                            "language sql as $$ select cardinality($1) $$")
        refused = None
        try:
            client.install()
        except pgque.DependentObjects as exc:
            refused = exc
        left = scalar(client.conn, "select to_regprocedure("
                      "'public.nqueues(pgque.queue_info[])') is not null")
        assert left, "public.nqueues silently dropped"
        assert refused is not None and "nqueues" in str(refused)


@pytest.mark.parametrize("ddl, name", [
    ("create table public.t (v text default pgque.version())", "public.t"),
    ("create table public.t (k text, s int generated always as (pgque.slot_of(k, 4)) stored)",
     "public.t"),
    ("create table public.t (v text check (v <> pgque.version()))", "public.t"),
    ("create domain public.ver as text check (value <> pgque.version())", "public.ver"),
    ("create function public.f() returns text begin atomic select pgque.version(); end",
     "public.f"),
    ("create materialized view public.mv as select * from pgque.queue_info", "public.mv"),
    ("create function public.g() returns setof pgque.batch_event language sql "
     "as $$ select null::pgque.batch_event $$", "public.g"),
])
def test_objects_on_pgque_code_are_refused_and_named(empty_dsn: str, ddl: str,
                                                     name: str) -> None:
    """Defaults, generated columns, checks, domains, SQL-body functions, materialized
    views and functions returning pgque's types, built on pgque's code: the install
    refuses (PQ017), names them, and changes nothing."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.conn.execute(ddl)
        before = catalog(client.conn)
        with pytest.raises(pgque.DependentObjects, match=name.split(".")[1]):
            client.install()
        assert catalog(client.conn) == before


def test_a_trigger_calling_pgque_send_survives_installs(empty_dsn: str) -> None:
    """A trigger function (plpgsql) that calls pgque.send has no catalog dependency;
    it keeps working after the install replaces pgque.send."""
    with pgque.connect(empty_dsn) as client:
        client.install()
        client.create_queue("q")
        client.subscribe("q", "c")
        client.conn.execute("create table public.orders (id int)")
        client.conn.execute("""create function public.on_order() returns trigger
            language plpgsql as $$ begin
            perform pgque.send('q', 'order', to_jsonb(new.id), null); return new; end $$""")
        client.conn.execute("create trigger t after insert on public.orders for each row "
                            "execute function public.on_order()")
        client.conn.execute("insert into public.orders values (1)")
        client.install()
        client.conn.execute("insert into public.orders values (2)")
        assert [m.payload for m in drain(client, "q", "c")] == [1, 2]


# -- the printed script run without one transaction ------------------------------------------


@pytest.mark.skipif(shutil.which("psql") is None, reason="no psql")
def test_the_printed_script_without_one_transaction_refuses_clearly(
        empty_dsn: str, tmp_path: Path) -> None:
    """`psql -f pgque.sql` without -1 (or a migration tool running statements in
    autocommit) would run the script one autocommitted statement at a time, under
    the caller's search_path (its SET LOCAL pins nothing outside a transaction
    block): the script refuses at once, saying it needs one transaction, and
    leaves nothing behind."""
    script = tmp_path / "pgque.sql"
    script.write_text(pgque.install_script())
    result = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(script),
                             "-d", empty_dsn], capture_output=True, text=True, timeout=120)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        installed = scalar(conn, "select count(*) from pg_namespace where nspname = 'pgque'")
    assert result.returncode != 0, f"ran outside a transaction: {result.stderr[:300]}"
    assert "transaction" in result.stderr
    assert installed == 0, "left a partial install behind"


@pytest.mark.skipif(shutil.which("psql") is None, reason="no psql")
def test_psql_without_one_transaction_runs_no_plant(empty_dsn: str, tmp_path: Path) -> None:
    """The same, with PLANTS (code another role planted in public) in public and
    public first on the installer's path: none of it runs as the installer."""
    planter = f"pgque_planter_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(empty_dsn, autocommit=True) as su:
        su.execute(f"create role {planter} login")
        su.execute("grant create on schema public to public")
    try:
        with psycopg.connect(_role_dsn(empty_dsn, planter), autocommit=True) as p:
            p.execute("create table public.pwned (what text)")
            p.execute("grant insert on public.pwned to public")
            for plant in PLANTS:
                p.execute(plant)
            p.execute("grant execute on all functions in schema public to public")
        script = tmp_path / "pgque.sql"
        script.write_text(pgque.install_script())
        subprocess.run(["psql", "-X", "-q", "-f", str(script), "-d", empty_dsn],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ,
                            "PGOPTIONS": "-c search_path=public,pg_catalog"})
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            ran = conn.execute("select distinct what from public.pwned").fetchall()
        assert ran == [], f"planted code ran as the installer: {ran}"
    finally:
        drop_role(empty_dsn, planter)


# -- installs racing other work -----------------------------------------------------------------


def _loop(errors: list[BaseException], fn: Any, n: int) -> threading.Thread:
    def run() -> None:
        for _ in range(n):
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
                return
    t = threading.Thread(target=run)
    t.start()
    return t


def test_install_and_uninstall_concurrently(empty_dsn: str) -> None:
    """Installs and uninstalls racing: each call either succeeds or waits; none fails."""
    errors: list[BaseException] = []

    def install() -> None:
        with psycopg.connect(empty_dsn, autocommit=True) as c:
            pgque.install(c)

    def uninstall() -> None:
        with psycopg.connect(empty_dsn, autocommit=True) as c:
            pgque.uninstall(c)

    threads = [_loop(errors, install, 8), _loop(errors, install, 8),
               _loop(errors, uninstall, 8)]
    for t in threads:
        t.join(300)
    assert not errors, errors
    install()
    with pgque.connect(empty_dsn) as client:
        client.create_queue("q")
        assert client.tick("q") > 0


@pytest.mark.superuser_install  # it installs again as the superuser
def test_install_while_maintenance_rotates(dsn: str) -> None:
    """Workers may keep running through an install (an upgrade), so installs while
    maintenance rotates event tables, as every running Worker's ticker does, all
    succeed: no "tuple concurrently updated", no deadlock."""
    with pgque.connect(dsn) as client:
        for n in range(4):
            client.create_queue(f"r{n}", rotation_period="1 second", event_tables=3)

    def rotate() -> None:
        with pgque.connect(dsn) as client:
            for n in range(4):
                client.send(f"r{n}", "e", 1)
                client.tick(f"r{n}")
            client.conn.execute("update pgque.queue set queue_switch_time = "
                                "queue_switch_time - interval '1 hour'")
            client.maintenance()

    failed, _ = installs_under(dsn, rotate, 25)
    assert failed == [], failed


@pytest.mark.superuser_install  # it installs again as the superuser
def test_install_while_queues_are_created_and_dropped(dsn: str) -> None:
    """The same while an admin creates and drops queues: every install succeeds, and
    no create or drop fails with "tuple concurrently updated"."""
    def churn() -> None:
        with pgque.connect(dsn) as client:
            name = f"q{uuid.uuid4().hex[:6]}"
            client.create_queue(name)
            client.drop_queue(name, force=True)

    failed, side = installs_under(dsn, churn, 25)
    assert failed == [], failed
    assert not [e for e in side if "concurrently updated" in e], side


@pytest.mark.superuser_install  # it installs again as the superuser
def test_the_install_drops_views_whose_dependencies_it_dropped_first(
        conn: psycopg.Connection[Any]) -> None:
    """Views of schema pgque that depend on one another (pgque._consumer_info on
    pgque._retry_waiting; here thirty pairs, beyond the rows the drop loop reads
    at once): dropping one cascades to the other before the loop reaches it,
    and the install still drops and replaces everything (it once named the view
    gone by its number: a syntax error, seen in a concurrent install)."""
    for n in range(30):
        conn.execute(f"create view pgque.zz_base_{n} as select 1 as one")
        conn.execute(f"create view pgque.zz_dep_{n} as select * from pgque.zz_base_{n}")
    pgque.install(conn)
    assert scalar(conn, "select count(*) from pg_class where relname like 'zz\\_%%'") == 0
    assert scalar(conn, "select count(*) from pgque.consumer_info") == 0
