"""Generated code (pgque/sql/code/generated/): the event writer, each queue's
batch reader and slot indexes are current after an install, after create_queue
and drop_queue, and after maintenance; one that lags shows in
pgque.generated_code and in `pgque status`, and what it serves still works."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import scalar

import pgque


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
