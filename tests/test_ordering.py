"""The ordering property with real worker processes, some killed with SIGKILL:

* every event is handled at least once, and exactly once when no worker died;
* for each (producer, key), events are first handled in the order they were sent;
* two handlers never run for the same key at the same moment.

Workers record each handler call's start and end (database clock) in a table;
see worker_process.py.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import scalar, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgque

pytestmark = pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)

WORKER_SCRIPT = str(Path(__file__).with_name("worker_process.py"))
_example = itertools.count()


class WorkerPool:
    """Worker processes that can be killed and replaced."""

    def __init__(self, dsn: str, queue: str, slots: int, count: int, seed: int,
                 key_concurrency: int = 1, consumer: str = "g") -> None:
        self.args = [dsn, queue, consumer, str(slots), "4"]
        self.consumer = consumer
        self.env = {**os.environ, "PGQUE_TEST_KEY_CONCURRENCY": str(key_concurrency)}
        self.queue = queue
        self.seed = seed
        self.monitor = pgque.connect(dsn)
        self.procs = [self._spawn() for _ in range(count)]
        self.wait_members()

    def _spawn(self) -> subprocess.Popen[str]:
        self.seed += 1
        return subprocess.Popen([sys.executable, WORKER_SCRIPT, *self.args, str(self.seed)],
                                env=self.env)

    def wait_members(self) -> None:
        """Wait until every live process has joined the group."""
        wait_for(lambda: self.monitor.group_status(self.queue, self.consumer).members
                 == len(self.procs), timeout=30, what="workers to join")

    def kill_and_replace(self, index: int) -> None:
        proc = self.procs[index % len(self.procs)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # The dead worker's session (and its group membership) ends a moment
        # after the process: wait for that, or wait_members would count it in
        # place of its replacement.
        wait_for(lambda: self.monitor.group_status(self.queue, self.consumer).members
                 == len(self.procs) - 1, timeout=30, what="the killed worker's session to end")
        self.procs[index % len(self.procs)] = self._spawn()

    def stop(self) -> list[int]:
        self.wait_members()  # a replacement still starting would die of SIGTERM
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        try:
            return [proc.wait(30) for proc in self.procs]
        except subprocess.TimeoutExpired:
            for proc in self.procs:  # show where a hung worker is stuck, then end it
                if proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            for proc in self.procs:
                proc.kill()
            raise
        finally:
            self.monitor.close()


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


def check_handled(conn: psycopg.Connection[Any], sent: dict[tuple[int, str], list[int]], *,
                  exactly_once: bool) -> None:
    """What table ``handled`` shows: every event sent handled at least once (exactly
    once when asked) and nothing else, each (producer, key) first handled in the
    order sent, and never two handlers of one key at the same moment."""
    rows = conn.execute("select id, ev_id, key, producer, seq, started, ended from handled "
                        "order by id").fetchall()
    all_sent = {ev for evs in sent.values() for ev in evs}
    assert {r[1] for r in rows} == all_sent  # at least once, and nothing else
    if exactly_once:
        assert len(rows) == len(all_sent), "an event was handled twice without a crash"

    first_seen: dict[tuple[int, str], list[int]] = defaultdict(list)
    seen: set[int] = set()
    for _, ev_id, key, producer, _, _, _ in rows:
        if ev_id not in seen:
            seen.add(ev_id)
            first_seen[(producer, key)].append(ev_id)
    for pk, evs in sent.items():
        assert first_seen[pk] == evs, f"order broken for producer/key {pk}"

    by_key: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
    for _, _, key, _, _, started, ended in rows:
        if ended is not None:  # a handler killed mid-event has no end
            by_key[key].append((started, ended))
    for key, spans in by_key.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"two handlers of key {key} overlapped"
