"""Suite ``bloat``: dead tuples in pgque's own tables while a steady load runs.

The metric is that of the public benchmark hardbyte/postgresql-job-queue-benchmarking:
the sum of ``n_dead_tup`` over the queue system's tables, sampled every 5 s
while producers and consumers run. Here:

* one queue, a consumer group of N = 16 slots drained by one worker process
  (``bench.worker_process``, a ``pgque.Worker`` with its defaults: its own
  Ticker, which also runs maintenance every second, LISTEN, pieces of 100
  events, a thread per slot) with a no-op handler;
* this process sends at a fixed offered rate (800 and 5,000 events/s) with
  ``send_batch`` every 50 ms on a schedule of due times from the start, on
  its own connection, with partition keys cycling over 10,000 keys;
* a thread with a connection of its own samples ``pg_stat_user_tables`` for
  schema pgque every 5 s: dead tuples of every table, the sum without the
  queue's event tables (``event_<id>`` and ``event_<id>_<n>``, which are
  rotated and truncated rather than vacuumed), and the size of the other
  tables.

Autovacuum runs at the server's defaults. Every event sent must be handled
exactly once, or the run fails.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

import pgque
from bench.measure import BenchError, Measurement
from bench.processes import WorkerProcess, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

CONSUMER = "bench"
EVENT_TYPE = "e"
SLOTS = 16
KEYS = 10_000  # distinct partition keys, cycled through
RATES = (800, 5_000)  # offered events/s
SEND_PERIOD = 0.05  # seconds between send_batch calls: rate * 0.05 events each
SAMPLE_INTERVAL = 5.0  # seconds between samples, as the public benchmark
TOP_TABLES = 5  # tables listed per rate, by peak dead tuples
# The goal set against this metric (printed and drawn beside the figures, not
# asserted): at both rates, over the samples of all of pgque's tables.
GOALS = {"median": 100, "peak": 500}
CATCH_UP_TIMEOUT = 300.0  # seconds the worker may need to work off a backlog
CATCH_UP_POLL = 0.2
DEAD = "dead tuples"
BYTES = "bytes"

# The per-queue event tables: event_<queue id> and its rotated children
# event_<queue id>_<n> (not event_template, which holds no rows).
_EVENT_TABLE = r"^event_[0-9]+"

# What pg_stat_user_tables shows, no more: a backend reports its table
# counters at the end of a transaction at most once a second (an idle one
# within about 10 s), and pg_stat_force_next_flush() flushes only the calling
# backend's, so the figures lag the truth by that much. The public benchmark
# reads the view the same way. Sizes are left out for the event tables: the
# rotation truncates and drops them, and their size is the events' own.
_SAMPLE = """
select relname, n_dead_tup, relname ~ %(event)s as event_table,
       case when relname ~ %(event)s then null
            else pg_total_relation_size(relid) end as bytes
  from pg_stat_user_tables
 where schemaname = 'pgque'
"""
# Backlog of the group at the time of a sample: whether the worker keeps up.
_BACKLOG = """
select coalesce(sum(pending_events), 0)::bigint
  from pgque.partition_slot_status
 where queue_name = %s and consumer_name = %s
"""
# Where the dead tuples come from, read before and after a run (non-event
# tables). The same reporting lag applies: rows the setup wrote just before
# (the group's subscriptions and slot claims) may count as the run's.
_COUNTERS = """
select relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, autovacuum_count
  from pg_stat_user_tables
 where schemaname = 'pgque' and relname !~ %s
"""
_COUNTER_NAMES = ("inserted", "updated", "hot_updated", "deleted", "autovacuums")
_AUTOVACUUM_SETTINGS = """
select name, setting || coalesce(unit, '')
  from pg_settings
 where name like 'autovacuum%' or name in ('vacuum_cost_delay', 'vacuum_cost_limit')
 order by name
"""


@dataclass(frozen=True)
class Sizes:
    seconds: float  # of sending, per rate

    @classmethod
    def for_run(cls, quick: bool) -> Sizes:
        return cls(seconds=20.0) if quick else cls(seconds=120.0)


@dataclass
class _Sample:
    """One look at pg_stat_user_tables, ``at`` seconds after the first send."""

    at: float
    dead: dict[str, int]  # per table (every pgque table the view lists)
    event_tables: set[str]
    non_event_bytes: int
    backlog: int

    @property
    def dead_all(self) -> int:
        return sum(self.dead.values())

    @property
    def dead_non_event(self) -> int:
        return sum(n for name, n in self.dead.items() if name not in self.event_tables)


@dataclass
class _Run:
    """One rate's run: what was sent, how fast, and the samples taken meanwhile."""

    rate: int
    sent: list[int]
    sending_s: float
    catch_up_s: float
    samples: list[_Sample]
    counters: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def sent_rate(self) -> float:
        return len(self.sent) / self.sending_s

    @property
    def consumed_rate(self) -> float:
        # From the first send until the worker had handled the last one.
        return len(self.sent) / (self.sending_s + self.catch_up_s)


class _Sampler(threading.Thread):
    """Samples the pgque tables every SAMPLE_INTERVAL on a connection of its own,
    from ``start()`` until ``finish()``, which takes one last sample."""

    def __init__(self, dsn: str, queue: str) -> None:
        super().__init__(name="bloat-sampler", daemon=True)
        self._conn = psycopg.connect(dsn, autocommit=True,
                                     application_name="bench-bloat-sampler")
        self._queue = queue
        self._done = threading.Event()
        self._start = 0.0
        self.samples: list[_Sample] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        self._start = time.monotonic()
        super().start()

    def run(self) -> None:
        try:
            due = self._start + SAMPLE_INTERVAL  # not at 0 s: the tables were just vacuumed
            while not self._done.wait(max(0.0, due - time.monotonic())):
                self.samples.append(self._sample())
                due += SAMPLE_INTERVAL
        except BaseException as exc:  # raised again by finish(), in the suite's thread
            self.error = exc

    def finish(self) -> list[_Sample]:
        """Stop sampling, take the last sample, and return them all."""
        self._done.set()
        self.join()
        if self.error is not None:
            raise BenchError(f"sampling failed: {self.error!r}") from self.error
        self.samples.append(self._sample())
        return self.samples

    def close(self) -> None:
        """Stop sampling (if still running) and close the connection; idempotent."""
        self._done.set()
        if self.is_alive():
            self.join()
        self._conn.close()

    def _sample(self) -> _Sample:
        at = time.monotonic() - self._start
        rows = self._conn.execute(_SAMPLE, {"event": _EVENT_TABLE}).fetchall()
        backlog = self._conn.execute(_BACKLOG, (self._queue, CONSUMER)).fetchone()
        return _Sample(at=at, dead={name: int(dead) for name, dead, _, _ in rows},
                       event_tables={name for name, _, event, _ in rows if event},
                       non_event_bytes=sum(int(size or 0) for *_, size in rows),
                       backlog=int(backlog[0]) if backlog else 0)


def _send_paced(client: pgque.Client, queue: str, rate: int, seconds: float) -> list[int]:
    """``rate * seconds`` events in ``send_batch`` calls every SEND_PERIOD; returns their ids.

    Due counts from the start, not a fixed batch after each sleep: a slow call
    does not lower the rate, the next one sends what fell due meanwhile."""
    total = round(rate * seconds)
    ids: list[int] = []
    start = time.monotonic()
    step = 0
    while len(ids) < total:
        step += 1
        delay = start + step * SEND_PERIOD - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        due = min(total, round(rate * step * SEND_PERIOD))
        rows = []
        for n in range(len(ids), due):
            key = f"key-{n % KEYS}"
            rows.append((EVENT_TYPE, {"n": n, "key": key}, key))
        if rows:
            ids += client.send_batch(queue, rows)
    return ids


def _wait_caught_up(client: pgque.Client, queue: str, worker: WorkerProcess) -> float:
    """Block until every slot has consumed every event sent; returns how long it took."""
    start = time.monotonic()
    while True:
        slots = client.partition_slot_status(queue)
        if slots and all(s.pending_events == 0 and s.open_batch_id is None
                         and s.ticks_behind == 0 for s in slots):
            return time.monotonic() - start
        if time.monotonic() - start > CATCH_UP_TIMEOUT:
            raise BenchError(f"{queue}: the worker did not catch up within "
                             f"{CATCH_UP_TIMEOUT:.0f} s: {slots}")
        worker.check_alive()
        time.sleep(CATCH_UP_POLL)


def _vacuum(conn: psycopg.Connection[Any]) -> None:
    """Vacuum every pgque table, so a run starts without the dead tuples of the one
    before it (a dropped queue's rows, its cursors) and counts only its own."""
    names = [row[0] for row in conn.execute(
        "select relname from pg_stat_user_tables where schemaname = 'pgque'").fetchall()]
    conn.execute(sql.SQL("vacuum {}").format(
        sql.SQL(", ").join(sql.Identifier("pgque", name) for name in names)))


def _counters(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(v) for v in values)
            for name, *values in conn.execute(_COUNTERS, (_EVENT_TABLE,)).fetchall()}


def _run_rate(client: pgque.Client, plain: psycopg.Connection[Any], dsn: str, rate: int,
              sizes: Sizes) -> _Run:
    """A fresh queue and worker process; send at ``rate`` while sampling, wait until the
    worker has caught up, and check that it handled every event once."""
    queue = f"bloat_r{rate}"
    client.create_queue(queue)
    client.subscribe_slots(queue, CONSUMER, slots=SLOTS)
    client.maintenance(queue)  # the slot index at once, not at the worker's first pass
    # The setup's counters (and the previous rate's dropped queue's) reach
    # pg_stat before the vacuum, not after it: flushed late, its deleted rows
    # would count as dead tuples of this run.
    client.conn.execute("select pg_stat_force_next_flush()")
    _vacuum(plain)
    worker = WorkerProcess(dsn, queue, CONSUMER, "--slots", str(SLOTS), "--handler", "noop")
    try:
        wait_for_group(client, queue, CONSUMER, [worker])
        before = _counters(plain)
        sampler = _Sampler(dsn, queue)
        sampler.start()
        try:
            start = time.monotonic()
            sent = _send_paced(client, queue, rate, sizes.seconds)
            sending_s = time.monotonic() - start
            catch_up_s = _wait_caught_up(client, queue, worker)
            samples = sampler.finish()
        finally:
            sampler.close()
        after = _counters(plain)
        result = worker.stop()
    finally:
        worker.close()
    client.drop_queue(queue, force=True)

    handled = set(result.ids)
    if len(result.ids) != len(handled) or handled != set(sent) or result.failed:
        raise BenchError(f"{queue}: {len(sent)} events sent, {len(result.ids)} handled "
                         f"({len(handled)} distinct, {len(handled - set(sent))} not sent, "
                         f"{len(set(sent) - handled)} lost, {result.failed} failed)")
    counters = {name: dict(zip(_COUNTER_NAMES, (a - b for a, b in zip(
                    values, before.get(name, (0,) * len(values)), strict=True)), strict=True))
                for name, values in after.items()}
    return _Run(rate=rate, sent=sent, sending_s=sending_s, catch_up_s=catch_up_s,
                samples=samples, counters=counters)


def _top_tables(run: _Run) -> list[dict[str, Any]]:
    """The tables with the most dead tuples at their peak, with what was done to them."""
    names = {name for s in run.samples for name in s.dead}
    event_tables = set().union(*(s.event_tables for s in run.samples))
    series = {name: [s.dead.get(name, 0) for s in run.samples] for name in names}
    top = sorted((name for name in names if max(series[name]) > 0),
                 key=lambda name: (-max(series[name]), name))[:TOP_TABLES]
    return [{"table": name, "event_table": name in event_tables,
             "peak": max(series[name]), "median": statistics.median(series[name]),
             **({"during_run": run.counters[name]} if name in run.counters else {})}
            for name in top]


def _figures(run: _Run) -> dict[str, Any]:
    dead_all = [s.dead_all for s in run.samples]
    dead_non_event = [s.dead_non_event for s in run.samples]
    sizes = [s.non_event_bytes for s in run.samples]
    return {
        "dead_all": {"median": statistics.median(dead_all), "peak": max(dead_all)},
        "dead_non_event": {"median": statistics.median(dead_non_event),
                           "peak": max(dead_non_event)},
        "non_event_bytes": {"final": sizes[-1], "peak": max(sizes)},
    }


def _measurements(run: _Run, figures: dict[str, Any]) -> list[Measurement]:
    events = len(run.sent)
    rate = f"{run.rate:,} events/s"
    measurements = []
    for key, group in (
            ("dead_all", "dead tuples, all pgque tables (5-s samples of pg_stat_user_tables)"),
            ("dead_non_event", "dead tuples, pgque tables but the event tables")):
        for stat in ("median", "peak"):
            value = float(figures[key][stat])
            measurements.append(Measurement(
                name=f"r{run.rate}.{key}.{stat}", label=f"{rate}: {stat} of the samples",
                events=events, values=[value], median=value, unit=DEAD, group=group,
                target=float(GOALS[stat]) if key == "dead_all" else None))
    for stat in ("final", "peak"):
        value = float(figures["non_event_bytes"][stat])
        measurements.append(Measurement(
            name=f"r{run.rate}.non_event_bytes.{stat}", label=f"{rate}: {stat} size",
            events=events, values=[value], median=value, unit=BYTES,
            group="size of pgque's tables but the event tables (pg_total_relation_size)"))
    measurements.append(Measurement(
        name=f"r{run.rate}.consumed", label=f"{rate} offered: handled",
        events=events, values=[run.consumed_rate], median=run.consumed_rate,
        group="load kept: events handled / s, first send to last handled"))
    return measurements


def _autovacuum_settings(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return {name: value for name, value in conn.execute(_AUTOVACUUM_SETTINGS).fetchall()}


def run(ctx: SuiteContext) -> SuiteResult:
    """One run per offered rate, each on a fresh queue with a fresh worker process."""
    sizes = Sizes.for_run(ctx.quick)
    measurements: list[Measurement] = []
    details: dict[str, Any] = {}
    with pgque.connect(ctx.dsn, pool_size=0) as client, \
            psycopg.connect(ctx.dsn, autocommit=True) as plain:
        autovacuum = _autovacuum_settings(plain)
        for rate in RATES:
            run_ = _run_rate(client, plain, ctx.dsn, rate, sizes)
            figures = _figures(run_)
            measurements += _measurements(run_, figures)
            dead = figures["dead_all"]
            _log(f"  {rate:>5}/s: sent at {run_.sent_rate:,.0f}/s, handled "
                 f"{run_.consumed_rate:,.0f}/s (caught up {run_.catch_up_s:.1f} s after the "
                 f"last send); dead tuples median {dead['median']:,.0f} (goal <= "
                 f"{GOALS['median']}), peak {dead['peak']:,} (goal <= {GOALS['peak']}); "
                 f"without event tables {figures['dead_non_event']['median']:,.0f} / "
                 f"{figures['dead_non_event']['peak']:,}")
            details[f"r{rate}"] = {
                **figures,
                "goal_met": {stat: dead[stat] <= goal for stat, goal in GOALS.items()},
                "events": len(run_.sent),
                "sent_rate": round(run_.sent_rate, 1),
                "consumed_rate": round(run_.consumed_rate, 1),
                "catch_up_s": round(run_.catch_up_s, 2),
                "top_tables": _top_tables(run_),
                # Rows inserted, updated and deleted, and autovacuums, of every
                # non-event table that had any during the run.
                "table_activity": {name: counts for name, counts in run_.counters.items()
                                   if any(counts.values())},
                "samples": [{"at_s": round(s.at, 1), "dead_all": s.dead_all,
                             "dead_non_event": s.dead_non_event,
                             "non_event_bytes": s.non_event_bytes, "backlog": s.backlog}
                            for s in run_.samples],
            }
    # One panel per group, the rates side by side in it (the chart groups by
    # first appearance; the terminal's table follows the list's order).
    groups = list(dict.fromkeys(m.group for m in measurements))
    measurements.sort(key=lambda m: groups.index(m.group))
    return SuiteResult(
        parameters={
            "rates": list(RATES),
            "seconds_per_rate": sizes.seconds,
            "slots": SLOTS,
            "partition_keys": KEYS,
            "send_period_s": SEND_PERIOD,
            "sample_interval_s": SAMPLE_INTERVAL,
            "goals_all_tables": GOALS,
            "producer": "this process, one connection: pgque.Client.send_batch of rate * "
                        f"{SEND_PERIOD} events every {SEND_PERIOD} s, on due times from the "
                        "start",
            "worker": "bench.worker_process --handler noop: pgque.Worker defaults (own Ticker "
                      "with maintenance every 1 s, listen=True, max_events=100, "
                      "concurrency = slots)",
            "sampling": "pg_stat_user_tables of schema pgque as the server shows it (backends "
                        "report their counters at most once a second), first sample 5 s after "
                        "the first send, last after the worker caught up; every pgque table is "
                        "vacuumed before each rate's run",
            "event_tables": _EVENT_TABLE,
            "autovacuum": {"configured": "server defaults", "settings": autovacuum},
            "runs": details,
            "repeats": 1,  # one run per rate: its samples are the series measured
        },
        measurements=measurements,
    )


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress on stderr, as bench.measure does


SUITE = register(Suite(
    name="bloat",
    description="dead tuples of pgque's tables under a steady load of 800 and 5,000 events/s "
                "(16 slots, default Worker, default autovacuum)",
    run=run,
))
