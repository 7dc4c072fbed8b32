"""Suite ``jobs``: the public job-queue benchmark's workloads, and what they cost the server.

The workload shapes of the PostgreSQL job-queue benchmark that compares
PgQue, pgmq, River, awa, Oban, pg-boss and procrastinate
(hardbyte/postgresql-job-queue-benchmarking), measured with our own code:

* a producer offers a fixed rate (800 and 5,000 jobs/s) in batches sent every
  10 to 25 ms (at most 128 jobs a batch; the batch holds what the rate owes
  since the last one), each batch one transaction;
* a job is 1 ms of work (``asyncio.sleep``); the consumer is one process: an
  ``AsyncWorker`` of N slots with ``key_concurrency=2`` (so 2N jobs at a time,
  32 for N = 16, the harness's handler count) and its defaults otherwise (its
  own Ticker, LISTEN);
* pickup latency: from the producer's commit acknowledged to the handler's
  first statement, both ``time.time()`` on this machine; completion rate (jobs
  whose handler started in the window, per second); each event handled once;
* a peak run: a backlog sent first, then the consumer started; the rate from
  its first handler start to its last.

And what the question of issue 32 is about: **the server's CPU for the same
work**, the CPU time of every process of the PostgreSQL server (postmaster
and all its children: the backends, the WAL writer, the checkpointer) over
the timed window, read from ``/proc``, per job and as a share of one core;
the consumer process's own the same way. The reference is PgQ (the C
extension, Debian's ``postgresql-NN-pgq3``) with one consumer
(bench.pgq_consumer: ``next_batch`` / ``get_batch_events`` / ``finish_batch``,
32 handlers at a time, ``pgq.ticker()`` every 5 ms), offered the same jobs in
the same sitting: the suite runs on a durable cluster of the newest machine
PostgreSQL that has PgQ (as the ``peers`` suite), else without the reference.
PgQue itself is not installable from a package registry here; PgQ is its
engine, so its single consumer is the floor PgQue's builds on.

Rounds alternate pgque and PgQ at each rate; the slot sweep (1, 4, 16 and 64
slots) runs once per slot count. The figures are medians of the rounds.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

import pgque
from bench.harness import BenchServer
from bench.measure import BenchError, Measurement
from bench.peers import _has_pgq, _pgq_bindir
from bench.processes import WorkerProcess, WorkerResult, cpu_seconds, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

CONSUMER = "bench"
EVENT_TYPE = "job"
KEYS = 1_000  # distinct partition keys (tenants), chosen at random per job
MAX_BATCH = 128
INTERVAL_S = (0.010, 0.025)  # between two producer batches
JOB_MS = 1.0
KEY_CONCURRENCY = 2
RATES = (800, 5_000)
MAIN_SLOTS = 16
SWEEP_SLOTS = (1, 4, 16, 64)
DRAIN_TIMEOUT = 120.0
#: Issue 32's goals on this machine.
GOALS = {"p50_ms_800": 10.0, "p99_ms_800": 30.0, "p99_ms_5000": 50.0,
         "server_cpu_vs_pgq": 2.0, "peak_jobs_per_s": 12_240.0}


@dataclass(frozen=True)
class Sizes:
    warmup: float  # seconds of offering before the window
    window: float  # seconds measured
    peak_backlog: int

    @classmethod
    def for_run(cls, quick: bool) -> Sizes:
        return cls(1.0, 4.0, 8_000) if quick else cls(2.0, 15.0, 40_000)


@dataclass
class RunResult:
    """One consumer at one offered rate (or a peak run)."""

    system: str  # "pgque" or "pgq"
    slots: int | None
    rate: int | None  # offered jobs/s; None for the peak run
    sent: int = 0
    completed_per_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0
    consumer_cpu_s: float = 0.0
    window_s: float = 0.0
    window_jobs: int = 0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def figures(self) -> dict[str, Any]:
        jobs = max(1, self.window_jobs)
        return {
            "system": self.system, "slots": self.slots, "rate": self.rate, "sent": self.sent,
            "completed_per_s": round(self.completed_per_s, 1),
            "p50_ms": round(self.percentile(0.50), 2), "p90_ms": round(self.percentile(0.90), 2),
            "p99_ms": round(self.percentile(0.99), 2),
            "max_ms": round(max(self.latencies_ms, default=float("nan")), 2),
            "server_cpu_pct": round(self.server_cpu_s / self.window_s * 100, 1)
            if self.window_s else None,
            "server_us_per_job": round(self.server_cpu_s / jobs * 1e6, 1),
            "consumer_cpu_pct": round(self.consumer_cpu_s / self.window_s * 100, 1)
            if self.window_s else None,
            "consumer_us_per_job": round(self.consumer_cpu_s / jobs * 1e6, 1),
        }


def server_cpu(conn: psycopg.Connection[Any]) -> Callable[[], float]:
    """A reader of the whole server's CPU seconds so far: the postmaster (the
    parent of this connection's backend) and every child of it, the ended ones
    included."""
    row = conn.execute("select pg_backend_pid()").fetchone()
    assert row is not None
    with open(f"/proc/{row[0]}/stat", encoding="ascii") as stat:
        postmaster = int(stat.read().rsplit(")", 1)[1].split()[1])

    def read() -> float:
        # The children that ended (a backend that disconnected, an autovacuum
        # worker) count in the postmaster's cutime and cstime once reaped.
        with open(f"/proc/{postmaster}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total = cpu_seconds(postmaster) + (int(fields[13]) + int(fields[14])) / _CLOCK_TICKS
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "stat").read_text(encoding="ascii")
                if int(text.rsplit(")", 1)[1].split()[1]) == postmaster:
                    total += cpu_seconds(int(entry.name))
            except (OSError, ValueError):
                continue  # gone meanwhile
        return total
    return read


class _Producer:
    """Offers ``rate`` jobs/s in batches every 10 to 25 ms, each batch one transaction,
    on its own connection and thread; keeps each job's commit acknowledgement."""

    def __init__(self, send: Callable[[list[tuple[str, str]]], list[int]], rate: int) -> None:
        self._send = send
        self.rate = rate
        self.acked: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jobs-producer", daemon=True)
        self.error: BaseException | None = None
        self._n = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise BenchError(f"producer failed: {self.error!r}")

    def _run(self) -> None:
        rng = random.Random(32)
        start = time.monotonic()
        owed_from = 0  # jobs offered so far
        try:
            while not self._stop.wait(rng.uniform(*INTERVAL_S)):
                due = int((time.monotonic() - start) * self.rate)
                while owed_from < due and not self._stop.is_set():
                    count = min(MAX_BATCH, due - owed_from)
                    jobs = [(f"tenant-{rng.randrange(KEYS)}", f'{{"n": {self._n + i}}}')
                            for i in range(count)]
                    ids = self._send(jobs)
                    now = time.time()  # the commit is acknowledged once the call returns
                    for event_id in ids:
                        self.acked[event_id] = now
                    owed_from += count
                    self._n += count
        except BaseException as exc:  # reported by stop()
            self.error = exc


def _pgque_sender(client: pgque.Client, queue: str) -> Callable[[list[tuple[str, str]]], list[int]]:
    def send(jobs: list[tuple[str, str]]) -> list[int]:
        return [int(i) for i in client.send_batch(
            queue, [pgque.Event(EVENT_TYPE, data, partition_key=key) for key, data in jobs])]
    return send


def _pgq_sender(conn: psycopg.Connection[Any], queue: str) -> Callable[[list[tuple[str, str]]],
                                                                        list[int]]:
    statement = ("select array_agg(pgq.insert_event(%s, %s, d, k, null, null, null))"
                 "  from unnest(%s::text[], %s::text[]) as e(k, d)")

    def send(jobs: list[tuple[str, str]]) -> list[int]:
        row = conn.execute(statement, (queue, EVENT_TYPE, [k for k, _ in jobs],
                                       [d for _, d in jobs])).fetchone()
        return list(row[0]) if row and row[0] else []
    return send


class _Systems:
    """How each system is set up, fed, consumed and waited for."""

    def __init__(self, dsn: str, client: pgque.Client, sql: psycopg.Connection[Any]) -> None:
        self.dsn = dsn
        self.client = client
        self.sql = sql
        self.made = 0

    def queue(self, system: str, slots: int | None) -> str:
        self.made += 1
        name = f"jobs_{system}_{slots or 0}_{self.made}"
        if system == "pgque":
            assert slots is not None
            self.client.create_queue(name)
            self.client.subscribe_slots(name, CONSUMER, slots=slots)
            self.client.maintenance(name)  # the slot index now, not at the worker's first pass
        else:
            self.sql.execute("select pgq.create_queue(%s)", (name,))
            self.sql.execute("select pgq.set_queue_config(%s, 'ticker_max_lag', '0')", (name,))
            self.sql.execute("select pgq.register_consumer(%s, %s)", (name, CONSUMER))
        return name

    def drop(self, system: str, queue: str) -> None:
        if system == "pgque":
            self.client.drop_queue(queue, force=True)
        else:
            self.sql.execute("select pgq.unregister_consumer(%s, %s)", (queue, CONSUMER))
            self.sql.execute("select pgq.drop_queue(%s)", (queue,))

    def sender(self, system: str, queue: str,
               conn: psycopg.Connection[Any]) -> Callable[[list[tuple[str, str]]], list[int]]:
        if system == "pgque":
            return _pgque_sender(pgque.Client(conn), queue)
        return _pgq_sender(conn, queue)

    def consumer(self, system: str, queue: str, slots: int | None) -> WorkerProcess:
        if system == "pgque":
            worker = WorkerProcess(self.dsn, queue, CONSUMER, "--async", "--slots", str(slots),
                                   "--handler", "pickup", "--sleep-ms", str(JOB_MS),
                                   "--key-concurrency", str(KEY_CONCURRENCY))
            wait_for_group(self.client, queue, CONSUMER, [worker])
            return worker
        return WorkerProcess(self.dsn, queue, CONSUMER, "--sleep-ms", str(JOB_MS),
                             "--handlers", str(MAIN_SLOTS * KEY_CONCURRENCY),
                             module="bench.pgq_consumer")

    def drained(self, system: str, queue: str) -> bool:
        if system == "pgque":
            slots = self.client.partition_slot_status(queue)
            return bool(slots) and all(s.pending_events == 0 and s.open_batch_id is None
                                       and s.ticks_behind == 0 for s in slots)
        row = self.sql.execute(
            "select pending_events, current_batch from pgq.get_consumer_info(%s, %s)",
            (queue, CONSUMER)).fetchone()
        return row is not None and row[0] == 0 and row[1] is None

    def wait_drained(self, system: str, queue: str, worker: WorkerProcess) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        calm = 0
        while calm < 3:  # three looks in a row: PgQ's pending count waits for a tick
            worker.check_alive()
            calm = calm + 1 if self.drained(system, queue) else 0
            if time.monotonic() > deadline:
                raise BenchError(f"{queue}: not drained within {DRAIN_TIMEOUT:.0f} s")
            time.sleep(0.1)


def _checked(queue: str, sent: dict[int, float], result: WorkerResult) -> dict[int, float]:
    started = dict(zip(result.ids, result.started, strict=True))
    if len(result.ids) != len(started) or set(started) != set(sent) or result.failed:
        raise BenchError(f"{queue}: {len(sent)} jobs sent, {len(result.ids)} handled "
                         f"({len(started)} distinct, {len(set(started) - set(sent))} not sent, "
                         f"{result.failed} failed)")
    return started


def _offered_run(systems: _Systems, system: str, slots: int | None, rate: int,
                 sizes: Sizes, cpu: Callable[[], float]) -> RunResult:
    queue = systems.queue(system, slots)
    worker = systems.consumer(system, queue, slots)
    result = RunResult(system, slots, rate)
    try:
        with psycopg.connect(systems.dsn, autocommit=True) as conn:
            producer = _Producer(systems.sender(system, queue, conn), rate)
            producer.start()
            time.sleep(sizes.warmup)
            t0, server0, own0 = time.time(), cpu(), cpu_seconds(worker.pid)
            time.sleep(sizes.window)
            t1, server1, own1 = time.time(), cpu(), cpu_seconds(worker.pid)
            producer.stop()
        systems.wait_drained(system, queue, worker)
        handled = worker.stop()
    finally:
        worker.close()
    systems.drop(system, queue)
    started = _checked(queue, producer.acked, handled)
    result.sent = len(producer.acked)
    result.window_s = t1 - t0
    result.window_jobs = sum(1 for t in started.values() if t0 <= t < t1)
    result.completed_per_s = result.window_jobs / result.window_s
    result.latencies_ms = [(started[i] - acked) * 1000 for i, acked in producer.acked.items()
                           if t0 <= acked < t1]
    result.server_cpu_s = server1 - server0
    result.consumer_cpu_s = own1 - own0
    return result


def _peak_run(systems: _Systems, system: str, slots: int | None, backlog: int,
              cpu: Callable[[], float]) -> RunResult:
    queue = systems.queue(system, slots)
    acked: dict[int, float] = {}
    with psycopg.connect(systems.dsn, autocommit=True) as conn:
        send = systems.sender(system, queue, conn)
        rng = random.Random(7)
        for first in range(0, backlog, MAX_BATCH):
            jobs = [(f"tenant-{rng.randrange(KEYS)}", f'{{"n": {first + i}}}')
                    for i in range(min(MAX_BATCH, backlog - first))]
            now = time.time()
            acked.update(dict.fromkeys(send(jobs), now))
    server0 = cpu()
    worker = systems.consumer(system, queue, slots)
    try:
        own0 = cpu_seconds(worker.pid)
        systems.wait_drained(system, queue, worker)
        server1, own1 = cpu(), cpu_seconds(worker.pid)
        handled = worker.stop()
    finally:
        worker.close()
    systems.drop(system, queue)
    started = _checked(queue, acked, handled)
    times = sorted(started.values())
    result = RunResult(system, slots, None, sent=len(acked))
    result.window_s = times[-1] - times[0]
    result.window_jobs = len(times)
    result.completed_per_s = len(times) / result.window_s
    result.server_cpu_s = server1 - server0
    result.consumer_cpu_s = own1 - own0
    return result


def _median_run(runs: list[RunResult]) -> RunResult:
    """The round whose server CPU per job is the median (its other figures with it)."""
    ordered = sorted(runs, key=lambda r: r.server_cpu_s / max(1, r.window_jobs))
    return ordered[len(ordered) // 2]


def _measurements(name: str, label: str, run: RunResult, rounds: list[RunResult],
                  baseline: RunResult | None = None) -> list[Measurement]:
    """The run's server CPU per job (against the reference's when there is one) and
    its pickup p50 and p99, each a measurement of its own chart panel."""
    figures = run.figures()
    ratio = (figures["server_us_per_job"] / baseline.figures()["server_us_per_job"]
             if baseline is not None else None)
    base_name = f"pgq.r{run.rate}" if baseline is not None else None
    made = [Measurement(name=name, label=label, events=run.sent, unit="µs server CPU a job",
                        values=[r.figures()["server_us_per_job"] for r in rounds],
                        median=figures["server_us_per_job"], baseline=base_name, ratio=ratio,
                        group="server CPU per job (µs)")]
    for q in ("p50", "p99"):
        made.append(Measurement(
            name=f"{name}.{q}", label=f"{label}: pickup {q}", events=run.sent, unit="ms",
            values=[r.figures()[f"{q}_ms"] for r in rounds], median=figures[f"{q}_ms"],
            group=f"pickup {q} (ms)",
            target=GOALS.get(f"{q}_ms_{run.rate}") if run.system == "pgque" else None))
    return made


def run(ctx: SuiteContext) -> SuiteResult:
    sizes = Sizes.for_run(ctx.quick)
    with _server(ctx) as (dsn, server_info, has_pgq), \
            pgque.connect(dsn, pool_size=0) as client, \
            psycopg.connect(dsn, autocommit=True) as sql:
        systems = _Systems(dsn, client, sql)
        cpu = server_cpu(sql)
        measurements: list[Measurement] = []
        table: list[dict[str, Any]] = []
        for rate in RATES:
            ours: list[RunResult] = []
            theirs: list[RunResult] = []
            for round_ in range(ctx.repeats):
                ours.append(_offered_run(systems, "pgque", MAIN_SLOTS, rate, sizes, cpu))
                _log(f"  pgque N={MAIN_SLOTS} {rate}/s round {round_ + 1}: "
                     f"{ours[-1].figures()}")
                if has_pgq:
                    theirs.append(_offered_run(systems, "pgq", None, rate, sizes, cpu))
                    _log(f"  pgq {rate}/s round {round_ + 1}: {theirs[-1].figures()}")
            mine = _median_run(ours)
            ref = _median_run(theirs) if theirs else None
            if ref is not None:
                measurements += _measurements(
                    f"pgq.r{rate}", f"PgQ, one consumer, {rate} jobs/s", ref, theirs)
            measurements += _measurements(
                f"pgque.n{MAIN_SLOTS}.r{rate}",
                f"pgque {MAIN_SLOTS} slots, {rate} jobs/s", mine, ours, baseline=ref)
            table += [r.figures() for r in ours + theirs]
        for slots in SWEEP_SLOTS:
            if slots == MAIN_SLOTS:
                continue
            for rate in RATES:
                one = _offered_run(systems, "pgque", slots, rate, sizes, cpu)
                _log(f"  pgque N={slots} {rate}/s: {one.figures()}")
                measurements += _measurements(
                    f"pgque.n{slots}.r{rate}", f"pgque {slots} slots, {rate} jobs/s",
                    one, [one])
                table.append(one.figures())
        peaks = [_peak_run(systems, "pgque", MAIN_SLOTS, sizes.peak_backlog, cpu)]
        if has_pgq:
            peaks.append(_peak_run(systems, "pgq", None, sizes.peak_backlog, cpu))
        for peak in peaks:
            _log(f"  peak {peak.system}: {peak.figures()}")
            measurements.append(Measurement(
                name=f"peak.{peak.system}", label=f"{peak.system}: drain of "
                f"{sizes.peak_backlog:,} jobs", events=peak.sent, unit="jobs/s",
                values=[round(peak.completed_per_s)], median=round(peak.completed_per_s),
                group="peak (jobs/s)"))
            table.append(peak.figures())
    return SuiteResult(
        parameters={
            "rates": list(RATES), "main_slots": MAIN_SLOTS, "sweep_slots": list(SWEEP_SLOTS),
            "key_concurrency": KEY_CONCURRENCY, "job_ms": JOB_MS, "keys": KEYS,
            "max_batch": MAX_BATCH, "interval_ms": [i * 1000 for i in INTERVAL_S],
            "warmup_s": sizes.warmup, "window_s": sizes.window,
            "peak_backlog": sizes.peak_backlog, "repeats": ctx.repeats, "pgq": has_pgq,
            "goals": GOALS, "runs": table,
        },
        measurements=measurements,
        server=server_info,
    )


@contextmanager
def _server(ctx: SuiteContext) -> Iterator[tuple[str, dict[str, Any] | None, bool]]:
    """The database and its server's description, on a cluster with PgQ when one
    is here (as bench.peers); whether PgQ is there."""
    if _has_pgq(ctx.dsn):
        with BenchServer(ctx.dsn) as given:
            yield ctx.dsn, given.describe(), True
        return
    bindir = _pgq_bindir()
    if bindir is None:
        yield ctx.dsn, None, False
        return
    with BenchServer(bindir=bindir) as server, server.database("pgque_bench_jobs") as dsn:
        yield dsn, server.describe(), _has_pgq(dsn)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


SUITE = register(Suite(
    name="jobs",
    description="the public job-queue benchmark's workloads: pickup latency, completion "
                "and the server's CPU per job, pgque's AsyncWorker next to PgQ",
    run=run,
))
