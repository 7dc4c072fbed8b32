"""The event writer (pgque/sql/code/generated/event_writer.sql): one generated function
holding every event table's INSERT as static SQL, so that a send plans nothing.
create_queue and drop_queue write it again when no one else is writing it,
maintenance when they could not; a writer that lags behind the queues makes
sends slower, never wrong. Sends land in their queue's current table while
queues come and go, tables rotate and installs run; create_queue(exist_ok) of
an existing queue waits for no other create, and no lock order of create_queue,
drop_queue and ticks deadlocks."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import installs_under, scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

DOCS = Path(__file__).resolve().parent.parent / "docs"

WRITE = "select pgque._write_event(%s, %s, 'e', '{}', null, null)"


def writer_source(conn: psycopg.Connection[Any]) -> str:
    return str(scalar(conn, "select prosrc from pg_proc"
                            " where pronamespace = 'pgque'::regnamespace"
                            "   and proname = '_write_event'"))


def table_of(conn: psycopg.Connection[Any], queue_id: int, event_id: int) -> str | None:
    """The name of the queue's event table holding the event, or None."""
    row = conn.execute(f"select tableoid::regclass::text from pgque.event_{queue_id}"
                       " where ev_id = %s", (event_id,)).fetchone()
    return None if row is None else str(row[0])


def send_to_every_table(conn: psycopg.Connection[Any], queue: str, queue_id: int,
                        tables: int) -> None:
    """A send while each of the queue's tables is the current one lands in it."""
    for n in range(tables):
        conn.execute("update pgque.queue set queue_cur_table = %s where queue_id = %s",
                     (n, queue_id))
        event_id = scalar(conn, "select pgque.send(%s, 'e', '{}')", (queue,))
        assert table_of(conn, queue_id, event_id) == f"pgque.event_{queue_id}_{n}"


def test_the_writer_knows_every_queue_and_table_and_nothing_else(
        conn: psycopg.Connection[Any]) -> None:
    assert scalar(conn, WRITE, (1, 0)) is None  # no queue yet
    first = scalar(conn, "select pgque.create_queue('a')")
    second = scalar(conn, "select pgque.create_queue('b', '{\"event_tables\": 5}')")
    assert not scalar(conn, "select pgque._event_writer_due()")
    send_to_every_table(conn, "a", first, 3)
    send_to_every_table(conn, "b", second, 5)
    # Direct calls: each table of each queue, and null for what does not exist.
    for queue_id, tables in ((first, 3), (second, 5)):
        for n in range(tables):
            event_id = scalar(conn, WRITE, (queue_id, n))
            assert table_of(conn, queue_id, event_id) == f"pgque.event_{queue_id}_{n}"
        assert scalar(conn, WRITE, (queue_id, tables)) is None
        assert scalar(conn, WRITE, (queue_id, -1)) is None
    assert scalar(conn, WRITE, (second + 1, 0)) is None
    assert scalar(conn, WRITE, (None, 0)) is None


def test_drop_queue_takes_its_tables_out_of_the_writer(conn: psycopg.Connection[Any]) -> None:
    kept = scalar(conn, "select pgque.create_queue('kept')")
    gone = scalar(conn, "select pgque.create_queue('gone')")
    assert f"event_{gone}_0" in writer_source(conn)
    conn.execute("select pgque.drop_queue('gone')")
    assert f"event_{gone}_" not in writer_source(conn)
    assert f"event_{kept}_0" in writer_source(conn)
    assert not scalar(conn, "select pgque._event_writer_due()")
    send_to_every_table(conn, "kept", kept, 3)


@given(keep=st.lists(st.booleans(), min_size=1, max_size=40))
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_tree_of_queue_ids_finds_every_queue(conn: psycopg.Connection[Any],
                                                  keep: list[bool]) -> None:
    """Queues made and some dropped, leaving sparse ids: the binary tree of IFs on
    the queue id reaches each queue left, and no dropped one."""
    conn.execute("select pgque.drop_queue(queue_name, true) from pgque.queue")
    ids = [scalar(conn, "select pgque.create_queue(%s)", (f"q{i}",)) for i in range(len(keep))]
    for i, kept in enumerate(keep):
        if not kept:
            conn.execute("select pgque.drop_queue(%s)", (f"q{i}",))
    assert not scalar(conn, "select pgque._event_writer_due()")
    for i, queue_id in enumerate(ids):
        event_id = scalar(conn, WRITE, (queue_id, 1))
        if keep[i]:
            assert table_of(conn, queue_id, event_id) == f"pgque.event_{queue_id}_1"
        else:
            assert event_id is None


def test_a_writer_that_lags_makes_sends_slower_not_wrong(conn: psycopg.Connection[Any]) -> None:
    """A writer that knows no queue (as one written by hand, or by a drop_queue
    in a REPEATABLE READ transaction): sends insert with dynamic SQL, into
    the same table, and the writer is due."""
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    conn.execute("create or replace function pgque._write_event(p_queue_id integer,"
                 " p_table integer, p_type text, p_data text, p_key text, p_id bigint)"
                 " returns bigint language sql as 'select null::bigint'")
    assert scalar(conn, "select pgque._event_writer_due()")
    send_to_every_table(conn, "q", queue_id, 3)
    event_id = scalar(conn, "select pgque.send('q', 't', '{\"a\": 1}', 'k')")
    row = conn.execute(f"select ev_type, ev_data, ev_extra1 from pgque.event_{queue_id}"
                       " where ev_id = %s", (event_id,)).fetchone()
    assert row == ("t", '{"a": 1}', "k")
    conn.execute("select pgque.create_queue('other')")  # writes it again
    assert not scalar(conn, "select pgque._event_writer_due()")


def test_a_drop_in_repeatable_read_lags_then_catches_up(dsn: str,
                                                       conn: psycopg.Connection[Any]) -> None:
    """A drop_queue whose snapshot predates another queue writes a writer
    without that queue (create_queue refuses REPEATABLE READ: it ticks): the
    other queue's sends still land where they belong."""
    conn.execute("select pgque.create_queue('doomed')")
    with psycopg.connect(dsn) as old:
        old.execute("set transaction isolation level repeatable read")
        old.execute("select 1")  # the snapshot is taken here
        later = scalar(conn, "select pgque.create_queue('later')")
        old.execute("select pgque.drop_queue('doomed')")
        old.commit()
    assert f"event_{later}_0" not in writer_source(conn)
    assert scalar(conn, "select pgque._event_writer_due()")
    send_to_every_table(conn, "later", later, 3)
    conn.execute("select pgque.create_queue('third')")
    assert f"event_{later}_0" in writer_source(conn)
    assert not scalar(conn, "select pgque._event_writer_due()")


def test_concurrent_creates_and_drops_never_wait_and_maintenance_catches_up(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A create_queue (then a drop_queue) while another transaction's, which wrote
    the writer, is open: it does not wait (two CREATE OR REPLACE of one function
    would fail with "tuple concurrently updated", and a wait could close a cycle
    of locks), leaves the writer due, and the next maint() writes it."""
    conn.execute("select pgque.create_queue('doomed')")
    for statements in (("select pgque.create_queue('one')", "select pgque.create_queue('two')"),
                       ("select pgque.drop_queue('one')", "select pgque.drop_queue('doomed')")):
        with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
            second.execute("set lock_timeout = '5s'")
            first.execute(statements[0])  # wrote the writer; its transaction stays open
            second.execute(statements[1])  # neither waits nor fails
            second.commit()
            first.commit()
        assert scalar(conn, "select pgque._event_writer_due()")
        steps = conn.execute("select queue_name, step, amount from pgque.maint()").fetchall()
        assert (None, "event_writer", 1) in steps
        assert not scalar(conn, "select pgque._event_writer_due()")
        assert conn.execute("select * from pgque.maint()").fetchall() == []
    names = [row[0] for row in conn.execute("select queue_name from pgque.queue"
                                            " order by queue_name")]
    assert names == ["two"]
    two = scalar(conn, "select queue_id from pgque.queue where queue_name = 'two'")
    assert f"event_{two}_0" in writer_source(conn)
    send_to_every_table(conn, "two", two, 3)


def test_no_role_but_the_owner_may_call_the_writer(conn: psycopg.Connection[Any]) -> None:
    conn.execute("select pgque.create_queue('q')")
    signature = "pgque._write_event(integer, integer, text, text, text, bigint)"
    for role in ("public", "pgque_writer", "pgque_reader", "pgque_admin"):
        assert not scalar(conn, "select has_function_privilege(%s, %s, 'execute')",
                          (role, signature)), role
    assert not scalar(conn, "select prosecdef from pg_proc where oid = %s::regprocedure",
                      (signature,))
    assert scalar(conn, "select proconfig from pg_proc where oid = %s::regprocedure",
                  (signature,)) == ["search_path=pg_catalog, pg_temp"]


def test_queues_beyond_the_writers_bound_are_sent_to_dynamically(
        conn: psycopg.Connection[Any]) -> None:
    """The writer holds the first queues by id up to _event_writer_max_tables()
    event tables (a session compiles it again after each change, longer the more
    it holds); the others' sends go through dynamic SQL, into the same tables."""
    conn.execute("create or replace function pgque._event_writer_max_tables() returns integer"
                 " language sql immutable as 'select 7'")
    ids = [scalar(conn, "select pgque.create_queue(%s)", (f"q{i}",)) for i in range(4)]
    source = writer_source(conn)
    assert [f"event_{queue_id}_0" in source for queue_id in ids] == [True, True, False, False]
    assert source.count("insert into") == 6
    assert not scalar(conn, "select pgque._event_writer_due()")
    for i, queue_id in enumerate(ids):
        send_to_every_table(conn, f"q{i}", queue_id, 3)
    conn.execute("select pgque.drop_queue('q0')")  # the next one moves in
    assert f"event_{ids[2]}_0" in writer_source(conn)
    assert f"event_{ids[3]}_0" not in writer_source(conn)


@pytest.mark.superuser_install  # it installs again as the superuser
def test_an_install_writes_the_writer_for_the_queues_there_are(
        conn: psycopg.Connection[Any]) -> None:
    """install/generated.sql: an install (an upgrade) writes the writer from the
    current template for the existing queues, whatever was there before."""
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    conn.execute("create or replace function pgque._write_event(p_queue_id integer,"
                 " p_table integer, p_type text, p_data text, p_key text, p_id bigint)"
                 " returns bigint language sql as 'select null::bigint'")
    assert scalar(conn, "select pgque._event_writer_due()")
    pgque.install(conn)
    assert not scalar(conn, "select pgque._event_writer_due()")
    assert f"event_{queue_id}_0" in writer_source(conn)
    send_to_every_table(conn, "q", queue_id, 3)


def test_the_writer_stays_bounded_with_many_event_tables(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Every session compiles the writer at its first send after any queue
    change, so the writer holds at most _event_writer_max_tables() INSERTs:
    with 50 queues of 64 tables and one more, it stays within that bound,
    nothing is due, and sends to the first, the last and the new queue land in
    their tables. (Checked by its size, not by timing it; the compile times are
    in the docs.)"""
    real = scalar(conn, "select pg_get_functiondef("
                        "'pgque._sync_event_writer(boolean)'::regprocedure)")
    # Set-up without the writer's quadratic cost: queues made with a no-op sync.
    conn.execute("create or replace function pgque._sync_event_writer(p_wait boolean)"
                 " returns integer language sql as 'select 0'")
    for i in range(50):
        conn.execute("select pgque.create_queue(%s, '{\"event_tables\": 64}')", (f"q{i}",))
    conn.execute(real)
    conn.execute("select pgque.create_queue('one_more')")
    source = str(scalar(conn, "select prosrc from pg_proc where proname = '_write_event'"))
    assert source.count("insert into") <= scalar(conn, "select pgque._event_writer_max_tables()")
    assert not scalar(conn, "select pgque._event_writer_due()")
    with psycopg.connect(dsn, autocommit=True) as producer:
        for name in ("q0", "q49", "one_more"):
            queue_id = scalar(producer, "select queue_id from pgque.queue where queue_name = %s",
                              (name,))
            event_id = scalar(producer, "select pgque.send(%s, 'e', '{}')", (name,))
            assert scalar(producer, f"select count(*) from pgque.event_{queue_id}"
                                    " where ev_id = %s", (event_id,)) == 1


def test_the_docs_describe_the_writer_and_its_lock(conn: psycopg.Connection[Any]) -> None:
    """design-notes.md names the writer's lock (SHARE UPDATE EXCLUSIVE, and why it
    never waits), and the docs name the event writer."""
    notes = (DOCS / "design-notes.md").read_text()
    assert "SHARE UPDATE EXCLUSIVE" in notes  # the writer's lock, and why it never waits
    everything = "".join(p.read_text() for p in DOCS.glob("*.md"))
    assert "event writer" in everything or "_write_event" in everything


@pytest.mark.parametrize("call, sqlstate", [
    ("select pgque.send('nope', 'e', '{}')", "PQ001"),
    ("select pgque.send('q', 'e', 'not json')", "PQ005"),
    ("select pgque.send('q', 'e', '{}', repeat('k', 513))", "PQ012"),
])
def test_send_errors_keep_their_sqlstate_and_write_nothing(
        conn: psycopg.Connection[Any], call: str, sqlstate: str) -> None:
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(call)
    assert caught.value.sqlstate == sqlstate
    assert scalar(conn, f"select count(*) from pgque.event_{queue_id}") == 0


def _events(conn: psycopg.Connection[Any], queue_id: int) -> dict[int, tuple[str, str]]:
    return {row[0]: (row[1], row[2]) for row in conn.execute(
        f"select ev_id, tableoid::regclass::text, ev_data from pgque.event_{queue_id}")}


def test_create_and_send_in_one_transaction_then_roll_back(conn: psycopg.Connection[Any]) -> None:
    """A queue made and sent to in one transaction goes through the new writer;
    after a rollback the session's writer is the committed one again."""
    conn.execute("select pgque.create_queue('kept')")
    with conn.transaction(force_rollback=True):
        queue_id = scalar(conn, "select pgque.create_queue('gone', '{\"event_tables\": 7}')")
        for n in range(7):
            conn.execute("update pgque.queue set queue_cur_table = %s where queue_id = %s",
                         (n, queue_id))
            event_id = scalar(conn, "select pgque._write_event(%s, %s, 'e', '{}', null, null)",
                              (queue_id, n))
            assert _events(conn, queue_id)[event_id][0] == f"pgque.event_{queue_id}_{n}"
            assert scalar(conn, "select pgque.send('gone', 'e', '{}')") is not None
    assert scalar(conn, "select pgque._write_event(%s, 0, 'e', '{}', null, null)",
                  (queue_id,)) is None
    assert not scalar(conn, "select pgque._event_writer_due()")
    assert scalar(conn, "select pgque.send('kept', 'e', '{}')") is not None


@pytest.mark.superuser_install  # it installs again as the superuser
def test_sends_during_creates_drops_rotations_and_installs_land_in_their_table(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Producers sending while other sessions create and drop queues, rotate
    the current table and run installs: every returned id is the event's, in the
    queue's table that was current, nothing lost, no error."""
    ids = {name: scalar(conn, "select pgque.create_queue(%s, '{\"event_tables\": 4}')", (name,))
           for name in ("p0", "p1")}
    # A consumer that never reads holds every event: without one, the tick
    # the tick rotation makes for an idle queue would let maint() truncate the
    # tables the churn switched away from, as it may for a queue nobody reads.
    for name in ids:
        conn.execute("select pgque.subscribe(%s, 'keeper')", (name,))
    stop = threading.Event()
    errors: list[BaseException] = []
    sent: dict[str, list[tuple[int, str]]] = {name: [] for name in ids}

    def produce(name: str) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                n = 0
                while not stop.is_set():
                    n += 1
                    sent[name].append((scalar(c, "select pgque.send(%s, 'e', %s)",
                                              (name, f'{{"n": {n}}}')), f'{{"n": {n}}}'))
        except BaseException as error:
            errors.append(error)

    def churn() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                i = 0
                while not stop.is_set():
                    i += 1
                    c.execute("select pgque.create_queue(%s)", (f"c{i}",))
                    c.execute("update pgque.queue set queue_cur_table = (queue_cur_table + 1) % 4"
                              " where queue_name in ('p0', 'p1')")
                    if i % 2:
                        c.execute("select pgque.drop_queue(%s)", (f"c{i}",))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=produce, args=(name,)) for name in ids]
    threads.append(threading.Thread(target=churn))
    for t in threads:
        t.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            for _ in range(3):
                pgque.install(c)
                c.execute("select * from pgque.maint()")
            # Traffic goes on until each producer has sent through all of that.
            marks = {name: len(sent[name]) for name in ids}
            wait_for(lambda: all(len(sent[name]) >= marks[name] + 50 for name in ids),
                     timeout=60, what="50 more sends from each producer")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == []
    for name, queue_id in ids.items():
        stored = _events(conn, queue_id)
        assert sent[name] and len(stored) == len(sent[name])
        for event_id, data in sent[name]:
            assert stored[event_id][1] == data
    assert not scalar(conn, "select pgque._event_writer_due()")


@pytest.mark.superuser_install  # it installs again as the superuser
def test_installs_under_create_and_drop_queue(dsn: str) -> None:
    """Installs while another session creates, sends to and drops queues:
    no "tuple concurrently updated", no deadlock, the writer up to date after
    the next maintenance pass (a create or drop that found the generators' lock
    held by an install leaves the writer to that pass, as documented)."""
    counter = iter(range(10**6))

    def churn() -> None:
        with pgque.connect(dsn) as client:
            name = f"t{next(counter)}"
            client.create_queue(name)
            client.send(name, "e", 1)
            client.drop_queue(name)

    failed, side = installs_under(dsn, churn, 15)
    assert failed == [] and side == []
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("select * from pgque.maint()")
        assert not scalar(c, "select pgque._event_writer_due()")


@pytest.fixture
def role_dsn(dsn: str) -> Any:
    role = f"rv_w_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(f"create role {role} login")
        su.execute(f"grant pgque_writer, pgque_reader to {role}")
        su.execute(f"create schema {role} authorization {role}")
        try:
            yield role, make_conninfo(**{**conninfo_to_dict(dsn), "user": role})
        finally:
            su.execute(f"drop schema if exists {role} cascade")
            su.execute(f"drop owned by {role} cascade")
            su.execute(f"drop role {role}")


@pytest.mark.superuser_install  # it installs again as the superuser
def test_a_writer_role_can_neither_call_nor_pin_away_the_writer(
        conn: psycopg.Connection[Any], role_dsn: Any) -> None:
    """pgque_writer/reader may not execute _write_event; a SQL-standard function
    naming it (which needs no EXECUTE) does not stop create_queue or drop_queue,
    which replace it in place; the install refuses with PQ017 naming the object,
    as for any pgque function. PQ015 for a sender left out of the queue's
    grants, nothing written."""
    role, role_conninfo = role_dsn
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    with psycopg.connect(role_conninfo, autocommit=True) as r:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            r.execute("select pgque._write_event(%s, 0, 'e', '{}', null, null)", (queue_id,))
        r.execute(f"create function {role}.pin() returns bigint language sql begin atomic"
                  " select pgque._write_event(1, 0, 'e', '{}', null, null); end")
        conn.execute("select pgque.create_queue('other')")
        conn.execute("select pgque.drop_queue('other')")
        conn.execute("select pgque.grant_queue('q', 'pgque_admin', 'send')")
        with pytest.raises(psycopg.Error) as caught:
            r.execute("select pgque.send('q', 'e', '{}')")
        assert caught.value.sqlstate == "PQ015"
    assert scalar(conn, f"select count(*) from pgque.event_{queue_id}") == 0
    with pytest.raises(psycopg.Error) as refused:
        pgque.install(conn)
    assert refused.value.sqlstate == "PQ017" and "pin()" in str(refused.value)


# -- what create_queue and drop_queue wait for ----------------------------------------------


def _waiting(conn: psycopg.Connection[Any], pid: int) -> bool:
    return bool(scalar(conn, "select wait_event_type = 'Lock' from pg_stat_activity"
                             " where pid = %s", (pid,)))


def _in_background(session: psycopg.Connection[Any], statement: str,
                   errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            session.execute(statement)
            session.commit()
        except BaseException as error:  # reported by the main thread
            session.rollback()
            errors.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_create_queue_exist_ok_of_an_existing_queue_waits_for_no_other_create(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """create_queue(name, exist_ok=true) of an existing queue (what every service
    runs at start-up) returns its id at once, even while another transaction
    that created a queue is still open."""
    conn.execute("select pgque.create_queue('existing')")
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        first.execute("select pgque.create_queue('new')")  # its transaction stays open
        second.execute("set lock_timeout = '2s'")
        try:
            queue_id = scalar(second, "select pgque.create_queue('existing', '{}', true)")
        except psycopg.errors.LockNotAvailable:
            queue_id = None
        first.rollback()
    assert queue_id is not None, "exist_ok on an existing queue waited for another create_queue"


def test_a_transaction_that_ticks_then_creates_a_queue_does_not_deadlock_with_drop_queue(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Transaction A ticks queue q1 (holding its tick lock) and then creates a
    queue, while B's drop_queue('q1') waits for q1's tick lock: both go through,
    no deadlock (the same for any tick or maintenance lock held before
    create_queue or drop_queue in one transaction, as in a migration script)."""
    conn.execute("select pgque.create_queue('q1')")
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        a.execute("select pgque.tick('q1')")  # holds q1's tick lock
        thread = _in_background(b, "select pgque.drop_queue('q1')", errors)
        wait_for(lambda: _waiting(conn, b.info.backend_pid), what="drop_queue to wait")
        try:
            a.execute("select pgque.create_queue('n')")
            a.commit()
        except psycopg.Error as error:
            a.rollback()
            errors.append(error)
        thread.join(30)
        assert not thread.is_alive()
    assert [e.sqlstate for e in errors if isinstance(e, psycopg.Error)] == []


def test_two_drops_of_one_queue_the_second_gets_pq001(dsn: str,
                                                      conn: psycopg.Connection[Any]) -> None:
    """The second of two concurrent drops of one queue waits for the first, then
    raises PQ001; the writer is up to date after."""
    conn.execute("select pgque.create_queue('q')")
    errors: list[BaseException] = []
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        a.execute("select pgque.drop_queue('q')")
        thread = _in_background(b, "select pgque.drop_queue('q')", errors)
        wait_for(lambda: _waiting(conn, b.info.backend_pid), what="the second drop to wait")
        a.commit()
        thread.join(30)
    assert [getattr(e, "sqlstate", e) for e in errors] == ["PQ001"]
    assert not scalar(conn, "select pgque._event_writer_due()")
