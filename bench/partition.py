"""Suite ``partition``: a consumer group of N = 8 slots drained by 1, 2, 4 and 8 worker
processes, and what the slot queries read per event.

* Scaling: M real worker processes (``bench.worker_process``, each a
  ``pgque.Worker`` with ``ticker=False``) share a group of 8 slots; the suite
  produces the events (10,000 partition keys, ``send_batch`` of 1,000, a tick
  after each) and times, on the database clock, from the first tick until
  every slot has acked the last one. Handlers: a no-op, and a 1 ms sleep with
  the Worker's default concurrency (one thread per owned slot) and with
  ``concurrency=1`` (one event at a time per process). Every event must be
  handled exactly once.
* Read amplification: one session drains every slot of a group of N = 1, 4, 16
  (and 8 in pieces of 100, the Worker's default) over a pre-filled queue; the
  rows the slot queries scan come from the event tables' statistics.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pgque
from bench.baseline import BASELINE_COMMIT, BaselineWorker
from bench.measure import BenchError, Measurement
from bench.processes import WorkerProcess, WorkerResult, machine_cpu, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

CONSUMER = "bench"
EVENT_TYPE = "e"
SLOTS = 8  # N of the scaling runs
KEYS = 10_000  # distinct partition keys
BATCH = 1_000  # events per send_batch, and per tick
WORKER_COUNTS = (1, 2, 4, 8)
SLEEP_MS = 1.0
READ_AMP_SLOTS = (1, 4, 16)
PIECE = 100  # pgque.Worker's default max_events
POLL_INTERVAL = 0.05  # seconds between looks at the slots' cursors
DRAIN_TIMEOUT = 300.0  # seconds a drain may take before the run counts as stuck
# The no-op drain at M = 1 is as fast as the producer beside it, and its rounds
# vary by a quarter on this 2-core machine: three rounds put today's Worker at
# 2.33x and at 1.49x the 0.1 Worker in two runs of the same Worker on one day. The
# pair (and the other M of its handler) takes this many turns instead.
BASELINE_ROUNDS = 7

Row = tuple[str, dict[str, Any], str]


@dataclass(frozen=True)
class Handler:
    """A handler the worker processes run, with the events each run produces."""

    name: str
    label: str
    worker_args: tuple[str, ...]
    events: int

    def count(self, quick: bool) -> int:
        return self.events // 10 if quick else self.events


HANDLERS = (
    Handler("noop", "no-op handler", ("--handler", "noop"), 40_000),
    Handler("sleep_1ms", "1 ms handler (Worker default: a thread per owned slot)",
            ("--handler", "sleep", "--sleep-ms", str(SLEEP_MS)), 8_000),
    # What the "nearly linear up to N" assumes: one event at a time per
    # process, as a Kafka consumer handling its partitions in one poll loop.
    Handler("sleep_1ms.concurrency_1", "1 ms handler, concurrency=1 (one event at a time)",
            ("--handler", "sleep", "--sleep-ms", str(SLEEP_MS), "--concurrency", "1"), 8_000),
    # Keys in parallel inside each slot: up to 8 events of different keys at once.
    Handler("sleep_1ms.key_concurrency_8", "1 ms handler, key_concurrency=8",
            ("--handler", "sleep", "--sleep-ms", str(SLEEP_MS), "--key-concurrency", "8"),
            40_000),
    # The same with an AsyncWorker: tasks instead of 64 handler threads.
    Handler("sleep_1ms.key_concurrency_8.async",
            "1 ms async handler (asyncio.sleep), AsyncWorker, key_concurrency=8",
            ("--handler", "sleep", "--sleep-ms", str(SLEEP_MS), "--key-concurrency", "8",
             "--async"), 40_000),
)


def _rows(count: int) -> list[Row]:
    """``count`` events cycling through KEYS partition keys, in send order."""
    return [(EVENT_TYPE, {"n": i, "key": f"key-{i % KEYS}"}, f"key-{i % KEYS}")
            for i in range(count)]


def _chunks(rows: list[Row]) -> Iterator[list[Row]]:
    for offset in range(0, len(rows), BATCH):
        yield rows[offset:offset + BATCH]


class _Queues:
    """Fresh, uniquely named queues: every run starts from empty event tables."""

    def __init__(self, client: pgque.Client) -> None:
        self.client = client
        self._made = 0

    def create(self, prefix: str, slots: int) -> tuple[str, int]:
        self._made += 1
        name = f"{prefix}_{self._made}"
        queue_id = self.client.create_queue(name, ticker_max_count=BATCH)
        self.client.subscribe_slots(name, CONSUMER, slots=slots)  # before any event
        # Maintenance makes the group's slot index (a Ticker's pass would within
        # a second; these runs tick by hand).
        self.client.maintenance(name)
        return name, queue_id

    def produce(self, queue: str, rows: list[Row]) -> tuple[list[int], datetime, int]:
        """send_batch + tick per BATCH events; returns the ids, the first tick's time
        (database clock) and the last tick's id."""
        ids: list[int] = []
        first_tick_time: datetime | None = None
        last_tick = 0
        for chunk in _chunks(rows):
            ids += self.client.send_batch(queue, chunk)
            last_tick = self.client.tick(queue)
            if first_tick_time is None:
                first_tick_time = self._tick_time(queue, last_tick)
        assert first_tick_time is not None, "at least one batch"
        return ids, first_tick_time, last_tick

    def _tick_time(self, queue: str, tick_id: int) -> datetime:
        for info in self.client.queue_info(queue):
            if info.last_tick_id == tick_id and info.last_tick_time is not None:
                return info.last_tick_time
        raise BenchError(f"tick {tick_id} of {queue} is not the queue's newest")


class _WorkerDrain:
    """One scaling run: M fresh worker processes drain a fresh queue of ``count`` events."""

    def __init__(self, dsn: str, queues: _Queues, handler: Handler, workers: int) -> None:
        self.dsn = dsn
        self.queues = queues
        self.handler = handler
        self.workers = workers
        self.details: list[dict[str, Any]] = []  # one per timed run (warm-up excluded)

    def run(self, count: int, timed: bool) -> float:
        client = self.queues.client
        queue, _ = self.queues.create("scale", SLOTS)
        rows = _rows(count)
        procs = [WorkerProcess(self.dsn, queue, CONSUMER, "--slots", str(SLOTS), "--no-ticker",
                               *self.handler.worker_args) for _ in range(self.workers)]
        try:
            # Start-up (interpreters, connections, claiming) is not part of the figure.
            wait_for_group(client, queue, CONSUMER, procs)
            busy_before, total_before = machine_cpu()
            started = time.perf_counter()
            sent, first_tick_time, last_tick = self.queues.produce(queue, rows)
            produced = time.perf_counter() - started
            drained_at = self._wait_drained(queue, last_tick, procs)
            busy_after, total_after = machine_cpu()
            for proc in procs:
                proc.request_stop()
            results = [proc.stop() for proc in procs]
        finally:
            for proc in procs:
                proc.close()
        _check_handled(results, sent)
        client.drop_queue(queue, force=True)
        seconds = (drained_at - first_tick_time).total_seconds()
        if timed:
            self.details.append({
                "drain_s": round(seconds, 3), "produce_s": round(produced, 3),
                "handled_per_worker": sorted((r.handled for r in results), reverse=True),
                # Both cores, this process's producing and polling included.
                "machine_cpu_busy_pct": round(
                    100 * (busy_after - busy_before) / (total_after - total_before), 1)})
        return count / seconds

    def _wait_drained(self, queue: str, last_tick: int, procs: list[WorkerProcess]) -> datetime:
        """Poll until every slot has acked the last tick; returns the time (database
        clock) of the last ack, so the poll's own period does not enter the figure."""
        client = self.queues.client
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while True:
            slots = [r for r in client.consumer_info(queue)
                     if r.consumer_name.startswith(f"{CONSUMER}#")]
            if len(slots) == SLOTS and all(r.last_tick_id == last_tick
                                           and r.open_batch_id is None for r in slots):
                return max(r.last_active for r in slots if r.last_active is not None)
            if time.monotonic() > deadline:
                raise BenchError(f"{queue}: not drained within {DRAIN_TIMEOUT:.0f} s: {slots}")
            for proc in procs:
                proc.check_alive()
            time.sleep(POLL_INTERVAL)


def _check_handled(results: list[WorkerResult], sent: list[int]) -> None:
    """Every event sent handled exactly once, none failed; BenchError otherwise."""
    handled = [i for r in results for i in r.ids]
    distinct = set(handled)
    expected = set(sent)
    problems = []
    if len(handled) != len(distinct):
        problems.append(f"{len(handled) - len(distinct)} duplicate deliveries")
    if distinct != expected:
        problems.append(f"{len(expected - distinct)} events never handled, "
                        f"{len(distinct - expected)} handled that were not sent")
    failed = sum(r.failed for r in results)
    if failed:
        problems.append(f"{failed} handler failures")
    if sum(r.handled for r in results) != len(handled):
        problems.append("the Workers' counters disagree with the ids recorded")
    if problems:
        raise BenchError(f"{len(sent)} events sent: " + "; ".join(problems))


class _SessionDrain:
    """Read amplification: one session drains all N slots of a pre-filled queue."""

    def __init__(self, queues: _Queues, drainer: pgque.Client, slots: int,
                 max_events: int | None, together: bool = False) -> None:
        self.queues = queues
        self.drainer = drainer
        self.slots = slots
        self.max_events = max_events
        self.together = together  # every slot in one receive_slots + ack_slots call
        self.rows_per_event: list[float] = []  # one per timed run
        self.details: list[dict[str, int]] = []

    def label(self) -> str:
        return (f"N = {self.slots}"
                + (f", max_events={self.max_events}" if self.max_events else "")
                + (", all slots in one call" if self.together else ""))

    def run(self, count: int, timed: bool) -> float:
        queue, queue_id = self.queues.create(f"read_n{self.slots}", self.slots)
        self.queues.produce(queue, _rows(count))
        for slot in range(self.slots):
            if not self.drainer.claim_slot(queue, CONSUMER, slot):
                raise BenchError(f"{queue}: could not claim slot {slot}")
        before = _scan_counters(self.drainer, queue_id)
        started = time.perf_counter()
        received = 0
        if self.together:
            while batches := self.drainer.receive_slots(
                    queue, CONSUMER, slots=self.slots, owned=range(self.slots),
                    max_events=self.max_events):
                received += sum(len(batch) for batch in batches)
                self.drainer.ack_slots(batches)
        for slot in range(self.slots):
            while (batch := self.drainer.receive_partitioned(
                    queue, CONSUMER, slot=slot, slots=self.slots,
                    max_events=self.max_events)) is not None:
                received += len(batch)
                self.drainer.ack(batch)
        elapsed = time.perf_counter() - started
        after = _scan_counters(self.drainer, queue_id)
        for slot in range(self.slots):
            self.drainer.release_slot(queue, CONSUMER, slot)
        self.queues.client.drop_queue(queue, force=True)
        if received != count:
            raise BenchError(f"{queue}: drained {received} events of {count}")
        delta = {name: after[name] - before[name] for name in after}
        if timed:
            self.rows_per_event.append((delta["seq_tup_read"] + delta["idx_tup_fetch"]) / count)
            self.details.append(delta)
        return count / elapsed


def _scan_counters(client: pgque.Client, queue_id: int) -> dict[str, int]:
    """Scan counters summed over the queue's event tables (children of pgque.event_<id>).

    A backend sends its statistics to the shared counters only now and then;
    pg_stat_force_next_flush() makes it do so when this statement's transaction
    ends, so the next statement (a new transaction, hence a fresh statistics
    snapshot) sees every scan this session made.
    """
    client.conn.execute("select pg_stat_force_next_flush()")
    row = client.conn.execute(
        "select coalesce(sum(seq_scan), 0), coalesce(sum(seq_tup_read), 0),"
        "       coalesce(sum(idx_scan), 0), coalesce(sum(idx_tup_fetch), 0)"
        "  from pg_stat_user_tables where schemaname = 'pgque' and relname ~ %s",
        (f"^event_{queue_id}_[0-9]+$",)).fetchone()
    assert row is not None
    return dict(zip(("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch"),
                    map(int, row), strict=True))


Run = Callable[[int, bool], float]


def _interleaved(cases: list[tuple[str, Run, int]], warmup: dict[str, int],
                 repeats: int) -> dict[str, list[float]]:
    """Like bench.measure.measure, for runs that time themselves: an untimed warm-up
    of the cases named in ``warmup`` (with that many events), then ``repeats``
    rounds in which every case runs once, in turn."""
    for name, run, _count in cases:
        if name in warmup:
            run(warmup[name], False)
    values: dict[str, list[float]] = {name: [] for name, _run, _count in cases}
    for round_ in range(1, repeats + 1):
        for name, run, count in cases:
            rate = run(count, True)
            values[name].append(rate)
            _log(f"  {name:<36} run {round_}/{repeats}: {rate:>10,.0f} events/s")
    return values


def _with_baseline(baseline: BaselineWorker, cases: list[tuple[str, Run, int]],
                   warmup: dict[str, int], count: int, repeats: int) -> dict[str, list[float]]:
    """_interleaved over cases and, when it can be run, the 0.1 Worker's drain
    (as ``noop.m1.worker_0_1``, warmed up like the others), in BASELINE_ROUNDS
    rounds at least, each right after today's M = 1 run it is compared with."""
    with baseline:
        rounds = max(repeats, BASELINE_ROUNDS)  # with or without the old Worker
        if not baseline.available:
            _log(f"  baseline skipped: {baseline.why}")
            return _interleaved(cases, warmup, rounds)
        paired = [cases[0], ("noop.m1.worker_0_1", baseline.run, count), *cases[1:]]
        return _interleaved(paired, {**warmup, "noop.m1.worker_0_1": max(warmup.values())},
                            rounds)


def _sleep_overshoot() -> float:
    """What time.sleep(SLEEP_MS) really takes here, in ms (the 1 ms handler's floor)."""
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        time.sleep(SLEEP_MS / 1000)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def run(ctx: SuiteContext) -> SuiteResult:
    """Scaling with M worker processes per handler, then read amplification per N."""
    with pgque.connect(ctx.dsn, pool_size=0) as client, \
            pgque.connect(ctx.dsn, pool_size=0) as drainer:
        queues = _Queues(client)
        measurements: list[Measurement] = []
        parameters: dict[str, Any] = {}

        drains: dict[str, _WorkerDrain] = {}
        baseline = BaselineWorker(ctx.dsn)
        for handler in HANDLERS:
            cases: list[tuple[str, Run, int]] = []
            for workers in WORKER_COUNTS:
                drain = _WorkerDrain(ctx.dsn, queues, handler, workers)
                name = f"{handler.name}.m{workers}"
                drains[name] = drain
                cases.append((name, drain.run, handler.count(ctx.quick)))
            # One warm-up per handler, with the most workers (the shortest run).
            warm = {cases[-1][0]: max(BATCH, handler.count(ctx.quick) // 20)}
            if handler.name == "noop":
                # The 0.1 Worker in the same turns (see bench.baseline).
                values = _with_baseline(baseline, cases, warm, handler.count(ctx.quick),
                                        ctx.repeats)
                if baseline.available:
                    measurements.append(_measurement(
                        "noop.m1.worker_0_1",
                        f"M = 1, the Worker of 0.1 (commit {BASELINE_COMMIT})",
                        handler.count(ctx.quick), values.pop("noop.m1.worker_0_1"), "noop.m1",
                        statistics.median(values["noop.m1"]),
                        group=f"{handler.label}: events/s, N = {SLOTS} slots"))
                else:
                    parameters["baseline_unavailable"] = baseline.why
            else:
                values = _interleaved(cases, warm, ctx.repeats)
            base = f"{handler.name}.m1"
            for workers in WORKER_COUNTS:
                name = f"{handler.name}.m{workers}"
                measurements.append(_measurement(
                    name, f"M = {workers} worker process{'es' if workers > 1 else ''}",
                    handler.count(ctx.quick), values[name], base if workers > 1 else None,
                    statistics.median(values[base]),
                    group=f"{handler.label}: events/s, N = {SLOTS} slots"))

        read_count = 2_000 if ctx.quick else 20_000
        sessions = {f"read.n{n}": _SessionDrain(queues, drainer, n, None)
                    for n in READ_AMP_SLOTS}
        sessions[f"read.n{SLOTS}.piece{PIECE}"] = _SessionDrain(queues, drainer, SLOTS, PIECE)
        # The same drain with every slot in one call each way (receive_slots, ack_slots).
        for n in READ_AMP_SLOTS[1:]:
            sessions[f"read.n{n}.together"] = _SessionDrain(queues, drainer, n, None,
                                                            together=True)
        cases = [(name, s.run, read_count) for name, s in sessions.items()]
        values = _interleaved(cases, {name: BATCH for name in sessions}, ctx.repeats)
        amp_group = "read amplification: rows the slot queries scan per event returned"
        rate_group = ("one session drains every slot (receive_partitioned + ack, or"
                      " receive_slots + ack_slots: all slots in one call): events/s")
        for name, session in sessions.items():
            measurements.append(_measurement(
                f"{name}.rows_per_event", session.label(), read_count, session.rows_per_event,
                None, None, group=amp_group, unit="rows/event"))
        base = f"read.n{READ_AMP_SLOTS[0]}"
        for name, session in sessions.items():
            measurements.append(_measurement(
                name, session.label(), read_count, values[name], None if name == base else base,
                statistics.median(values[base]), group=rate_group))

        parameters.update({
            "slots": SLOTS,
            "partition_keys": KEYS,
            "batch_size": BATCH,
            "tick_every": BATCH,
            "worker_counts": list(WORKER_COUNTS),
            "events_per_run": {h.name: h.count(ctx.quick) for h in HANDLERS},
            "handlers": {h.name: h.label for h in HANDLERS},
            "worker_settings": {"ticker": False, "max_events": PIECE, "listen": True,
                                "concurrency": "slots owned (default), or 1 where named",
                                "poll_interval": 0.2, "rebalance_interval": 1.0},
            "sleep_1ms_measured_ms": round(_sleep_overshoot(), 3),
            "timing": "database clock: first tick's tick_time to the newest last_active "
                      "(ack) of the 8 slots; worker start-up and slot claiming excluded",
            "scaling_runs": {name: d.details for name, d in drains.items()},
            "baseline_runs": baseline.details,
            "read_amplification": {
                "events_per_run": read_count,
                "counted": "seq_tup_read + idx_tup_fetch of the queue's event tables",
                "scan_counters": {name: s.details for name, s in sessions.items()},
            },
            "repeats": ctx.repeats,
            "noop_rounds": max(ctx.repeats, BASELINE_ROUNDS),
        })
    return SuiteResult(parameters=parameters, measurements=measurements)


def _measurement(name: str, label: str, events: int, values: list[float], baseline: str | None,
                 baseline_median: float | None, *, group: str,
                 unit: str = "events/s") -> Measurement:
    median = statistics.median(values)
    ratio = None if baseline is None or not baseline_median else median / baseline_median
    return Measurement(name=name, label=label, events=events, values=values, median=median,
                       baseline=baseline, ratio=ratio, unit=unit, group=group)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress on stderr, as bench.measure does


SUITE = register(Suite(
    name="partition",
    description="events/s of a slot group drained by 1-8 worker processes; read amplification",
    run=run,
))
