"""Generated code (pgque/sql/code/generated/): the event writer, each queue's
batch reader and slot indexes are current after an install, after create_queue
and drop_queue, and after maintenance; one that lags shows in
pgque.generated_code and in `pgque status`, and what it serves still works."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
from helpers import run_cli, scalar, wait_for

import pgque
from pgque.testing import Deployment


def _lagging(conn: psycopg.Connection[Any]) -> list[tuple[str, str | None]]:
    return [(kind, queue) for kind, queue, _name, current in
            conn.execute("select * from pgque.generated_code").fetchall() if not current]


def _kinds(conn: psycopg.Connection[Any]) -> list[tuple[str, str | None]]:
    return [(kind, queue) for kind, queue, _name, _current in
            conn.execute("select * from pgque.generated_code").fetchall()]


def test_every_generator_is_current_after_create_and_drop_queue(
        conn: psycopg.Connection[Any]) -> None:
    assert _kinds(conn) == [("event writer", None)] and _lagging(conn) == []
    conn.execute("select pgque.create_queue('a')")
    conn.execute("select pgque.create_queue('b')")
    assert _kinds(conn) == [("event writer", None), ("batch reader", "a"), ("slot indexes", "a"),
                            ("batch reader", "b"), ("slot indexes", "b")]
    assert _lagging(conn) == []
    conn.execute("select pgque.drop_queue('a')")
    assert _kinds(conn) == [("event writer", None), ("batch reader", "b"), ("slot indexes", "b")]
    assert _lagging(conn) == []
    assert scalar(conn, "select count(*) from pg_proc where proname ~ '^_batch_reader_[0-9]+$'"
                        " and pronamespace = 'pgque'::regnamespace") == 1


def test_a_new_group_lags_until_maintenance_writes_its_code(
        conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    # subscribe touches no event table and writes no code: maintenance does.
    assert _lagging(conn) == [("batch reader", "q"), ("slot indexes", "q")]
    conn.execute("select pgque.send('q', 't', '[1]', 'k')")
    conn.execute("select pgque.tick('q')")
    steps = {step for _q, step, _n in conn.execute("select * from pgque.maint()").fetchall()}
    assert {"batch_reader", "slot_indexes"} <= steps
    assert _lagging(conn) == []


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_writes_every_generator_again(dsn: str,
                                                 conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    conn.execute("select * from pgque.maint()")
    before = {name: oid for name, oid in conn.execute(
        "select proname, oid from pg_proc where pronamespace = 'pgque'::regnamespace"
        " and (proname = '_write_event' or proname ~ '^_batch_reader_[0-9]+$')")}
    with psycopg.connect(dsn) as other:
        pgque.install(other)
    after = {name: oid for name, oid in conn.execute(
        "select proname, oid from pg_proc where pronamespace = 'pgque'::regnamespace"
        " and (proname = '_write_event' or proname ~ '^_batch_reader_[0-9]+$')")}
    assert sorted(after) == sorted(before)
    assert all(after[name] != before[name] for name in after), "dropped and written again"
    assert _lagging(conn) == []


def test_a_lagging_reader_is_slower_never_wrong(conn: psycopg.Connection[Any]) -> None:
    """A reader dropped by hand is due; the batch reads the same events without it."""
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe('q', 'c')")
    reader = scalar(conn, "select pgque._batch_reader_name(queue_id) from pgque.queue")
    conn.execute(f"drop function pgque.{reader}")
    assert _lagging(conn) == [("batch reader", "q")]
    conn.execute("select pgque.send('q', 't', '[1]', 'k')")
    conn.execute("select pgque.tick('q')")
    assert [r[0] for r in conn.execute("select ev_data from pgque.receive('q', 'c')")] == ["[1]"]
    conn.execute("select * from pgque.maint()")
    assert _lagging(conn) == []


def test_status_names_the_code_that_lags(dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    conn.execute("select pgque.subscribe_slots('q', 'g', 4)")
    with pgque.connect(dsn) as client:
        lagging = [(g.kind, g.queue_name) for g in client.generated_code() if not g.current]
    assert lagging == [("batch reader", "q"), ("slot indexes", "q")]
    from pgque import cli, display
    with pgque.connect(dsn) as client:
        view = display.status_view(*cli._status(client, None, None))
    from rich.console import Console
    console = Console(width=400, record=True)
    console.print(view)
    text = console.export_text()
    assert "lagging: batch reader of q, slot indexes of q" in text
    conn.execute("select * from pgque.maint()")
    with pgque.connect(dsn) as client:
        view = display.status_view(*cli._status(client, None, None))
    console = Console(width=400, record=True)
    console.print(view)
    assert "lagging" not in console.export_text()


def test_maintenance_goes_on_while_an_install_waits_for_a_readers_view(
        pgque_deployment: Deployment) -> None:
    """An install waits for a team session that read an info view in a
    transaction still open (DROP VIEW needs its lock). Meanwhile the Ticker's
    maintenance goes on: a nacked event comes back. The install holds only the
    generators' lock while it waits, no queue's maintenance lock."""
    dep = pgque_deployment
    billing, shipping = dep.teams
    with pgque.connect(dep.dsn(dep.owner)) as owner, \
            pgque.connect(dep.dsn(dep.login(billing))) as team, \
            pgque.connect(dep.dsn(dep.ticker)) as ticker, \
            psycopg.connect(dep.dsn(dep.login(shipping))) as monitor, \
            psycopg.connect(dep.superuser_dsn(), autocommit=True) as su:
        owner.create_queue("q")
        team.conn.execute(f"set role {billing}")
        team.subscribe_slots("q", "g", slots=2)
        team.conn.execute("reset role")
        ticker.maintenance()
        sent = owner.send("q", "e", 1, partition_key="k")
        owner.tick("q")
        slot = scalar(owner.conn, "select pgque.slot_of('k', 2)")
        assert team.claim_slot("q", "g", slot)
        batch = team.receive_partitioned("q", "g", slot=slot, slots=2)
        assert batch is not None and [m.id for m in batch] == [sent]
        team.ack(batch, nack=batch.messages)  # retry_after 0: due at once
        monitor.execute("select * from pgque.consumer_info").fetchall()  # left open
        result: dict[str, str] = {}

        def install() -> None:
            with psycopg.connect(dep.dsn(dep.owner), autocommit=True) as c:
                try:
                    pgque.install(c)
                    result["install"] = "ok"
                except psycopg.Error as exc:
                    result["install"] = repr(exc)

        thread = threading.Thread(target=install)
        thread.start()
        try:
            wait_for(lambda: scalar(su, "select count(*) from pg_stat_activity"
                                        " where usename = %s and wait_event_type = 'Lock'",
                                    (dep.owner,)) > 0, what="the install to wait")
            steps = ticker.maintenance()
        finally:
            monitor.rollback()
            thread.join(60)
        assert result == {"install": "ok"}
        assert ("q", "retry", 1) in steps, steps


def test_a_dropped_queues_reader_goes_with_the_next_maintenance(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """drop_queue drops its queue's reader when the generators' lock is free;
    when another transaction holds it, the reader stays until maintenance,
    and shows as lagging meanwhile."""
    conn.execute("select pgque.create_queue('q')")
    reader = scalar(conn, "select pgque._batch_reader_name(queue_id) from pgque.queue")
    with psycopg.connect(dsn) as holder:
        assert scalar(holder, "select pgque._lock_generators(false)")
        conn.execute("select pgque.drop_queue('q')")
        holder.rollback()
    # Neither could the writer be written without the dropped queue.
    assert sorted(_lagging(conn)) == [("batch reader", None), ("event writer", None)]
    assert scalar(conn, "select count(*) from pg_proc where proname = %s", (reader,)) == 1
    steps = conn.execute("select step, amount from pgque.maint()").fetchall()
    assert ("batch_reader", 1) in steps
    assert _lagging(conn) == []
    assert scalar(conn, "select count(*) from pg_proc where proname = %s", (reader,)) == 0


# -- who may run generated code ------------------------------------------------------------


def _exercised(dep: Deployment) -> None:
    """Every kind of generated code written: queues, groups of several counts,
    maintenance, an install, a dropped queue."""
    team = dep.teams[0]
    with pgque.connect(dep.dsn(dep.owner)) as owner:
        owner.create_queue("q")
        owner.create_queue("gone")
        owner.create_queue("secret")
        with pgque.connect(dep.dsn(dep.login(team))) as t:
            t.conn.execute(f"set role {team}")
            t.subscribe_slots("q", "g", slots=4)
            t.subscribe_slots("secret", "s", slots=3)
        owner.maintenance()
        pgque.install(owner.conn)
        owner.drop_queue("gone")
        owner.maintenance()


def test_no_role_but_the_owner_may_run_internal_or_generated_code(
        pgque_deployment: Deployment) -> None:
    """Internal functions (leading underscore: the generators, the batch readers,
    the event writer, _run_reader...) are executable by the owner only: not by
    PUBLIC, nor any role of the deployment, nor the pgque roles."""
    dep = pgque_deployment
    _exercised(dep)
    roles = [dep.ticker, dep.producer, dep.outsider, *dep.teams,
             *(dep.login(t) for t in dep.teams), "pgque_reader", "pgque_writer", "pgque_admin"]
    with psycopg.connect(dep.superuser_dsn(), autocommit=True) as su:
        public = su.execute("""
            select p.oid::regprocedure::text from pg_proc p
             where p.pronamespace = 'pgque'::regnamespace
               and (p.proacl is null
                    or exists (select 1 from aclexplode(p.proacl) a where a.grantee = 0))
             order by 1""").fetchall()
        callable_ = su.execute("""
            select r.rolname, p.oid::regprocedure::text from pg_proc p cross join pg_roles r
             where p.pronamespace = 'pgque'::regnamespace and p.proname ~ '^_'
               and r.rolname = any(%s) and has_function_privilege(r.oid, p.oid, 'execute')
             order by 1, 2""", (roles,)).fetchall()
    assert public == []
    assert callable_ == []


def test_every_routine_pins_its_search_path(pgque_deployment: Deployment) -> None:
    """Every SECURITY DEFINER routine pins search_path, and so does every other
    routine of pgque (generated ones included): none runs with the caller's, but
    ticker_loop, a procedure that commits (cron.sql: it may not pin it, and
    qualifies every name instead)."""
    dep = pgque_deployment
    _exercised(dep)
    with psycopg.connect(dep.superuser_dsn(), autocommit=True) as su:
        unpinned = su.execute("""
            select p.oid::regprocedure::text, p.prosecdef from pg_proc p
             where p.pronamespace = 'pgque'::regnamespace
               and p.oid <> 'pgque.ticker_loop(double precision, integer)'::regprocedure
               and not exists (select 1 from unnest(p.proconfig) c
                                where c like 'search_path=pg_catalog, pg_temp'
                                   or c like 'search_path=pg_catalog,pg_temp'
                                   or c = 'search_path=pg_catalog, pg_temp')
             order by 1""").fetchall()
    assert unpinned == []


CRAFTED = [
    # Another team's events through a crafted read request.
    "select pgque._run_reader({id}, row(null, null, null, null, null, 0, null, null, null,"
    " null, null, null, null, null, false)::pgque.read_request)",
    "select pgque._batch_reader_{id}(row(null, null, null, null, null, 0, null, null, null,"
    " null, null, null, null, null, false)::pgque.read_request)",
    "select pgque._write_generated('_batch_reader_{id}', 'p_read pgque.read_request',"
    " 'returns pgque.event_template[] language plpgsql', 'x', 'begin return null; end')",
    "select pgque._write_generated('pwn', '', 'returns int language sql security definer',"
    " 'x', 'select 1')",
    "select pgque._drop_generated('_batch_reader_{id}')",
    "select pgque._drop_generated('send')",
    "select pgque._generated_due('_write_event', 'x')",
    "select pgque._generated_signature('_write_event')",
    "select * from pgque._generated_code()",
    "select pgque._sync_event_writer(true)",
    "select pgque._sync_batch_reader({id}, true)",
    "select pgque._lock_generators(true)",
    "select pgque._drop_orphan_readers(true)",
    "select pgque._write_event({id}, 0, 't', '1', 'k')",
    "select pgque._batch_events({id}, 1, null, null, 0, null, null, null)",
]


@pytest.mark.parametrize("who", ["team", "producer", "ticker", "outsider"])
def test_crafted_calls_of_internal_code_are_refused(pgque_deployment: Deployment, who: str) -> None:
    """No login of the deployment may run internal or generated code, with a
    crafted read request or otherwise: each call is refused, and no routine
    changes."""
    dep = pgque_deployment
    _exercised(dep)
    login = {"team": dep.login(dep.teams[1]), "producer": dep.producer, "ticker": dep.ticker,
             "outsider": dep.outsider}[who]
    with psycopg.connect(dep.superuser_dsn(), autocommit=True) as su:
        queue_id = scalar(su, "select queue_id from pgque.queue where queue_name = 'secret'")
        before = su.execute("select p.oid, p.prosrc from pg_proc p"
                            " where p.pronamespace = 'pgque'::regnamespace order by 1").fetchall()
    allowed: list[str] = []
    with psycopg.connect(dep.dsn(login), autocommit=True) as c:
        for statement in CRAFTED:
            try:
                c.execute(statement.format(id=queue_id))
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedFunction,
                    psycopg.errors.UndefinedObject, psycopg.errors.InvalidSchemaName):
                continue
            allowed.append(statement)
    with psycopg.connect(dep.superuser_dsn(), autocommit=True) as su:
        after = su.execute("select p.oid, p.prosrc from pg_proc p"
                           " where p.pronamespace = 'pgque'::regnamespace order by 1").fetchall()
    assert allowed == []
    assert after == before


# -- who sees generated code ---------------------------------------------------------------


def test_generated_code_shows_each_role_the_queues_queue_info_shows_it(
        pgque_deployment: Deployment) -> None:
    """A queue restricted to billing (send and consume) is hidden from shipping in
    queue_info, and so in generated_code and its function, by name and by the id
    in a generated function's name; billing, the producer-less reader and the
    owner each see in generated_code exactly the queues queue_info shows them;
    a role outside pgque (and a mere writer) may read neither."""
    dep = pgque_deployment
    billing, shipping = dep.teams
    with pgque.connect(dep.dsn(dep.owner)) as owner:
        owner.create_queue("open")
        secret_id = owner.create_queue("secret")
        owner.create_queue("sendonly")
        owner.grant_queue("secret", billing, "send")
        owner.grant_queue("secret", billing, "consume")
        owner.grant_queue("sendonly", billing, "consume")  # shipping may send, not consume
        with pgque.connect(dep.dsn(dep.login(billing))) as b:
            b.conn.execute(f"set role {billing}")
            b.subscribe_slots("secret", "s", slots=4)  # secret's code lags until maintenance
    seen: dict[str, tuple[set[str], set[str | None], list[str]]] = {}
    for who, login in (("owner", dep.owner), ("billing", dep.login(billing)),
                       ("shipping", dep.login(shipping)), ("ticker", dep.ticker)):
        with psycopg.connect(dep.dsn(login), autocommit=True) as c:
            info = {r[0] for r in c.execute("select queue_name from pgque.queue_info")}
            code = {r[0] for r in c.execute("select queue_name from pgque.generated_code")}
            fn = {r[0] for r in c.execute("select queue_name from pgque.get_generated_code()")}
            names = [r[0] for r in c.execute("select name from pgque.generated_code")]
            assert code == fn
            seen[who] = (info, code, names)
    for who, (info, code, _names) in seen.items():
        assert code == info | {None}, who
    assert "secret" not in seen["shipping"][0]
    assert not [n for n in seen["shipping"][2] if n.endswith(f"_{secret_id}")
                or f"_{secret_id}_" in n], seen["shipping"][2]
    for login in (dep.outsider, dep.producer):
        with psycopg.connect(dep.dsn(login), autocommit=True) as c:
            for statement in ("select * from pgque.generated_code",
                              "select * from pgque.get_generated_code()"):
                with pytest.raises((psycopg.errors.InsufficientPrivilege,)):
                    c.execute(statement)


def test_status_json_as_a_team_shows_its_generated_code_and_no_other_queue(
        pgque_deployment: Deployment) -> None:
    """`pgque status --json` under a team's login: exit 0, the document's
    `generated` lists the event writer and the code of the queues the team may
    see (those of `queues`), none of another team's restricted queue; the
    summary in the text view works too; `pgque status secret` is 'does not
    exist' for the team that may not see it."""
    dep = pgque_deployment
    billing, shipping = dep.teams
    with pgque.connect(dep.dsn(dep.owner)) as owner:
        owner.create_queue("open")
        owner.create_queue("secret")
        owner.grant_queue("secret", billing, "send")
        owner.grant_queue("secret", billing, "consume")
    with pgque.connect(dep.dsn(dep.login(shipping))) as s:
        s.conn.execute(f"set role {shipping}")
        s.subscribe_slots("open", "ship", slots=4)  # its code lags: status names it
    out = run_cli("status", "--json", "--dsn", dep.dsn(dep.login(shipping)))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {q["queue_name"] for q in doc["queues"]} == {"open"}
    assert {g["queue_name"] for g in doc["generated"]} == {None, "open"}
    assert any(not g["current"] for g in doc["generated"])
    text = run_cli("status", "--dsn", dep.dsn(dep.login(shipping)))
    assert text.returncode == 0, text.stderr
    assert "lagging" in text.stdout and "secret" not in text.stdout
    one = run_cli("status", "secret", "--dsn", dep.dsn(dep.login(shipping)))
    assert one.returncode == 1 and "does not exist" in one.stderr, one.stderr
    # The producer (a writer only) gets one line, not a traceback.
    prod = run_cli("status", "--dsn", dep.dsn(dep.producer))
    assert prod.returncode == 1 and len(prod.stderr.strip().splitlines()) == 1, prod.stderr
