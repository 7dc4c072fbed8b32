"""Suite ``verify``: what the record of handler calls costs, and its check.

A Worker of 16 slots with a no-op handler drains a backlog of events (64 keys,
a tick every 1,000 events), once as it runs by default and once with
``record=True``, by turns: the record's cost is the ratio of the two rates (one
more statement per ack, and a row per call). Then ``verify_handling`` over the
recorded run: its time per recorded event, as events/s checked.

The Worker runs in this process (threads), with ``ticker=False`` and the
backlog ticked before the timer starts, so each run times the drain only, not
the Worker's start (which the warm-up and the run's size make small).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import pgque
from bench.measure import Case, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register

EVENTS = 100_000  # a run's events (a fifth with --quick)
SLOTS = 16
KEYS = 64
TICK_EVERY = 1_000


class Drain:
    """A queue and group drained by a fresh Worker per run, made with the
    options given (record=True, say); the metrics suite drains it too."""

    def __init__(self, dsn: str, conn: psycopg.Connection[object], name: str,
                 **options: Any) -> None:
        self.dsn = dsn
        self.conn = conn
        self.queue = name
        self.options = options
        self.worker: pgque.Worker[object] | None = None
        #: Each timed run's CPU time of this process (the Worker's threads) per event, in µs.
        self.cpu_per_event: list[float] = []
        conn.execute("select pgque.create_queue(%s, %s)",
                     (name, f'{{"ticker_max_count": {TICK_EVERY}}}'))
        conn.execute("select pgque.subscribe_slots(%s, 'g', %s)", (name, SLOTS))

    def prepare(self, count: int) -> None:
        if self.worker is not None:  # the last run's, asked to stop as its timer ended
            self.worker.stop()
            if self.worker.error is not None:
                raise self.worker.error
            self.worker = None
        if self.options.get("record"):
            self.conn.execute("select pgque.forget_handling(%s, 'g', %s)", (self.queue, SLOTS))
        for start in range(0, count, TICK_EVERY):
            n = min(TICK_EVERY, count - start)
            self.conn.execute(
                "select pgque.send_batch(%s, %s, %s, %s)",
                (self.queue, ["e"] * n, ['{"n": 1}'] * n,
                 [f"tenant-{(start + i) % KEYS}" for i in range(n)]))
            self.conn.execute("select pgque.tick(%s)", (self.queue,))

    def run(self, count: int) -> int:
        """Start a Worker and time it until its handler has seen ``count`` events
        (its start in the time, not its stop: the next prepare waits for that)."""
        calls = itertools.count(1)
        done = threading.Event()

        def handle(message: pgque.Message[object]) -> None:
            if next(calls) == count:  # (atomic under the GIL: no lock in the no-op)
                done.set()

        self.worker = pgque.Worker(self.dsn, queue=self.queue, consumer="g", slots=SLOTS,
                                   handler=handle, ticker=False, poll_interval=0.05,
                                   name=f"bench-{self.queue}", **self.options)
        cpu = time.process_time()
        self.worker.start()
        if not done.wait(600):
            raise RuntimeError(f"the worker handled {next(calls) - 1} of {count} events")
        self.cpu_per_event.append((time.process_time() - cpu) / count * 1e6)
        self.worker.request_stop()
        return count

    def close(self) -> None:
        """Stop the last run's worker."""
        self.prepare(0)


def _verify_rate(conn: psycopg.Connection[object], queue: str) -> Callable[[int], int]:
    def run(count: int) -> int:
        found = conn.execute("select count(*) from pgque.verify_handling(%s, 'g')",
                             (queue,)).fetchone()
        assert found == (0,), f"verify found {found} in the bench's own record"
        events = conn.execute("select events from pgque.handling_summary(%s, 'g')",
                              (queue,)).fetchone()
        assert events is not None
        return int(events[0])
    return run


def run(ctx: SuiteContext) -> SuiteResult:
    events = EVENTS // 5 if ctx.quick else EVENTS
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        plain = Drain(ctx.dsn, conn, "plain")
        recorded = Drain(ctx.dsn, conn, "recorded", record=True)
        drains = measure([
            Case("drain", "Worker, 16 slots, no-op handler", events, plain.run,
                 warmup=events // 10, prepare=plain.prepare),
            Case("drain.record", "the same with record=True", events, recorded.run,
                 warmup=events // 10, prepare=recorded.prepare, baseline="drain"),
        ], ctx.repeats)
        plain.close()
        recorded.close()  # its last acks, and their record, are in once it stopped
        # The last recorded run's record stays (prepare forgets at the next run):
        # its check, timed by the same harness.
        checked = measure([Case("verify", "verify_handling over the recorded run, events checked",
                                events, _verify_rate(conn, "recorded"), warmup=events)],
                          ctx.repeats)
    return SuiteResult(parameters={"events_per_run": events, "slots": SLOTS, "keys": KEYS,
                                   "tick_every": TICK_EVERY, "repeats": ctx.repeats},
                       measurements=[*drains, *checked])


SUITE = register(Suite(
    name="verify",
    description="a Worker's drain with and without record=True; verify_handling's rate",
    run=run,
))
