"""The log is gap-free under concurrency: every committed event is delivered exactly
once, never a rolled-back one, whatever the interleaving of producers and ticks.

Producers run overlapping transactions of random length (some rolled back) in
threads while a ticker thread forces ticks at random moments and a consumer
drains concurrently. Sleeps here only shape the interleaving; every wait for
completion is a join or a drain.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import psycopg
import pytest
from helpers import drain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

pytestmark = pytest.mark.both_clients  # with the Client and the AsyncClient (conftest.py)

_example = itertools.count()

# One transaction of a producer: how many events, commit or roll back, and how
# long (ms) to hold the transaction open before finishing it.
transaction = st.tuples(st.integers(1, 4), st.booleans() | st.just(True), st.integers(0, 12))
producer = st.lists(transaction, min_size=1, max_size=6)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(producers=st.lists(producer, min_size=2, max_size=4),
       tick_gaps=st.lists(st.integers(0, 15), min_size=1, max_size=8))
def test_committed_events_delivered_exactly_once(
        dsn: str, producers: list[list[tuple[int, bool, int]]], tick_gaps: list[int]) -> None:
    queue = f"gapfree{next(_example)}"
    admin = pgque.connect(dsn)
    admin.create_queue(queue)
    admin.subscribe(queue, "c")

    committed: dict[int, list[list[int]]] = {p: [] for p in range(len(producers))}
    rolled_back: list[int] = []
    start = threading.Barrier(len(producers) + 2, timeout=30)
    producing = threading.Event()
    producing.set()
    errors: list[BaseException] = []

    def produce(index: int, script: list[tuple[int, bool, int]]) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                client = pgque.Client(conn)
                start.wait()
                for txn, (count, commit, hold_ms) in enumerate(script):
                    ids = [client.send(queue, "e", {"p": index, "t": txn, "k": k}, conn=conn)
                           for k in range(count)]
                    time.sleep(hold_ms / 1000)
                    if commit:
                        conn.commit()
                        committed[index].append(ids)
                    else:
                        conn.rollback()
                        rolled_back.extend(ids)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def tick() -> None:
        try:
            with pgque.connect(dsn) as client:
                start.wait()
                for gap in tick_gaps:
                    time.sleep(gap / 1000)
                    client.tick(queue)
        except BaseException as exc:
            errors.append(exc)

    delivered: list[int] = []

    def consume() -> None:
        try:
            with pgque.connect(dsn) as client:
                start.wait()
                while producing.is_set():
                    delivered.extend(m.id for m in drain(client, queue, "c", tick=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(i, s)) for i, s in enumerate(producers)]
    threads.append(threading.Thread(target=tick))
    consumer = threading.Thread(target=consume)
    for t in (*threads, consumer):
        t.start()
    for t in threads:
        t.join(60)
    producing.clear()
    consumer.join(60)
    delivered.extend(m.id for m in drain(admin, queue, "c"))  # after a final tick
    admin.close()
    assert not errors, errors

    all_committed = [i for txns in committed.values() for ids in txns for i in ids]
    assert len(delivered) == len(set(delivered)), "an event was delivered twice"
    assert not set(delivered) & set(rolled_back), "a rolled-back event was delivered"
    assert sorted(delivered) == sorted(all_committed), "a committed event was lost"

    position = {ev_id: n for n, ev_id in enumerate(delivered)}
    for txns in committed.values():
        for ids in txns:  # one transaction's events arrive in ev_id order
            assert [position[i] for i in ids] == sorted(position[i] for i in ids)
        # One producer's transactions, each committed before the next began,
        # arrive in send order, across batches.
        sent_order = [i for ids in txns for i in ids]
        assert sorted(sent_order, key=position.__getitem__) == sent_order


def test_sequential_producer_order_across_batches(dsn: str) -> None:
    """Events one producer commits one after another are received in that order,
    even when every event lands in a different batch."""
    with pgque.connect(dsn) as client:
        client.create_queue("q")
        client.subscribe("q", "c")
        sent: list[int] = []
        received: list[Any] = []
        for i in range(60):
            sent.append(client.send("q", "e", i, partition_key=f"k{i % 3}"))
            if i % 7 == 0:
                client.tick("q")
            if i % 11 == 0:
                received += drain(client, "q", "c", tick=False)
        received += drain(client, "q", "c")
        assert [m.id for m in received] == sent
        assert [m.payload for m in received] == list(range(60))
