"""The ordering property with real worker processes, some killed with SIGKILL:

* every event is handled at least once, and exactly once when no worker died;
* for each (producer, key), events are first handled in the order they were sent;
* two handlers never run for the same key at the same moment.

Workers record each handler call's start and end (database clock) in a table;
see worker_process.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from worker_pool import WorkerPool, check_handled

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)

_example = itertools.count()


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(slots=st.sampled_from([2, 3, 4]),
       worker_delta=st.sampled_from([-1, 0, 1]),
       producers=st.integers(1, 3),
       keys=st.integers(1, 10),
       per_producer=st.integers(10, 80),
       kills=st.lists(st.tuples(st.floats(0.05, 0.6), st.integers(0, 5)), max_size=2),
       seed=st.integers(0, 10_000),
       key_concurrency=st.sampled_from([1, 3]))
def test_per_key_order_and_single_processor(
        dsn: str, conn: psycopg.Connection[Any], slots: int, worker_delta: int, producers: int,
        keys: int, per_producer: int, kills: list[tuple[float, int]], seed: int,
        key_concurrency: int) -> None:
    queue = f"order{next(_example)}"
    conn.execute("create table if not exists handled (id bigserial primary key, ev_id bigint, "
                 "key text, producer int, seq int, pid int, retry int, started timestamptz, "
                 "ended timestamptz)")
    conn.execute("truncate handled")
    with pgque.connect(dsn) as admin:
        admin.create_queue(queue, ticker_max_lag=0, ticker_max_count=100)
        admin.subscribe_slots(queue, "g", slots=slots)
    pool = WorkerPool(dsn, queue, slots, max(1, slots + worker_delta), seed, key_concurrency)

    sent: dict[tuple[int, str], list[int]] = defaultdict(list)
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        rng = random.Random(seed * 10 + p)
        try:
            with pgque.connect(dsn) as client:
                for s in range(per_producer):
                    key = f"key-{rng.randrange(keys)}"
                    ev = client.send(queue, "e", {"p": p, "s": s}, partition_key=key)
                    sent[(p, key)].append(ev)  # each committed before the next is sent
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    try:
        for delay, index in kills:
            time.sleep(delay)  # kill at a random moment, not a synchronization
            pool.kill_and_replace(index)
        for t in threads:
            t.join(60)
        assert not errors, errors
        total = sum(len(v) for v in sent.values())
        wait_for(lambda: scalar(conn, "select count(distinct ev_id) from handled") == total,
                 timeout=90, what=f"all {total} events handled")
    finally:
        codes = pool.stop()
    assert codes == [0] * len(codes)
    check_handled(conn, sent, exactly_once=not kills)
