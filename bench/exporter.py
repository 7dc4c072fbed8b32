"""Suite ``exporter``: what a scrape of pgque's metrics costs, at 100 queues of 16 slots
under load.

Issue 29 asks for a scrape under 100 ms at 100 queues × 16 slots under load.
Every queue has a consumer group of 16 slots (1,600 slots). While it is
measured:

* a producer process sends to every queue in turn, ``send_batch`` of 20
  events (1,000 keys), paced at 2,000 events/s in all;
* two worker processes (``bench.worker_process``, a no-op handler, each with
  its Ticker, one of which ticks) consume the groups of the first two queues;
  the other 98 groups are read by nobody, so their slots fall further behind
  with every tick;
* before the load, the queues nobody reads get 1,000 ticks each (a tenth with
  ``--quick``), as from a ticker that ticked them once a second for as long
  (98,000 ticks in all, not vacuumed yet: reading one costs a heap fetch);
* ``pgque exporter`` runs as a process of its own (``python -m pgque.cli
  exporter --port 0``).

After a warm-up that lets the backlog and the ticks pile up (30 s; 5 s with
``--quick``), the suite alternates, a quarter of a second apart, an SQL scrape
(``select metric, labels, value from pgque.metrics()`` and the fetch of every
row, on a connection of this process, as the exporter's) and an HTTP scrape
of the exporter (``GET /metrics`` with ``Accept-Encoding: gzip``, as
Prometheus asks, to the last byte). Wall time on the client, in ms: the
median and the 95th percentile of each, with the 100 ms goal drawn across.
"""

from __future__ import annotations

import gzip
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing.synchronize import Event as EventType
from typing import Any

import psycopg
from psycopg import sql

import pgque
from bench.measure import BenchError, Measurement
from bench.processes import WorkerProcess, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

QUEUES = 100
SLOTS = 16
CONSUMED = 2  # queues whose groups have workers
RATE = 2_000  # events/s sent, over every queue
BATCH = 20  # events per send_batch
KEYS = 1_000
WARMUP_S = 30.0
SCRAPES = 60  # of each kind (a fifth with --quick)
PAUSE_S = 0.25  # between two scrapes
PRE_TICKS = 1_000  # ticks of each queue nobody reads, before the load (a tenth with --quick)
GOAL_MS = 100.0
MS = "ms"


def _produce(dsn: str, queues: list[str], stop: EventType, sent: Any) -> None:
    """The producer process: a send_batch to each queue in turn, paced at RATE."""
    with pgque.connect(dsn, pool_size=0) as client:
        started = time.monotonic()
        count = 0
        while not stop.is_set():
            for queue in queues:
                client.send_batch(queue, [("e", {"n": count + i}, f"k{(count + i) % KEYS}")
                                          for i in range(BATCH)])
                count += BATCH
                ahead = count / RATE - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
                if stop.is_set():
                    break
            sent.value = count


class _ExporterProcess:
    """``pgque exporter --port 0`` as a child process, and its URL."""

    def __init__(self, dsn: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgque.cli", "exporter", "--dsn", dsn, "--port", "0",
             "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        assert self.proc.stderr is not None
        self.stderr: list[str] = []
        deadline = time.monotonic() + 60
        self.url = ""
        while not self.url:
            line = self.proc.stderr.readline()
            if not line or time.monotonic() > deadline:
                self.proc.kill()
                raise BenchError(f"pgque exporter did not start: {''.join(self.stderr)}"
                                 f"{line}{self.proc.stderr.read()}")
            if "serving http" in line:
                self.url = line.split("serving ", 1)[1].strip()
            else:
                self.stderr.append(line)
        # Drained from now on, so that its warnings never fill the pipe.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _setup(dsn: str, queues: list[str], ticks: int) -> None:
    """The queues and groups; then ticks of the queues nobody reads, a
    transaction per round of them, as a ticker that had ticked them once a
    second for that many seconds."""
    with pgque.connect(dsn, pool_size=0) as client:
        for queue in queues:
            client.create_queue(queue)
            client.subscribe_slots(queue, "g", slots=SLOTS)
        client.maintenance()  # the slot indexes and batch readers of N = 16
        client.conn.execute(sql.SQL(
            "do $$ begin"
            " for i in 1 .. {ticks} loop"
            "   perform pgque.tick(q) from unnest({queues}::text[]) q;"
            "   commit;"
            " end loop; end $$").format(ticks=sql.Literal(ticks),
                                        queues=sql.Literal(queues[CONSUMED:])))


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _scrape_sql(conn: psycopg.Connection[Any]) -> tuple[float, int]:
    started = time.perf_counter()
    rows = conn.execute("select metric, labels, value from pgque.metrics()",
                        binary=True).fetchall()
    return (time.perf_counter() - started) * 1e3, len(rows)


def _scrape_http(url: str) -> tuple[float, bytes]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        body: bytes = response.read()
    return (time.perf_counter() - started) * 1e3, body


def run(ctx: SuiteContext) -> SuiteResult:
    warmup = WARMUP_S / 6 if ctx.quick else WARMUP_S
    scrapes = SCRAPES // 5 if ctx.quick else SCRAPES
    queues = [f"q{i:03d}" for i in range(QUEUES)]
    ticks = PRE_TICKS // 10 if ctx.quick else PRE_TICKS
    _setup(ctx.dsn, queues, ticks)
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    sent = spawn.Value("q", 0)
    producer = spawn.Process(target=_produce, args=(ctx.dsn, queues, stop, sent),
                             name="bench-exporter-producer")
    workers = [WorkerProcess(ctx.dsn, queue, "g", "--slots", str(SLOTS))
               for queue in queues[:CONSUMED]]
    exporter: _ExporterProcess | None = None
    try:
        with pgque.connect(ctx.dsn, pool_size=0) as client:
            for queue, worker in zip(queues, workers, strict=False):
                wait_for_group(client, queue, "g", [worker])
        exporter = _ExporterProcess(ctx.dsn)
        producer.start()
        time.sleep(warmup)
        with psycopg.connect(ctx.dsn, autocommit=True) as conn:
            ticks_before = conn.execute("select last_value from pgque.tick_id_seq").fetchone()
            sent_before, started = sent.value, time.monotonic()
            sql_ms: list[float] = []
            http_ms: list[float] = []
            rows = 0
            body = b""
            for _ in range(scrapes):
                for worker in workers:
                    worker.check_alive()
                if not producer.is_alive():
                    raise BenchError("the producer process died")
                elapsed, rows = _scrape_sql(conn)
                sql_ms.append(elapsed)
                time.sleep(PAUSE_S / 2)
                elapsed, body = _scrape_http(exporter.url)
                http_ms.append(elapsed)
                time.sleep(PAUSE_S / 2)
            seconds = time.monotonic() - started
            rate = (sent.value - sent_before) / seconds
            ticks_after = conn.execute("select last_value from pgque.tick_id_seq").fetchone()
            assert ticks_before is not None and ticks_after is not None
            tick_rate = (ticks_after[0] - ticks_before[0]) / seconds
            behind = conn.execute(
                "select max(value) from pgque.metrics()"
                " where metric = 'pgque_slot_ticks_behind'").fetchone()
    finally:
        stop.set()
        producer.join(60)
        if producer.is_alive():
            producer.kill()
        for worker in workers:
            worker.stop()
        if exporter is not None:
            exporter.stop()
    text = gzip.decompress(body).decode()
    if "pgque_up 1.0" not in text:
        raise BenchError(f"the exporter's last scrape failed: {''.join(exporter.stderr)}")
    samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    measurements = []
    for kind, label, values in (
            ("sql", "pgque.metrics(), one round trip and every row", sql_ms),
            ("http", "pgque exporter, GET /metrics (gzip)", http_ms)):
        median = round(statistics.median(values), 1)
        p95 = round(_percentile(values, 0.95), 1)
        measurements += [
            Measurement(name=f"{kind}.median", label=f"{label}: median", events=0,
                        values=[round(v, 1) for v in values], median=median, unit=MS,
                        group="scrape time, 100 queues x 16 slots under load", target=GOAL_MS),
            Measurement(name=f"{kind}.p95", label=f"{label}: 95th percentile", events=0,
                        values=[p95], median=p95, unit=MS,
                        group="scrape time, 100 queues x 16 slots under load", target=GOAL_MS)]
    parameters = {
        "queues": QUEUES, "slots_per_group": SLOTS, "consumed_queues": CONSUMED,
        "target_rate": RATE, "batch": BATCH, "keys": KEYS, "ticks_before_load": ticks,
        "warmup_s": warmup,
        "scrapes": scrapes, "pause_s": PAUSE_S, "goal_ms": GOAL_MS,
        "measured": {"events_per_s": round(rate), "ticks_per_s": round(tick_rate),
                     "rows_per_scrape": rows, "samples_per_scrape": samples,
                     "http_bytes_gzip": len(body), "http_bytes": len(text.encode()),
                     "max_ticks_behind": behind[0] if behind else None},
    }
    return SuiteResult(parameters=parameters, measurements=measurements)


SUITE = register(Suite(
    name="exporter",
    description="a scrape of pgque.metrics() and of pgque exporter at 100 queues x 16 slots, "
                "under load",
    run=run,
))
