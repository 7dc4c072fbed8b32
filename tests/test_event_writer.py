"""The event writer (pgque/sql/code/31_event_writer.sql): one generated function
holding every event table's INSERT as static SQL, so that a send plans nothing.
create_queue and drop_queue write it again when no one else is writing it,
maintenance when they could not; a writer that lags behind the queues makes
sends slower, never wrong."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import scalar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

WRITE = "select pgque._write_event(%s, %s, 'e', '{}', null)"


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
                 " p_table integer, p_type text, p_data text, p_key text) returns bigint"
                 " language sql as 'select null::bigint'")
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
    signature = "pgque._write_event(integer, integer, text, text, text)"
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
    """98_event_writer.sql: an install (an upgrade) writes the writer from the
    current template for the existing queues, whatever was there before."""
    queue_id = scalar(conn, "select pgque.create_queue('q')")
    conn.execute("create or replace function pgque._write_event(p_queue_id integer,"
                 " p_table integer, p_type text, p_data text, p_key text) returns bigint"
                 " language sql as 'select null::bigint'")
    assert scalar(conn, "select pgque._event_writer_due()")
    pgque.install(conn)
    assert not scalar(conn, "select pgque._event_writer_due()")
    assert f"event_{queue_id}_0" in writer_source(conn)
    send_to_every_table(conn, "q", queue_id, 3)
