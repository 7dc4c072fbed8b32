"""The outbox pattern: an event sent inside the application's transaction exists
exactly when that transaction commits, also through a Client made by connect()
(which has a producer pool for sends outside transactions)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import backends, drain, scalar

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


class Rollback(Exception):
    pass


@pytest.fixture
def outbox(client: pgque.Client) -> pgque.Client:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.conn.execute("create table orders (id int primary key)")
    return client


def test_send_inside_the_clients_transaction_rolls_back_with_it(outbox: pgque.Client) -> None:
    with pytest.raises(Rollback), outbox.conn.transaction():
        outbox.conn.execute("insert into orders values (1)")
        outbox.send("q", "OrderPlaced", {"id": 1})
        outbox.send_batch("q", [("OrderLine", {"id": 1})])
        raise Rollback()
    assert scalar(outbox.conn, "select count(*) from orders") == 0
    assert drain(outbox, "q", "c") == []


def test_send_inside_the_clients_transaction_commits_with_it(
        outbox: pgque.Client, dsn: str) -> None:
    with outbox.conn.transaction():
        outbox.conn.execute("insert into orders values (1)")
        event = outbox.send("q", "OrderPlaced", {"id": 1})
        # Not visible to anyone else before the commit.
        with psycopg.connect(dsn, autocommit=True) as other:
            assert scalar(other, "select count(*) from pgque.event_1") == 0
    assert [m.id for m in drain(outbox, "q", "c")] == [event]


def test_send_outside_a_transaction_commits_on_its_own(outbox: pgque.Client,
                                                       conn: psycopg.Connection[Any]) -> None:
    event = outbox.send("q", "Ping", None)
    assert [m.id for m in drain(outbox, "q", "c")] == [event]


def test_another_threads_send_does_not_join_the_transaction(outbox: pgque.Client) -> None:
    """A producer thread sending while the main thread holds an outbox transaction
    open on client.conn commits on its own (through the pool)."""
    sent: list[int] = []
    with pytest.raises(Rollback), outbox.conn.transaction():
        outbox.send("q", "Mine", 1)
        producer = threading.Thread(target=lambda: sent.append(outbox.send("q", "Theirs", 2)))
        producer.start()
        producer.join(10)
        raise Rollback()
    assert [m.id for m in drain(outbox, "q", "c")] == sent


def test_the_owners_sends_commit_on_its_own_connection(outbox: pgque.Client,
                                                        conn: psycopg.Connection[Any]) -> None:
    """Outside a transaction, sends from the thread (task) that made the client
    commit at once on the client's own connection: no producer pool is opened
    for them (a checkout cost 40 to 70 µs a send)."""
    before = backends(conn)
    sent = [outbox.send("q", "Ping", i) for i in range(3)]
    sent += outbox.send_batch("q", [("Ping", 3), ("Ping", 4)])
    assert scalar(conn, "select count(*) from pgque.event_1") == 5  # committed
    assert backends(conn) == before
    # Another thread's send still goes through the pool: one more session.
    producer = threading.Thread(target=lambda: sent.append(outbox.send("q", "Theirs", 5)))
    producer.start()
    producer.join(10)
    assert backends(conn) > before
    assert [m.id for m in drain(outbox, "q", "c")] == sent


def test_sends_go_on_through_the_pool_once_the_clients_session_is_gone(
        outbox: pgque.Client, conn: psycopg.Connection[Any], dsn: str) -> None:
    """The owner's send fails like any call on a connection whose session
    ended, and the next ones commit through the producer pool."""
    first = outbox.send("q", "Ping", 1)
    pid = scalar(outbox.conn, "select pg_backend_pid()")
    assert scalar(conn, "select pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError) as lost:
        outbox.send("q", "Lost", 2)
    assert lost.value.sqlstate in (None, "57P01")  # the connection lost, or admin shutdown
    later = [outbox.send("q", "Ping", 3), *outbox.send_batch("q", [("Ping", 4)])]
    with pgque.connect(dsn) as reader:
        assert [m.id for m in drain(reader, "q", "c")] == [first, *later]


def test_connect_settings_reach_the_producer_pool(dsn: str,
                                                  conn: psycopg.Connection[Any]) -> None:
    """Keyword arguments of connect() configure the pool's connections too."""
    with pgque.connect(dsn, application_name="pgque-kwargs") as client:
        client.create_queue("q")
        producer = threading.Thread(target=lambda: client.send("q", "Theirs", 1))
        producer.start()
        producer.join(10)
        named = scalar(conn, "select count(*) from pg_stat_activity"
                             " where application_name = 'pgque-kwargs'")
        assert named >= 2  # the client's own connection and the pool's


def test_a_send_on_a_client_over_a_non_autocommit_connection_commits_through_the_pool(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Over a connection that is not in autocommit, an idle send would open a
    transaction nobody commits: it goes through the producer pool instead."""
    with pgque.connect(dsn) as setup:
        setup.create_queue("q")
    with psycopg.connect(dsn) as own:
        client = pgque.Client(own, dsn=dsn, pool_size=2)
        try:
            client.send("q", "Ping", 1)
            client.send_batch("q", [("Ping", 2)])
            assert own.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert scalar(conn, "select count(*) from pgque.event_1") == 2  # committed
        finally:
            client.close()
