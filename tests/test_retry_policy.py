"""Retry policies: a delay per failed event (a Backoff, or by exception class),
failures not to retry (NonRetryable, Worker(non_retryable=...)) sent to the
dead letters at once, under skip and pause; the SQL calls that take them, and
their refusals of bad input."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from test_pause import Slot

import pgque


def waiting_retries(conn: psycopg.Connection[Any]) -> list[tuple[str, bool]]:
    """(payload, due within a minute) of each retry waiting."""
    return conn.execute("select ev_data, ev_retry_after < now() + interval '1 minute'"
                        "  from pgque._retry_waiting order by ev_id").fetchall()


def test_each_failed_event_waits_its_own_delay_and_dead_ones_are_not_retried(
        conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn, policy="skip")
    slot.send(("a", 1), ("b", 1), ("c", 1))
    batch, _ = slot.receive()
    ids = [slot.ids[(k, 1)] for k in "abc"]
    conn.execute("select pgque.ack_partitioned('q', 'g', 0, 1, %s, %s, '{boom}', '0',"
                 " array['0', '2 hours', null]::interval[], %s)", (batch, ids, [ids[2]]))
    assert waiting_retries(conn) == [('{"n": 1}', True), ('{"n": 1}', False)]
    assert conn.execute("select ev_extra1, dl_reason from pgque.dead_letter").fetchall() == \
        [("c", "boom")]


def test_under_pause_a_head_not_to_retry_is_dead_at_once_and_its_key_goes_on(
        conn: psycopg.Connection[Any]) -> None:
    slot = Slot(conn)
    slot.send(("a", 1), ("a", 2))
    batch, _ = slot.receive()
    a1, a2 = slot.ids[("a", 1)], slot.ids[("a", 2)]
    conn.execute("select pgque.ack_partitioned('q', 'g', 0, 1, %s, %s, '{bad payload}',"
                 " '1 hour', null, %s)", (batch, [a1, a2], [a1]))
    assert scalar(conn, "select count(*) from pgque.dead_letter") == 1
    held, events = slot.receive()  # a2 due now, not in an hour
    assert events == [("a", 2, 0)]
    slot.ack(held)
    assert slot.blocked() == []


@pytest.mark.parametrize(("extra", "state"), [
    (("array['1 s']::interval[]", "null"), "22023"),  # not one per id
    (("array['-1 s', '0']::interval[]", "null"), "22023"),  # negative
    (("null", "'{12345}'::bigint[]"), "22023"),  # a dead id that was not nacked
])
def test_bad_delays_and_dead_ids_are_refused_and_change_nothing(
        conn: psycopg.Connection[Any], extra: tuple[str, str], state: str) -> None:
    slot = Slot(conn, policy="skip")
    slot.send(("a", 1), ("b", 1))
    batch, _ = slot.receive()
    ids = list(slot.ids.values())
    with pytest.raises(psycopg.Error) as refused:
        conn.execute(f"select pgque.ack_partitioned('q', 'g', 0, 1, %s, %s, '{{x}}', '0',"
                     f" {extra[0]}, {extra[1]})", (batch, ids))
    assert refused.value.sqlstate == state
    assert scalar(conn, "select count(*) from pgque.retry_queue") == 0
    assert slot.receive()[0] == batch  # still open, the same piece


def test_the_clients_ack_takes_delays_per_event_and_dead_ones(
        client: pgque.Client, conn: psycopg.Connection[Any]) -> None:
    client.create_queue("q")
    client.subscribe("q", "plain")
    client.send_batch("q", [("e", {"n": n}, "k") for n in range(3)])
    client.tick("q")
    batch = client.receive("q", "plain")
    assert batch is not None
    first, second, third = batch.messages
    with pytest.raises(ValueError):
        client.ack(batch, nack=[first], retry_after={second.id: 1.0})
    client.ack(batch, nack=[first, second, third], retry_after={second.id: 7200.0},
               dead=[third])
    assert [(json.loads(d)["n"], soon) for d, soon in waiting_retries(conn)] == \
        [(0, True), (1, False)]
    [letter] = client.dead_letters("q")
    assert letter.event_id == third.id


def test_backoff_grows_is_capped_and_spreads() -> None:
    backoff = pgque.Backoff(initial=1, factor=2, maximum=10, jitter=0.2)
    for attempt, base in ((0, 1), (1, 2), (2, 4), (3, 8), (4, 10), (1000, 10)):
        delays = [backoff(attempt) for _ in range(200)]
        assert all(base * 0.8 <= d <= base * 1.2 for d in delays)
        assert len(set(delays)) > 1
    assert pgque.Backoff(5, factor=1, jitter=0)(9) == 5
    for bad in ({"initial": -1}, {"factor": 0.5}, {"maximum": 0.1, "initial": 1},
                {"jitter": 1}):
        with pytest.raises(ValueError):
            pgque.Backoff(**bad)
    with pytest.raises(ValueError):
        pgque.Worker("postgresql://x", queue="q", consumer="g", slots=1,
                     handler=lambda m: None, retry_after={Exception: -1})


@pytest.mark.both_workers
@pytest.mark.parametrize("policy", ["skip", "pause"])
def test_the_worker_retries_by_exception_class_and_dead_letters_what_it_must_not_retry(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any], policy: str) -> None:
    client.create_queue("q", ticker_max_lag=0, max_retries=5)
    client.subscribe_slots("q", "g", slots=2, policy=policy)
    client.send_batch("q", [("e", {"n": 0, "fail": "timeout"}, "k0"),
                            ("e", {"n": 1, "fail": "limit"}, "k1"),
                            ("e", {"n": 2, "fail": "bad"}, "k2"),
                            ("e", {"n": 3}, "k2")])
    handled: list[int] = []
    lock = threading.Lock()

    def handler(message: pgque.Message[Any]) -> None:
        kind = message.payload.get("fail")
        if kind == "timeout" and message.retry_count == 0:
            raise TimeoutError("slow upstream")
        if kind == "limit":
            raise ConnectionRefusedError("rate limited")
        if kind == "bad":
            raise ValueError("will never parse")
        with lock:
            handled.append(message.payload["n"])

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=2, handler=handler,
                          retry_after={TimeoutError: 0, Exception: 3600},
                          non_retryable=(ValueError,), poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.1))
    with worker:
        wait_for(lambda: sorted(handled) == [0, 3], timeout=30,
                 what="the timeout retried at once, the bad one's key going on", dsn=dsn)
    [letter] = client.dead_letters("q")
    assert (letter.payload["n"], letter.retry_count) == (2, 0)
    assert "ValueError: will never parse" in (letter.reason or "")
    if policy == "skip":
        [(data, soon)] = waiting_retries(conn)
        assert (json.loads(data)["n"], soon) == (1, False)
    else:
        [blocked] = client.blocked_keys("q", "g")
        assert (blocked.key, blocked.attempts) == ("k1", 1)
        assert blocked.retry_at > blocked.blocked_since  # due in an hour
