"""Suite ``curves``: what the engine's operations cost as the number of queues grows.

Issue 32 asks for the cost of each operation against the number of queues
(1, 100, 1,000, 5,000), and for no step larger than 1.5x per event between
the ends of a curve. The database grows from one queue to the largest count;
at each count, on that database:

* ``send``: one event per transaction, into the newest queue (beyond the
  event writer's 512 tables from about 170 queues on: its dynamic path) and
  into the first queue (always in the writer);
* ``send_batch``: batches of 100 into the newest queue;
* ``drain``: receive + ack of whole batches of the events sent above, on the
  newest queue;
* ``ticker()``: one call of the ticker's poll (``Client.ticker()``, a chunk of
  queues a statement) with every queue idle, and ``maint()``: one
  maintenance pass over every queue, idle;
* ``first send``: the first send of a new session after a queue was created
  (PL/pgSQL compiles the event writer there);
* ``create_queue``: the mean time of the ones that grew the database to this
  count.

Per-call costs are medians of ``repeats`` rounds; per-event costs are
microseconds an event. One connection, durable settings, the server's clock
not involved: wall time on the client.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

import pgque
from bench.measure import Measurement
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

QUEUE_COUNTS = (1, 100, 1_000, 5_000)
QUICK_QUEUE_COUNTS = (1, 100, 400)
SENDS = 1_000
BATCHES = 20
BATCH = 100
CALLS = 20  # ticker() and maint() calls per round
US = "µs"
MS = "ms"


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _sends(conn: psycopg.Connection[Any], queue: str) -> float:
    """Seconds for SENDS one-event transactions into queue."""
    start = time.perf_counter()
    for _ in range(SENDS):
        conn.execute("select pgque.send(%s, 'e', '{}', 'k')", (queue,))
    return time.perf_counter() - start


def _point(client: pgque.Client, dsn: str, newest: str, first: str,
           repeats: int) -> dict[str, list[float]]:
    """Every figure of one queue count, ``repeats`` rounds each."""
    conn = client.conn
    figures: dict[str, list[float]] = {name: [] for name in (
        "send_newest", "send_first", "send_batch", "drain", "ticker", "maint", "first_send")}
    events = [("e", {"n": i}, f"k{i % 64}") for i in range(BATCH)]
    for _ in range(repeats):
        for name, queue in (("send_newest", newest), ("send_first", first)):
            figures[name].append(_sends(conn, queue) / SENDS * 1e6)
        seconds = _timed(lambda: [client.send_batch(newest, events) for _ in range(BATCHES)])
        figures["send_batch"].append(seconds / (BATCHES * BATCH) * 1e6)
        client.tick(newest)
        drained = 0

        def drain() -> None:
            nonlocal drained
            while (batch := client.receive(newest, "c")) is not None:
                drained += len(batch.messages)
                client.ack(batch)
        seconds = _timed(drain)
        figures["drain"].append(seconds / max(drained, 1) * 1e6)
        # The Ticker's poll: Client.ticker(), which goes through the queues a
        # chunk (Client.tick_chunk) a statement since 0.9.
        figures["ticker"].append(
            _timed(lambda: [client.ticker() for _ in range(CALLS)]) / CALLS * 1e3)
        figures["maint"].append(
            _timed(lambda: [conn.execute("select * from pgque.maint()").fetchall()
                            for _ in range(CALLS)]) / CALLS * 1e3)
        # A new session's first send after a change of the writer (a queue made
        # and dropped: the writer is written again, twice).
        client.create_queue("curves_probe")
        client.drop_queue("curves_probe", force=True)
        client.maintenance()
        with psycopg.connect(dsn, autocommit=True) as fresh:
            figures["first_send"].append(_timed(lambda: fresh.execute(
                "select pgque.send(%s, 'e', '{}', 'k')", (newest,))) * 1e3)
    return figures


def run(ctx: SuiteContext) -> SuiteResult:
    counts = QUICK_QUEUE_COUNTS if ctx.quick else QUEUE_COUNTS
    points: dict[int, dict[str, list[float]]] = {}
    create_ms: dict[int, float] = {}
    with pgque.connect(ctx.dsn, pool_size=0) as client:
        made = 0
        for count in counts:
            start = time.perf_counter()
            added = count - made
            for i in range(made, count):
                client.create_queue(f"q{i:05d}")
            if added:
                create_ms[count] = (time.perf_counter() - start) / added * 1e3
            made = count
            newest, first = f"q{count - 1:05d}", "q00000"
            client.subscribe(newest, "c")
            client.maintenance()
            points[count] = _point(client, ctx.dsn, newest, first, ctx.repeats)
            client.unsubscribe(newest, "c")
            print(f"  {count:>5} queues: " + ", ".join(
                f"{name} {statistics.median(v):.1f}" for name, v in points[count].items()),
                flush=True)
    labels = {
        "send_newest": ("send, one event a transaction, newest queue", US),
        "send_first": ("send, one event a transaction, first queue", US),
        "send_batch": ("send_batch of 100, newest queue, an event", US),
        "drain": ("receive + ack, newest queue, an event", US),
        "ticker": ("ticker() with every queue idle, a call", MS),
        "maint": ("maint() with every queue idle, a pass", MS),
        "first_send": ("a new session's first send after a change", MS),
    }
    measurements: list[Measurement] = []
    for name, (label, unit) in labels.items():
        for count in counts:
            values = points[count][name]
            measurements.append(Measurement(
                name=f"{name}.q{count}", label=f"{count:,} queues", events=0,
                values=[round(v, 2) for v in values],
                median=statistics.median([round(v, 2) for v in values]),
                unit=unit, group=label))
    for count, value in create_ms.items():
        measurements.append(Measurement(
            name=f"create_queue.q{count}", label=f"{count:,} queues", events=0,
            values=[round(value, 2)], median=round(value, 2), unit=MS,
            group="create_queue, mean of those that grew the database to this count"))
    parameters: dict[str, Any] = {
        "queue_counts": list(counts), "sends": SENDS, "batches": BATCHES, "batch": BATCH,
        "calls": CALLS, "repeats": ctx.repeats,
        "steps": {name: _steps([statistics.median(points[c][name]) for c in counts])
                  for name in labels},
    }
    return SuiteResult(parameters=parameters, measurements=measurements)


def _steps(medians: list[float]) -> dict[str, float]:
    """The curve's largest step between neighbours and its end-to-end ratio."""
    steps = [b / a for a, b in itertools.pairwise(medians) if a > 0]
    return {"largest_step": round(max(steps, default=1.0), 2),
            "ends": round(medians[-1] / medians[0], 2) if medians[0] > 0 else 0.0}


SUITE = register(Suite(
    name="curves",
    description="cost of send, send_batch, drain, ticker() and maint() against the number "
                "of queues (1 to 5,000)",
    run=run,
    default=False,
))
