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

from collections.abc import Callable

import psycopg

import pgque
from bench.measure import Case, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register

EVENTS = 100_000  # a run's events (a fifth with --quick)
SLOTS = 16
KEYS = 64
TICK_EVERY = 1_000


class _Drain:
    """A queue and group drained by a fresh Worker per run, recording or not."""

    def __init__(self, dsn: str, conn: psycopg.Connection[object], name: str,
                 record: bool) -> None:
        self.dsn = dsn
        self.conn = conn
        self.queue = name
        self.record = record
        conn.execute("select pgque.create_queue(%s, %s)",
                     (name, f'{{"ticker_max_count": {TICK_EVERY}}}'))
        conn.execute("select pgque.subscribe_slots(%s, 'g', %s)", (name, SLOTS))

    def prepare(self, count: int) -> None:
        self.conn.execute("select pgque.forget_handling(%s, 'g', %s)", (self.queue, SLOTS))
        for start in range(0, count, TICK_EVERY):
            n = min(TICK_EVERY, count - start)
            self.conn.execute(
                "select pgque.send_batch(%s, %s, %s, %s)",
                (self.queue, ["e"] * n, ['{"n": 1}'] * n,
                 [f"tenant-{(start + i) % KEYS}" for i in range(n)]))
            self.conn.execute("select pgque.tick(%s)", (self.queue,))

    def run(self, count: int) -> int:
        def handle(message: pgque.Message[object]) -> None:
            pass

        worker = pgque.Worker(self.dsn, queue=self.queue, consumer="g", slots=SLOTS,
                              handler=handle, ticker=False, poll_interval=0.05,
                              record=self.record, name=f"bench-{self.queue}")
        with worker:
            worker.wait(lambda: worker.handled >= count, timeout=600)
        return worker.handled


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
        plain = _Drain(ctx.dsn, conn, "plain", record=False)
        recorded = _Drain(ctx.dsn, conn, "recorded", record=True)
        drains = measure([
            Case("drain", "Worker, 16 slots, no-op handler", events, plain.run,
                 warmup=events // 10, prepare=plain.prepare),
            Case("drain.record", "the same with record=True", events, recorded.run,
                 warmup=events // 10, prepare=recorded.prepare, baseline="drain"),
        ], ctx.repeats)
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
