"""Suite ``delayed``: what delayed and idempotent sends cost, how late delayed
events come, and what their tables leave behind under a held xmin horizon.

Three parts, each against a fresh queue:

* **cost**: events/s of sending on one connection, one event per transaction
  (``pgque.send`` against ``send_with`` with a delay of an hour, and with a new
  idempotency key per event) and in batches of 100 (``send_batch`` against
  ``send_batch_with``, the same options per event), by turns; the ratios are
  against the plain send of the same shape;
* **lateness**: 10,000 events sent at once with due times spread over one
  second, 3 s ahead, while a ``pgque.Ticker`` with its defaults runs and a
  consumer receives and acks in a loop. For each event: how late it entered
  the log (its ``created_at``, the moving tick's time, minus its due time)
  and how late it was handed out (the database clock when the receive that
  returned it ran, minus its due time);
* **bloat**: a session opens a REPEATABLE READ transaction and keeps its
  snapshot (vacuum can then remove nothing that dies meanwhile), and
  1,000,000 delayed events are sent in batches of 1,000 with due times
  from one second to 30 days ahead (half of them due within the run, spread
  over a minute), while the Ticker runs maintenance every second, the delayed
  events' rotation looks every 5 s (``rt_period``) and a consumer drains what
  falls due. Then 1,000,000 sends with idempotency keys (a tenth of them
  repeated), the queue's window 10 s. After each, pgstattuple counts the live
  and dead tuples of ``pgque.delayed_event`` and ``pgque.idempotency_key``
  (their partitions) and of the queue's event tables, still under the held
  snapshot.
"""

from __future__ import annotations

import random
import statistics
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg

import pgque
from bench.measure import BenchError, Case, Measurement, Workload, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

COST_EVENTS = 5_000
BATCH = 100
LATENESS_EVENTS = 10_000
LATENESS_AHEAD = 3.0  # seconds from the send to the first due time
BLOAT_EVENTS = 1_000_000
BLOAT_BATCH = 1_000
BLOAT_DUE_SOON = 60.0  # seconds over which the half due within the run falls due
MAX_DELAY = 30 * 86_400.0
IDEMPOTENCY_WINDOW = 10.0
MS = "ms"
TUPLES = "tuples"

_TABLES = """
select c.relname, t.tuple_count, t.dead_tuple_count
  from pg_class c cross join lateral pgstattuple(c.oid) t
 where c.relnamespace = 'pgque'::regnamespace and c.relkind = 'r'
   and c.relname ~ '^(delayed_event|idempotency_key|event_[0-9]+)'
 order by 1
"""


class _Sender:
    """Sends to one queue on its own connection, one shape of send per workload."""

    def __init__(self, dsn: str, queue: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.queue = queue
        self.serial = 0
        self.conn.execute("select pgque.create_queue(%s)", (queue,))

    def one(self, statement: str, option: str | None) -> Workload:
        def run(count: int) -> int:
            for _ in range(count):
                self.serial += 1
                key = f"key-{self.serial}"
                params: tuple[Any, ...] = (self.queue, "e", '{"n": 1}', f"t-{self.serial % 64}")
                if option == "delay":
                    params += (timedelta(hours=1),)
                elif option == "idempotency":
                    params += (key,)
                self.conn.execute(statement, params)
            return count
        return run

    def batch(self, statement: str, option: str | None) -> Workload:
        def run(count: int) -> int:
            for start in range(0, count, BATCH):
                n = min(BATCH, count - start)
                serials = range(self.serial + 1, self.serial + n + 1)
                self.serial += n
                params: tuple[Any, ...] = (self.queue, ["e"] * n, ['{"n": 1}'] * n,
                                           [f"t-{s % 64}" for s in serials])
                if option == "delay":
                    params += ([timedelta(hours=1)] * n,)
                elif option == "idempotency":
                    params += ([f"key-{s}" for s in serials],)
                self.conn.execute(statement, params)
            return count
        return run


def _cost(ctx: SuiteContext) -> list[Measurement]:
    events = COST_EVENTS // 5 if ctx.quick else COST_EVENTS
    sender = _Sender(ctx.dsn, "cost")
    one = "select pgque.send(%s, %s, %s::text, %s)"
    delayed = "select pgque.send_with(%s, %s, %s::text, %s, p_deliver_after => %s)"
    keyed = "select pgque.send_with(%s, %s, %s::text, %s, p_idempotency_key => %s)"
    batch = "select pgque.send_batch(%s, %s::text[], %s::text[], %s::text[])"
    batch_delayed = ("select count(*) from pgque.send_batch_with(%s, %s::text[], %s::text[],"
                     " %s::text[], p_deliver_afters => %s::interval[])")
    batch_keyed = ("select count(*) from pgque.send_batch_with(%s, %s::text[], %s::text[],"
                   " %s::text[], p_idempotency_keys => %s::text[])")
    try:
        cases = [
            Case("send", "send, one event a transaction", events, sender.one(one, None),
                 warmup=events // 10),
            Case("send_delayed", "send_with deliver_after 1 h", events,
                 sender.one(delayed, "delay"), warmup=events // 10, baseline="send"),
            Case("send_idempotent", "send_with a new idempotency key", events,
                 sender.one(keyed, "idempotency"), warmup=events // 10, baseline="send"),
            Case("batch", f"send_batch of {BATCH}", events * 10, sender.batch(batch, None),
                 warmup=events),
            Case("batch_delayed", f"send_batch_with of {BATCH}, each delayed 1 h", events * 10,
                 sender.batch(batch_delayed, "delay"), warmup=events, baseline="batch"),
            Case("batch_idempotent", f"send_batch_with of {BATCH}, each with a new key",
                 events * 10, sender.batch(batch_keyed, "idempotency"), warmup=events,
                 baseline="batch"),
        ]
        return [_grouped(m, "cost") for m in measure(cases, ctx.repeats)]
    finally:
        # Gone, with its delayed events and keys (a 24 h window), before the parts
        # that count what the tables hold.
        sender.conn.execute("select pgque.drop_queue('cost', true)")
        sender.conn.close()


def _grouped(m: Measurement, group: str) -> Measurement:
    return Measurement(m.name, m.label, m.events, m.values, m.median, m.baseline, m.ratio,
                       m.unit, group, m.target)


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def _lateness(ctx: SuiteContext) -> tuple[list[Measurement], dict[str, Any]]:
    """10,000 events due within one second: how late each entered the log and was handed out."""
    count = LATENESS_EVENTS // 10 if ctx.quick else LATENESS_EVENTS
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        client = pgque.Client(conn)
        client.create_queue("lateness")
        client.subscribe("lateness", "c")
        ticker = pgque.Ticker(ctx.dsn)
        ticker.start()
        try:
            if not ticker.wait_active(30):
                raise BenchError("the ticker did not become active")
            start = conn.execute("select clock_timestamp()").fetchone()[0]  # type: ignore[index]
            offsets = [LATENESS_AHEAD + random.random() for _ in range(count)]
            dues = [start + timedelta(seconds=o) for o in offsets]
            for first in range(0, count, 1_000):
                chunk = dues[first:first + 1_000]
                client.send_batch("lateness", [
                    pgque.Event("e", {"due": d.isoformat()}, f"k-{(first + i) % 100}",
                                deliver_at=d) for i, d in enumerate(chunk)])
            entered: list[float] = []
            handed: list[float] = []
            deadline = time.monotonic() + LATENESS_AHEAD + 60
            while len(handed) < count:
                if time.monotonic() > deadline:
                    raise BenchError(f"only {len(handed)} of {count} delayed events came")
                batch = client.receive("lateness", "c")
                if batch is None:
                    time.sleep(0.001)
                    continue
                now = conn.execute("select clock_timestamp()").fetchone()[0]  # type: ignore[index]
                for m in batch:
                    due = m.payload["due"]
                    due_at = datetime.fromisoformat(due)
                    if m.created_at < due_at or now < due_at:
                        raise BenchError(f"event {m.id} came before its time")
                    entered.append((m.created_at - due_at).total_seconds() * 1000)
                    handed.append((now - due_at).total_seconds() * 1000)
                client.ack(batch)
        finally:
            ticker.stop()
            client.drop_queue("lateness", force=True)
    measurements = []
    for name, values in (("entered", entered), ("handed_out", handed)):
        for p in (0.5, 0.9, 0.99, 1.0):
            label = f"{name.replace('_', ' ')}: {'max' if p == 1.0 else f'p{int(p * 100)}'}"
            value = _percentile(values, p)
            measurements.append(Measurement(f"{name}_p{int(p * 100)}", label, count, [value],
                                            value, unit=MS, group="lateness"))
    return measurements, {"lateness_events": count,
                          "lateness_mean_ms": {"entered": statistics.fmean(entered),
                                               "handed_out": statistics.fmean(handed)}}


def _tuples(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    return {name: (live, dead) for name, live, dead in conn.execute(_TABLES).fetchall()}


def _drain(client: pgque.Client, queue: str) -> int:
    got = 0
    while (batch := client.receive(queue, "c")) is not None:
        got += len(batch)
        client.ack(batch)
    return got


def _bloat(ctx: SuiteContext) -> tuple[list[Measurement], dict[str, Any]]:
    """1,000,000 delayed sends, then 1,000,000 idempotent ones, under a held snapshot."""
    count = BLOAT_EVENTS // 10 if ctx.quick else BLOAT_EVENTS
    results: dict[str, Any] = {}
    measurements: list[Measurement] = []
    with psycopg.connect(ctx.dsn, autocommit=True) as conn, \
            psycopg.connect(ctx.dsn) as holder:
        conn.execute("create extension if not exists pgstattuple")
        conn.execute("update pgque.rotation set rt_period = '5 seconds'"
                     " where rt_name = 'delayed'")
        client = pgque.Client(conn)
        client.create_queue("bloat", idempotency_window=IDEMPOTENCY_WINDOW)
        client.subscribe("bloat", "c")
        holder.execute("set transaction isolation level repeatable read")
        held_xmin = holder.execute("select pg_snapshot_xmin(pg_current_snapshot())").fetchone()
        ticker = pgque.Ticker(ctx.dsn)
        ticker.start()
        try:
            if not ticker.wait_active(30):
                raise BenchError("the ticker did not become active")
            # Delayed: half due within BLOAT_DUE_SOON seconds, half from then to 30 days.
            started = time.monotonic()
            received = 0
            for first in range(0, count, BLOAT_BATCH):
                n = min(BLOAT_BATCH, count - first)
                delays = [timedelta(seconds=1 + random.random() * BLOAT_DUE_SOON)
                          if (first + i) % 2 else
                          timedelta(seconds=BLOAT_DUE_SOON + random.random() * MAX_DELAY * 0.99)
                          for i in range(n)]
                client.send_batch("bloat", [
                    pgque.Event("e", None, f"k-{(first + i) % 10_000}", deliver_after=d)
                    for i, d in enumerate(delays)])
                received += _drain(client, "bloat")
            send_seconds = time.monotonic() - started
            deadline = time.monotonic() + BLOAT_DUE_SOON + 120
            while received < count // 2:
                if time.monotonic() > deadline:
                    raise BenchError(f"only {received} of {count // 2} due events came")
                received += _drain(client, "bloat")
                time.sleep(0.05)
            time.sleep(12)  # two more looks of the delayed rotation (rt_period 5 s)
            received += _drain(client, "bloat")
            delayed = _tuples(conn)
            results["delayed"] = {"sent": count, "received": received,
                                  "send_seconds": round(send_seconds, 1), "tables": delayed}
            # Idempotent: a tenth of the keys repeated; the window passes several times.
            started = time.monotonic()
            duplicates = 0
            for first in range(0, count, BLOAT_BATCH):
                n = min(BLOAT_BATCH, count - first)
                # Every tenth repeats the key sent 4,999 sends before (itself not a repeat).
                keys = [f"key-{first + i - 4_999}" if (first + i) % 10 == 0 and first >= 5_000
                        else f"key-{first + i}" for i in range(n)]
                sent = client.send_batch("bloat", [pgque.Event("e", None, f"k-{i % 10_000}",
                                                               idempotency_key=k)
                                                   for i, k in enumerate(keys)])
                duplicates += sum(1 for s in sent if s.duplicate)
                received += _drain(client, "bloat")
            idem_seconds = time.monotonic() - started
            time.sleep(IDEMPOTENCY_WINDOW + 2)
            client.maintenance()
            received += _drain(client, "bloat")
            keyed = _tuples(conn)
            results["idempotency"] = {"sent": count, "duplicates": duplicates,
                                      "send_seconds": round(idem_seconds, 1), "tables": keyed}
            still = holder.execute("select pg_snapshot_xmin(pg_current_snapshot())").fetchone()
            if still != held_xmin:
                raise BenchError("the held snapshot moved")
        finally:
            ticker.stop()
            holder.rollback()
    for part, tables in (("delayed", delayed), ("idempotency", keyed)):
        table = "delayed_event" if part == "delayed" else "idempotency_key"
        dead = sum(d for name, (_live, d) in tables.items() if name.startswith(table))
        live = sum(v for name, (v, _dead) in tables.items() if name.startswith(table))
        events_dead = sum(d for name, (_live, d) in tables.items() if name.startswith("event_"))
        for name, label, value in ((f"{part}_dead", f"{table}: dead tuples", dead),
                                   (f"{part}_live", f"{table}: live tuples", live),
                                   (f"{part}_event_dead", "event tables: dead tuples",
                                    events_dead)):
            measurements.append(Measurement(name, label, count, [float(value)], float(value),
                                            unit=TUPLES, group=f"bloat_{part}"))
    return measurements, results


def run(ctx: SuiteContext) -> SuiteResult:
    measurements = _cost(ctx)
    lateness, lateness_parameters = _lateness(ctx)
    bloat, bloat_results = _bloat(ctx)
    return SuiteResult(
        parameters={"cost_events": COST_EVENTS // 5 if ctx.quick else COST_EVENTS,
                    "batch": BATCH, "repeats": ctx.repeats, **lateness_parameters,
                    "bloat_events": BLOAT_EVENTS // 10 if ctx.quick else BLOAT_EVENTS,
                    "bloat": bloat_results},
        measurements=measurements + lateness + bloat)


SUITE = register(Suite(
    name="delayed",
    description="delayed and idempotent sends: cost, lateness, tables under a held snapshot",
    run=run,
))
