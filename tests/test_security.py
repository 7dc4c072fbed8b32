"""Privileges: reader, writer and admin roles; nothing for PUBLIC; pinned search_path."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import refused, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


@pytest.fixture
def users(dsn: str) -> Iterator[dict[str, pgque.Client]]:
    """Login users that are members of each pgque role, and one of none."""
    suffix = uuid.uuid4().hex[:8]
    params = conninfo_to_dict(dsn)
    kinds = ("reader", "writer", "admin", "nobody")
    names = {kind: f"pgque_test_{kind}_{suffix}" for kind in kinds}
    clients: dict[str, pgque.Client] = {}
    with psycopg.connect(dsn, autocommit=True) as su:
        for kind, name in names.items():
            su.execute(f"create role {name} login")
            if kind != "nobody":
                su.execute(f"grant pgque_{kind} to {name}")
        su.execute("select pgque.create_queue('q')")
        try:
            for kind, name in names.items():
                clients[kind] = pgque.connect(make_conninfo(**{**params, "user": name}))
            clients["reader"].subscribe("q", "c")  # the reader's own consumer
            yield clients
        finally:
            for client in clients.values():
                client.close()
            for name in names.values():
                su.execute(f"drop role if exists {name}")




def test_writer_sends_only(users: dict[str, pgque.Client]) -> None:
    writer = users["writer"]
    assert writer.send("q", "e", 1) > 0
    assert writer.send_batch("q", [("e", 2)])
    # Delayed and idempotent sends (send_with, send_batch_with) too, and their
    # tables are as closed to it as the log's.
    assert writer.send("q", "e", 3, deliver_after=60, idempotency_key="w").deliver_at
    assert writer.send_batch("q", [pgque.Event("e", 4, idempotency_key="w")])[0].duplicate
    assert refused(lambda: writer.conn.execute("select * from pgque.delayed_event"))
    assert refused(lambda: writer.conn.execute("select * from pgque.idempotency_key"))
    assert refused(lambda: writer.receive("q", "c"))
    assert refused(lambda: writer.subscribe("q", "w"))
    assert refused(lambda: writer.create_queue("w"))
    assert refused(lambda: writer.conn.execute("select * from pgque.subscription"))


def test_reader_consumes_only(users: dict[str, pgque.Client]) -> None:
    users["admin"].send("q", "e", 1)
    users["admin"].tick("q")
    reader = users["reader"]
    batch = reader.receive("q", "c")
    assert batch is not None and len(batch) == 1
    assert reader.ack(batch) is True
    assert reader.subscribe("q", "r") is True
    assert reader.consumer_info("q")
    assert refused(lambda: reader.send("q", "e", 1))
    assert refused(lambda: reader.send("q", "e", 1, deliver_after=60))
    assert refused(lambda: reader.send_batch("q", [pgque.Event("e", 1, idempotency_key="r")]))
    assert refused(lambda: reader.create_queue("r"))
    assert refused(lambda: reader.maintenance())
    assert refused(lambda: reader.conn.execute("select * from pgque.event_1"))


def test_admin_does_everything(users: dict[str, pgque.Client]) -> None:
    admin = users["admin"]
    admin.create_queue("other")
    admin.subscribe("other", "x")
    admin.send("other", "e", 1)
    admin.tick("other")
    batch = admin.receive("other", "x")
    assert batch is not None and admin.ack(batch)
    admin.maintenance()
    assert admin.ticker() >= 0
    admin.unsubscribe("other", "x")
    admin.drop_queue("other")
    # Internal helpers are not part of the interface, even for admins.
    assert refused(lambda: admin.conn.execute("select pgque._random_key()"))
    assert refused(lambda: admin.conn.execute("delete from pgque.tick"))


def test_public_gets_nothing(users: dict[str, pgque.Client]) -> None:
    nobody = users["nobody"]
    assert refused(lambda: nobody.send("q", "e", 1))
    assert refused(lambda: nobody.receive("q", "c"))
    assert refused(lambda: nobody.conn.execute("select * from pgque.queue"))


def test_security_definer_functions_pin_search_path(conn: psycopg.Connection[Any]) -> None:
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.prosecdef, p.proconfig from pg_proc p "
        "where p.pronamespace = 'pgque'::regnamespace").fetchall()
    definers = [r for r in rows if r[1]]
    assert len(definers) > 15
    unpinned = [name for name, _, config in definers
                if not config or "search_path=pg_catalog, pg_temp" not in config]
    assert unpinned == []


def test_hostile_search_path_is_ignored(users: dict[str, pgque.Client], dsn: str) -> None:
    """A caller's own function shadowing a catalog function is never called by pgque."""
    writer = users["writer"]
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute("create schema if not exists evil")
        su.execute("create or replace function evil.now() returns timestamptz "
                   "language sql as $$ select 'epoch'::timestamptz $$")
        su.execute("grant usage on schema evil to public")
    writer.conn.execute("set search_path = evil, pg_catalog")
    ev = writer.send("q", "e", 1)
    with psycopg.connect(dsn, autocommit=True) as su:
        row = su.execute("select ev_time > 'epoch'::timestamptz + interval '1 year' "
                         "from pgque.event_1 where ev_id = %s", (ev,)).fetchone()
    assert row == (True,)


def test_reader_role_ticker_gives_up_instead_of_looping(users: dict[str, pgque.Client],
                                                        dsn: str) -> None:
    """A worker running as a reader may not tick: its ticker must say so and stop,
    not reconnect in a tight loop holding the election lock."""
    reader_dsn = users["reader"].conn.info.dsn
    ticker = pgque.Ticker(reader_dsn, maintenance_interval=0)
    ticker.start()
    wait_for(lambda: not ticker.alive, timeout=10, what="the reader's ticker to give up")
    assert not ticker.active and ticker.ticks == 0


# A procedure that commits may not carry a SET clause (PostgreSQL refuses the
# COMMIT), so the ticker loop cannot pin its search_path: every name and
# operator in it is schema-qualified instead (test_ticker_loop_ignores_...).
COMMITTING_PROCEDURES = {"pgque.ticker_loop(double precision,integer)"}


def test_every_routine_pins_search_path(conn: psycopg.Connection[Any]) -> None:
    """Not only the SECURITY DEFINER ones: a helper without a pinned path runs
    with its caller's, which may be pg_cron's (the installer's) or a view's."""
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.proconfig from pg_proc p "
        "where p.pronamespace = 'pgque'::regnamespace order by 1").fetchall()
    assert len(rows) > 40
    unpinned = {name for name, config in rows
                if not config or "search_path=pg_catalog, pg_temp" not in config}
    assert unpinned == COMMITTING_PROCEDURES


def test_every_public_routine_turns_jit_off(conn: psycopg.Connection[Any]) -> None:
    """pgque's statements are small, but the planner's guesses for functions
    returning sets (1,000 rows each) put some over jit_above_cost: on a server
    built with LLVM (Debian's), partition_slot_status spent 0.4 s compiling
    what ran in 10 ms. The entry points turn it off for all they call."""
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.proconfig from pg_proc p "
        "where p.pronamespace = 'pgque'::regnamespace and p.proname !~ '^_'"
        " order by 1").fetchall()
    assert len(rows) > 40
    compiling = {name for name, config in rows if not config or "jit=off" not in config}
    assert compiling == COMMITTING_PROCEDURES


def _plant(dsn: str, statements: list[str]) -> str:
    """Make a login role with no pgque grant and run statements as it; returns its name."""
    role = f"pgque_planter_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute("grant create on schema public to public")  # PostgreSQL 14's default
    params = conninfo_to_dict(dsn)
    with psycopg.connect(make_conninfo(**{**params, "user": role}), autocommit=True) as p:
        p.execute("create table public.pwned (what text)")
        p.execute("grant insert on public.pwned to public")
        for statement in statements:
            p.execute(statement)
        p.execute("grant execute on all functions in schema public to public")
    return role


def _drop_planter(dsn: str, role: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"drop owned by {role} cascade")
        su.execute(f"drop role if exists {role}")


def test_ticker_loop_ignores_planted_operators(dsn: str) -> None:
    """pg_cron runs the loop as the installer with the job's search_path: an operator
    planted in public (one that matches better than pg_catalog's, or the same one
    earlier on the path) must never run."""
    role = _plant(dsn, [
        """create function public.pwn_div(integer, numeric) returns numeric language plpgsql as $$
           begin insert into public.pwned values ('/');
           return pg_catalog.numeric_div($1::numeric, $2); end $$""",
        "create operator public./ (leftarg = integer, rightarg = numeric, "
        "function = public.pwn_div)",
        """create function public.pwn_lt(timestamptz, timestamptz) returns boolean
           language plpgsql as $$
           begin insert into public.pwned values ('<');
           return pg_catalog.timestamptz_lt($1, $2); end $$""",
        "create operator public.< (leftarg = timestamptz, rightarg = timestamptz, "
        "function = public.pwn_lt)",
    ])
    try:
        with psycopg.connect(dsn, autocommit=True) as su:
            su.execute("set search_path = public, pg_catalog")
            su.execute("call pgque.ticker_loop(0.2, 50)")
            assert su.execute("select what from public.pwned").fetchall() == []
    finally:
        _drop_planter(dsn, role)


def test_admin_may_run_the_ticker_loop(users: dict[str, pgque.Client]) -> None:
    """docs/api.md: admins run ticker_loop (what pg_cron's job calls)."""
    admin = users["admin"]
    admin.send("q", "e", 1)
    admin.conn.execute("call pgque.ticker_loop(0.2, 50)")
    batch = admin.receive("q", "c")
    assert batch is not None and len(batch) == 1
