"""Worker processes of a test (worker_process.py), killed and replaced at will, and
what their handlers recorded in table ``handled``, checked against what was sent."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
from helpers import wait_for

import pgque

WORKER_SCRIPT = str(Path(__file__).with_name("worker_process.py"))


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
