"""Installing: idempotent, concurrent-safe, and possible for a non-superuser owner."""

from __future__ import annotations

import shutil
import subprocess
import threading
import uuid
from pathlib import Path

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
