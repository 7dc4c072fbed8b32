"""The pause failure policy through the Worker: with events of many keys
failing now and then, each key's events are handled in send order, the
failed one before anything later of its key, each once; other keys go on
meanwhile. Plain and transactional handlers, the Worker and the AsyncWorker."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for

import pgque

pytestmark = pytest.mark.both_workers


def fails_first(n: int) -> int:
    """How often event n fails before it is handled: about one in seven, up to twice."""
    return (n % 3) + 1 if n % 7 == 3 else 0


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
def test_every_key_in_order_with_transient_failures(
        client: pgque.Client, dsn: str, conn: psycopg.Connection[Any],
        transactional: bool) -> None:
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=50)
    client.subscribe_slots("q", "g", slots=4, policy="pause")
    conn.execute("create table handled (key text, n int, at bigserial)")
    events = [(f"tenant-{i % 12}", i) for i in range(360)]
    client.send_batch("q", [("e", {"n": n}, key) for key, n in events])
    attempts: dict[int, int] = defaultdict(int)
    order: dict[str, list[int]] = defaultdict(list)  # every start, failed or not
    lock = threading.Lock()

    def run(message: pgque.Message[Any]) -> None:
        n = message.payload["n"]
        with lock:
            attempts[n] += 1
            order[message.partition_key or ""].append(n)
            failing = attempts[n] <= fails_first(n)
        if failing:
            raise RuntimeError(f"transient failure of {n}")

    def plain(message: pgque.Message[Any]) -> None:
        run(message)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("insert into handled (key, n) values (%s, %s)",
                      (message.partition_key, message.payload["n"]))

    def in_transaction(message: pgque.Message[Any], c: Any) -> None:
        c.execute("insert into handled (key, n) values (%s, %s)",
                  (message.partition_key, message.payload["n"]))
        run(message)  # after the write: a failure rolls it back

    worker = pgque.Worker(dsn, queue="q", consumer="g", slots=4,
                          handler=in_transaction if transactional else plain,
                          transactional=transactional, max_events=20, retry_after=0,
                          failure_policy="pause", poll_interval=0.05,
                          ticker=pgque.Ticker(dsn, maintenance_interval=0.1))
    with worker:
        wait_for(lambda: scalar(conn, "select count(*) from handled") >= len(events),
                 timeout=60, what="every event handled", dsn=dsn)
        wait_for(lambda: not client.blocked_keys("q", "g"), what="no key blocked", dsn=dsn)
    handled: dict[str, list[int]] = defaultdict(list)
    for key, n in conn.execute("select key, n from handled order by at"):
        handled[key].append(n)
    for key in {k for k, _ in events}:
        sent = [n for k, n in events if k == key]
        assert handled[key] == sent, (key, handled[key], sent)  # in order, each once
        # No later event of the key even started before a failed one was handled.
        starts = order[key]
        assert starts == sorted(starts)
    assert sum(fails_first(n) for _, n in events) == worker.failed
    assert client.dead_letters("q") == []
