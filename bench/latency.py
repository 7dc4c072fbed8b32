"""Suite ``latency``: end-to-end latency of a Worker with default settings, and its idle CPU.

* Latency: one worker process (``bench.worker_process``, a ``pgque.Worker``
  with its defaults: its own Ticker, LISTEN for tick notifications, 100 events
  per piece, a thread per slot) consumes a group of N = 8 slots while this
  process sends, on one autocommit connection, at a steady 100 and 2,000
  events/s. Latency is from ``send`` returning (the commit acknowledged) to
  the handler starting, both read from ``time.time()`` on this machine. The
  same runs with N = 1 show the floor of the tick → notify → receive path.
* Idle CPU: a fresh worker process with nothing to do, and the PostgreSQL
  backends serving it (its control session, its lane, its ticker), read from
  ``/proc/<pid>/stat``; also the WAL, transaction ids and commits it costs.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pgque
from bench.measure import BenchError, Measurement
from bench.processes import WorkerProcess, cpu_seconds, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

CONSUMER = "bench"
EVENT_TYPE = "e"
KEYS = 10_000
RATES = (100, 2_000)  # events/s
SLOT_COUNTS = (8, 1)  # the group measured, then the diagnostic
TARGETS_MS = {"p50": 10.0, "p99": 50.0}  # at 100 events/s (the goal)
TARGET_RATE = 100
PERCENTILES = (("p50", "median"), ("p90", "p90"), ("p99", "p99"), ("max", "max"))
CATCH_UP_TIMEOUT = 600.0  # seconds a worker may need to work off a backlog
CATCH_UP_POLL = 0.2
SETTLE_S = 5.0  # an idle worker's ticker falls asleep after 2 s without ticks
QUIET_S = 3.0  # the silence before each send after quiet: the ticker asleep again
QUIET_SENDS = 5
MS = "ms"
CPU = "% of one core"


@dataclass(frozen=True)
class Sizes:
    seconds: float  # of sending, per timed round
    warmup: float  # of sending before the rounds, not measured
    idle: float  # of watching an idle worker, cut into ``repeats`` windows

    @classmethod
    def for_run(cls, quick: bool) -> Sizes:
        return cls(seconds=3.0, warmup=0.5, idle=10.0) if quick else \
            cls(seconds=10.0, warmup=1.0, idle=60.0)


@dataclass
class _Round:
    """One timed round: when each event's commit was acknowledged, and what followed."""

    acked: dict[int, float]
    sending_s: float  # from the first send to the last one's return
    ticks: int
    catch_up_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        cuts = statistics.quantiles(self.latencies_ms, n=100, method="inclusive")
        return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98],
                "max": max(self.latencies_ms), "min": min(self.latencies_ms)}


class _Producer:
    """Sends on one autocommit connection at a steady rate, noting each commit's time."""

    def __init__(self, client: pgque.Client) -> None:
        self.client = client
        self._sent = 0

    def send_paced(self, queue: str, rate: int, seconds: float) -> tuple[dict[int, float], float]:
        """Send ``rate * seconds`` events on a fixed schedule; returns each id's commit
        acknowledgement (time.time()) and how long the sending took (longer than
        ``seconds`` when a send takes more than 1/rate)."""
        count = round(rate * seconds)
        acked: dict[int, float] = {}
        start = time.monotonic()
        for i in range(count):
            # Due times from the start, not sleep(1/rate) after each send: the
            # send's own duration does not slow the rate, and a late send does
            # not push back every later one.
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            n = self._sent + i
            key = f"key-{n % KEYS}"
            event_id = self.client.send(queue, EVENT_TYPE, {"n": n, "key": key},
                                        partition_key=key)
            acked[event_id] = time.time()  # the commit is acknowledged once send returns
        self._sent += count
        return acked, time.monotonic() - start


def _last_tick(client: pgque.Client, queue: str) -> int:
    for info in client.queue_info(queue):
        return info.last_tick_id or 0
    raise BenchError(f"no queue {queue}")


def _wait_caught_up(client: pgque.Client, queue: str, worker: WorkerProcess) -> float:
    """Block until every slot has consumed every event sent (no pending events, no
    open batch, no tick left); returns how long that took."""
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


def _latency_runs(client: pgque.Client, dsn: str, slots: int, rate: int, sizes: Sizes,
                  repeats: int) -> list[_Round]:
    """A fresh queue and worker process; a warm-up, then ``repeats`` rounds of sending,
    each followed by waiting until the worker has caught up."""
    queue = f"lat_n{slots}_r{rate}"
    client.create_queue(queue)
    client.subscribe_slots(queue, CONSUMER, slots=slots)
    client.maintenance(queue)  # the slot index at once, not at the worker's first pass
    producer = _Producer(client)
    worker = WorkerProcess(dsn, queue, CONSUMER, "--slots", str(slots), "--handler", "record")
    rounds: list[_Round] = []
    try:
        wait_for_group(client, queue, CONSUMER, [worker])
        warm, _ = producer.send_paced(queue, rate, sizes.warmup)
        _wait_caught_up(client, queue, worker)
        for round_ in range(1, repeats + 1):
            first_tick = _last_tick(client, queue)
            acked, sending_s = producer.send_paced(queue, rate, sizes.seconds)
            # Tick ids come from one sequence for all queues; only this one is ticking.
            ticks = _last_tick(client, queue) - first_tick
            rounds.append(_Round(acked=acked, sending_s=sending_s, ticks=ticks,
                                 catch_up_s=_wait_caught_up(client, queue, worker)))
            _log(f"  N={slots} {rate:>5}/s run {round_}/{repeats}: sent at "
                 f"{len(acked) / sending_s:,.0f}/s, caught up {rounds[-1].catch_up_s:.1f} s "
                 "after the last send")
        result = worker.stop()
    finally:
        worker.close()
    client.drop_queue(queue, force=True)

    started = dict(zip(result.ids, result.started, strict=True))
    sent = set(warm).union(*(r.acked for r in rounds))
    if len(result.ids) != len(started) or set(started) != sent or result.failed:
        raise BenchError(f"{queue}: {len(sent)} events sent, {len(result.ids)} handled "
                         f"({len(started)} distinct, {len(set(started) - sent)} not sent, "
                         f"{result.failed} failed)")
    for r in rounds:
        r.latencies_ms = [(started[i] - t) * 1000 for i, t in r.acked.items()]
    return rounds


def _idle(client: pgque.Client, dsn: str, sizes: Sizes, repeats: int) -> dict[str, Any]:
    """CPU of a fresh idle worker process and of its backends, per window of
    ``sizes.idle / repeats`` seconds; and the WAL, xids and commits of the whole time."""
    queue = "idle"
    client.create_queue(queue)
    client.subscribe_slots(queue, CONSUMER, slots=SLOT_COUNTS[0])
    worker = WorkerProcess(dsn, queue, CONSUMER, "--slots", str(SLOT_COUNTS[0]),
                           "--handler", "record")
    try:
        wait_for_group(client, queue, CONSUMER, [worker])
        time.sleep(SETTLE_S)
        # The Worker names its sessions after itself (bench-worker-<pid>, see
        # bench.worker_process): its control session, -ticker, and -lane<k>
        # for each of its lanes (one, at the default concurrency, since 0.8;
        # one per slot before).
        backends = [row[0] for row in client.conn.execute(
            "select pid from pg_stat_activity where application_name like %s",
            (f"bench-worker-{worker.pid}%",)).fetchall()]
        if len(backends) != 3:
            raise BenchError(f"expected 3 backends of the idle worker, found {backends}")
        server_before = _server_counters(client)
        window = sizes.idle / repeats
        worker_pct: list[float] = []
        backend_pct: list[float] = []
        for _ in range(repeats):
            start = time.monotonic()
            own = cpu_seconds(worker.pid)
            served = sum(cpu_seconds(pid) for pid in backends)
            time.sleep(window)
            elapsed = time.monotonic() - start
            worker_pct.append((cpu_seconds(worker.pid) - own) / elapsed * 100)
            backend_pct.append((sum(cpu_seconds(pid) for pid in backends) - served)
                               / elapsed * 100)
        server_after = _server_counters(client)
        # Then the first event after a quiet spell, a few times: what the sleep
        # costs (before 0.9: a poll every 50 ms; since: a send's notification).
        acked: dict[int, float] = {}
        for n in range(QUIET_SENDS):
            time.sleep(QUIET_S)  # the silence being measured, not a synchronization
            event_id = client.send(queue, EVENT_TYPE, {"n": n, "key": "quiet"},
                                   partition_key="quiet")
            acked[event_id] = time.time()
        deadline = time.monotonic() + CATCH_UP_TIMEOUT
        while any(s.pending_events or s.open_batch_id is not None or s.ticks_behind
                  for s in client.partition_slot_status(queue)):
            if time.monotonic() > deadline:
                raise BenchError("the idle worker did not handle the sends after quiet")
            time.sleep(CATCH_UP_POLL)
        result = worker.stop()
    finally:
        worker.close()
    client.drop_queue(queue, force=True)
    started = dict(zip(result.ids, result.started, strict=True))
    if set(started) != set(acked):
        raise BenchError(f"after quiet: sent {sorted(acked)}, handled {sorted(started)}")
    per_second = {name: round((server_after[name] - server_before[name]) / sizes.idle, 1)
                  for name in server_after}
    return {"worker_pct": worker_pct, "backend_pct": backend_pct, "per_second": per_second,
            "backends": len(backends),
            "after_quiet_ms": [(started[i] - t) * 1000 for i, t in acked.items()]}


def _server_counters(client: pgque.Client) -> dict[str, float]:
    """WAL position, next transaction id and commits of this database, to take deltas."""
    row = client.conn.execute(
        "select pg_current_wal_insert_lsn() - '0/0'::pg_lsn,"
        # The next xid to be assigned, read without assigning one.
        "       pg_snapshot_xmax(pg_current_snapshot())::text::bigint,"
        "       (select xact_commit from pg_stat_database where datname = current_database())"
    ).fetchone()
    assert row is not None
    wal, xid, commits = row
    return {"wal_bytes": float(Decimal(wal)), "xids": float(xid), "commits": float(commits)}


def run(ctx: SuiteContext) -> SuiteResult:
    """Latency at each rate for N = 8 and N = 1, then the idle worker's CPU."""
    sizes = Sizes.for_run(ctx.quick)
    measurements: list[Measurement] = []
    details: dict[str, list[dict[str, Any]]] = {}
    with pgque.connect(ctx.dsn, pool_size=0) as client:
        for slots in SLOT_COUNTS:
            group = (f"N = {slots} slots, Worker defaults: send commit → handler start"
                     if slots > 1 else
                     "N = 1 slot (diagnostic), Worker defaults: send commit → handler start")
            for rate in RATES:
                rounds = _latency_runs(client, ctx.dsn, slots, rate, sizes, ctx.repeats)
                figures = [r.figures() for r in rounds]
                events = len(rounds[0].acked)
                sent_rate = statistics.median(len(r.acked) / r.sending_s for r in rounds)
                # Say so on the chart when one connection could not send at the rate asked.
                rate_label = (f"{rate:,} events/s" if sent_rate >= 0.95 * rate else
                              f"{rate:,}/s asked, {sent_rate:,.0f}/s sent")
                for key, name in PERCENTILES:
                    values = [f[key] for f in figures]
                    target = TARGETS_MS.get(key) if rate == TARGET_RATE else None
                    measurements.append(Measurement(
                        name=f"n{slots}.r{rate}.{key}", label=f"{rate_label}: {name}",
                        events=events, values=values, median=statistics.median(values),
                        unit=MS, group=group, target=target))
                details[f"n{slots}.r{rate}"] = [
                    {"events": len(r.acked), "achieved_rate": round(len(r.acked) / r.sending_s, 1),
                     "ticks_per_s": round(r.ticks / r.sending_s, 1),
                     "catch_up_s": round(r.catch_up_s, 2),
                     **{k: round(v, 2) for k, v in f.items()},
                     # How the latency moved during the round: a backlog makes it grow.
                     "p50_first_second": round(_median_of(r, first=True), 2),
                     "p50_last_second": round(_median_of(r, first=False), 2)}
                    for r, f in zip(rounds, figures, strict=True)]

        idle = _idle(client, ctx.dsn, sizes, ctx.repeats)
    idle_group = "idle worker process (nothing sent): CPU"
    measurements += [
        Measurement(name="idle.worker_cpu", label="worker process, all threads", events=0,
                    values=idle["worker_pct"], median=statistics.median(idle["worker_pct"]),
                    unit=CPU, group=idle_group),
        Measurement(name="idle.backend_cpu",
                    label=f"its {idle['backends']} PostgreSQL backends", events=0,
                    values=idle["backend_pct"], median=statistics.median(idle["backend_pct"]),
                    unit=CPU, group=idle_group),
        Measurement(name="idle.first_event_ms",
                    label=f"the first event after {QUIET_S:g} s of quiet (one per value)",
                    events=QUIET_SENDS, values=idle["after_quiet_ms"],
                    median=statistics.median(idle["after_quiet_ms"]), unit=MS,
                    group="idle worker: send commit → handler start of an event after quiet"),
    ]
    return SuiteResult(
        parameters={
            "rates": list(RATES),
            "slot_counts": list(SLOT_COUNTS),
            "seconds_per_round": sizes.seconds,
            "warmup_seconds": sizes.warmup,
            "partition_keys": KEYS,
            "targets_ms_at_100_per_s": TARGETS_MS,
            "producer": "one autocommit connection, pgque.Client.send, paced on a monotonic "
                        "schedule; time.time() after send returns",
            "worker": "bench.worker_process --handler record: pgque.Worker defaults (own "
                      "Ticker, listen=True, max_events=100, poll_interval=None (1 s while "
                      "listening), concurrency=None: one lane for all slots); the handler's "
                      "first action is time.time()",
            "rounds": details,
            "idle": {"seconds": sizes.idle, "settle_seconds": SETTLE_S,
                     "quiet_seconds_before_each_send": QUIET_S,
                     "after_quiet_ms": [round(v, 2) for v in idle["after_quiet_ms"]],
                     "windows": ctx.repeats, "server_per_second": idle["per_second"],
                     "worker_cpu_pct": [round(v, 2) for v in idle["worker_pct"]],
                     "backend_cpu_pct": [round(v, 2) for v in idle["backend_pct"]]},
            "repeats": ctx.repeats,
        },
        measurements=measurements,
    )


def _median_of(r: _Round, *, first: bool) -> float:
    """Median latency of the events acknowledged in the first (or last) second of a round."""
    acked = list(r.acked.values())  # in send order, as latencies_ms
    edge = acked[0] + 1.0 if first else acked[-1] - 1.0
    latencies = [lat for t, lat in zip(acked, r.latencies_ms, strict=True)
                 if (t <= edge if first else t >= edge)]
    return statistics.median(latencies)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress on stderr, as bench.measure does


SUITE = register(Suite(
    name="latency",
    description="send-to-handler latency of a default Worker at 100 and 2,000 events/s; idle CPU",
    run=run,
))
