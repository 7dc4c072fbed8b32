"""The outbox pattern: an event sent inside the application's transaction exists
exactly when that transaction commits, also through a Client made by connect()
(which has a producer pool for sends outside transactions)."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from helpers import drain, scalar

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
