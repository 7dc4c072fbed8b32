"""Retries come back to the consumer that nacked them, intact; after max_retries
they become dead letters, which can be listed, replayed and purged."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import drain, scalar, wait_for

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)


def test_nacked_event_returns_after_retry_after_to_same_consumer_only(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q", max_retries=3)
    client.subscribe("q", "failing")
    client.subscribe("q", "other")
    ev = client.send("q", "FileCreated", {"path": "/x"}, partition_key="tenant-7")
    keep = client.send("q", "FileDeleted", {"path": "/y"}, partition_key="tenant-7")
    client.tick("q")
    batch = client.receive("q", "failing")
    assert batch is not None and [m.id for m in batch] == [ev, keep]
    nacked_at = scalar(conn, "select now()")
    assert client.nack(batch, batch.messages[0], retry_after=0.3, reason="disk full") == 0
    assert client.ack(batch) is True

    def returned() -> list[pgque.Message[Any]] | None:
        client.maintenance("q")
        return drain(client, "q", "failing") or None

    again = wait_for(returned, timeout=10, what="the retried event")
    moved_at = scalar(conn, "select now()")
    assert (moved_at - nacked_at).total_seconds() >= 0.3  # database clock
    assert len(again) == 1
    retried = again[0]
    assert (retried.id, retried.type, retried.payload, retried.partition_key) == (
        ev, "FileCreated", {"path": "/x"}, "tenant-7")
    assert retried.retry_count == 1
    # The other consumer saw each event exactly once and never the retry copy.
    assert [m.id for m in drain(client, "q", "other")] == [ev, keep]
    client.maintenance("q")
    assert drain(client, "q", "other") == []


def test_retry_not_due_stays_out(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages, retry_after=3600)
    client.ack(batch)
    assert all(step != "retry" for _, step, _ in client.maintenance("q"))
    assert drain(client, "q", "c") == []
    info = client.consumer_info("q")[0]
    assert info.retries_waiting == 1


def test_dead_letter_after_max_retries_then_replay(client: pgque.Client) -> None:
    client.create_queue("q", max_retries=2)
    client.subscribe("q", "c")
    ev = client.send("q", "Charge", {"amount": 5}, partition_key="acct-1")
    for deliveries in range(1, 4):  # retry_count 0, 1, 2: the third failure is final
        client.maintenance("q")  # moves the due retry back into the log
        client.tick("q")
        batch = client.receive("q", "c")
        assert batch is not None
        assert [m.id for m in batch] == [ev]
        assert batch.messages[0].retry_count == deliveries - 1
        dead = client.nack(batch, batch.messages[0], reason=f"declined #{deliveries}")
        client.ack(batch)
        assert dead == (1 if deliveries == 3 else 0)
    client.maintenance("q")
    assert drain(client, "q", "c") == []
    [letter] = client.dead_letters("q")
    assert (letter.event_id, letter.consumer, letter.reason, letter.retry_count) == (
        ev, "c", "declined #3", 2)
    assert (letter.type, letter.payload, letter.partition_key) == (
        "Charge", {"amount": 5}, "acct-1")

    assert client.replay_dead_letter("q", letter.id) == ev
    assert client.dead_letters("q") == []
    [replayed] = drain(client, "q", "c")
    assert (replayed.id, replayed.payload, replayed.retry_count) == (ev, {"amount": 5}, 0)
    with pytest.raises(pgque.DeadLetterNotFound):
        client.replay_dead_letter("q", letter.id)


def test_purge_dead_letters(client: pgque.Client) -> None:
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "a")
    client.subscribe("q", "b")
    client.send_batch("q", [("e", i) for i in range(3)])
    client.tick("q")
    for consumer in ("a", "b"):
        batch = client.receive("q", consumer)
        assert batch is not None
        assert client.nack(batch, batch.messages, reason="no") == 3
        client.ack(batch)
    assert len(client.dead_letters("q")) == 6
    first = client.dead_letters("q", "a")[0]
    assert client.purge_dead_letters("q", ids=[first.id]) == 1
    assert client.purge_dead_letters("q", "a") == 2
    assert [d.consumer for d in client.dead_letters("q")] == ["b"] * 3
    assert client.purge_dead_letters("q") == 3


def test_nack_of_event_not_handed_out_is_refused(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    ids = client.send_batch("q", [("e", i) for i in range(4)])
    client.tick("q")
    batch = client.receive("q", "c", max_events=2)
    assert batch is not None
    with pytest.raises(pgque.EventNotInBatch):
        client.nack(batch, [ids[0], ids[3]])  # ids[3] is not handed out yet
    assert client.consumer_info("q")[0].retries_waiting == 0
    assert client.nack(batch, [ids[0], ids[1]]) == 0
    assert client.consumer_info("q")[0].retries_waiting == 2


def test_many_due_retries_come_back_in_one_pass(client: pgque.Client) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    ids = client.send_batch("q", [("e", i) for i in range(500)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    client.nack(batch, batch.messages)  # one round trip for all 500
    client.ack(batch)
    assert ("q", "retry", 500) in client.maintenance("q")
    assert sorted(m.id for m in drain(client, "q", "c")) == ids


def _retry_rows(conn: psycopg.Connection[Any], ev_id: int) -> int:
    return int(scalar(conn, "select count(*) from pgque._retry_waiting where ev_id = %s", (ev_id,)))


def test_a_nack_repeated_after_a_crash_is_one_retry_and_one_dead_letter(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    """A consumer nacks, dies before its ack, gets the same open batch again and
    nacks again: still one retry, and in the end exactly one dead letter after
    exactly max_retries retries (it used to duplicate the event, and then stall
    the consumer on a batch holding two copies of one id)."""
    client.create_queue("q", max_retries=2)
    client.subscribe("q", "c")
    ev = client.send("q", "e", {"n": 1}, partition_key="k")
    client.tick("q")
    handled: list[int] = []
    for _ in range(20):
        if client.dead_letters("q"):
            break
        client.maintenance("q")  # retries due now come back into the log
        client.tick("q")
        batch = client.receive("q", "c")
        if batch is None:
            continue
        [message] = batch.messages
        handled.append(message.retry_count)
        client.nack(batch, message, reason="boom")
        # The crash: no ack. The retry is due at once, so maintenance moves it
        # back into the log while the batch is still open, and ticks follow.
        client.maintenance("q")
        client.tick("q")
        again = client.receive("q", "c")
        assert again is not None and again.batch_id == batch.batch_id
        client.nack(again, again.messages[0], reason="boom")  # repeated: changes nothing
        assert client.ack(again) is True
    assert handled == [0, 1, 2]
    [letter] = client.dead_letters("q")
    assert (letter.event_id, letter.retry_count, letter.reason) == (ev, 2, "boom")
    assert _retry_rows(conn, ev) == 0
    assert drain(client, "q", "c") == []


def test_nack_with_a_null_id_is_refused(client: pgque.Client,
                                        conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.subscribe("q", "c")
    client.send("q", "e", 1)
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select pgque.nack('q', 'c', %s, array[null]::bigint[])", (batch.batch_id,))
    assert info.value.sqlstate == "PQ010"
    with pytest.raises(psycopg.Error) as info:
        conn.execute("select pgque.nack('q', 'c', %s, array[%s, null]::bigint[])",
                     (batch.batch_id, batch.messages[0].id))
    assert info.value.sqlstate == "PQ010"
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 0
    assert client.ack(batch) is True


def test_ack_with_nacks_commits_both_or_neither(client: pgque.Client,
                                                conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q", max_retries=0)
    client.subscribe("q", "c")
    ids = client.send_batch("q", [("e", 1), ("e", 2), ("e", 3)])
    client.tick("q")
    batch = client.receive("q", "c")
    assert batch is not None
    with pytest.raises(pgque.EventNotInBatch):  # one bad id: nothing happens
        client.ack(batch, nack=[ids[0], 999_999])
    assert scalar(conn, "select count(*) from pgque.dead_letter") == 0
    assert client.ack(batch, nack={ids[0]: "first", ids[2]: "third"}) is True
    letters = client.dead_letters("q")
    assert [(d.event_id, d.reason) for d in letters] == [(ids[0], "first"), (ids[2], "third")]
    assert drain(client, "q", "c") == []
