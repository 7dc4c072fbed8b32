"""Installing: idempotent, concurrent-safe, and possible for a non-superuser owner."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
from helpers import drain
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

CATALOG_QUERIES = {
    "functions": """
        select p.oid::regprocedure::text, pg_get_functiondef(p.oid), p.proacl::text,
               p.prosecdef, p.proconfig::text
          from pg_proc p where p.pronamespace = 'pgque'::regnamespace order by 1""",
    "relations": """
        select c.relname, c.relkind, c.reloptions::text, c.relacl::text,
               a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
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
    return {name: conn.execute(sql).fetchall() for name, sql in CATALOG_QUERIES.items()}


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
