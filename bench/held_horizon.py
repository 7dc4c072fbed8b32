"""Suite ``held_horizon`` (a long variant, ``make bench-held-horizon``): an hour of
800 events/s through a group of 16 slots while another session holds a snapshot
open, so that vacuum can remove nothing that dies meanwhile.

That is what a long report, a session left idle in transaction or a lagging
replication slot does in production. A design that deletes or updates rows on
its hot path piles them up for the whole hour, and its lookups walk them. Here:

* the load of suite ``bloat`` (one worker process with the Worker's defaults,
  its Ticker running maintenance every second; this process sending on a
  schedule over 10,000 keys), at 800 events/s;
* a session that opens a REPEATABLE READ transaction, takes its snapshot and
  stays idle in it until the end (it holds no transaction id, so the event
  tables still rotate: see docs/operations.md, rotation pinning);
* every 30 s: the size of pgque's tables other than the event tables, the
  dead tuples of all of them, and what one receive and one ack cost, measured
  on a probe consumer of the same queue (a plain subscription that this
  process drains to the end at every sample, in pieces of 100, so that it
  keeps up): the median time of its receive + ack cycles, and the shared
  buffers one receive touches (EXPLAIN ANALYZE BUFFERS, as tests/test_bloat.py
  counts them);
* once the hour is over, the snapshot is released, every pgque table
  vacuumed, and the dead tuples left to vacuum counted before and after.

Goals, printed, not asserted: the non-event tables stay under a few MB; the
receive and ack costs of the last five minutes within 1.2x of the first five.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg

import pgque
from bench.bloat import _EVENT_TABLE, KEYS, SLOTS, _send_paced, _vacuum, _wait_caught_up
from bench.measure import BenchError, Measurement
from bench.processes import WorkerProcess, wait_for_group
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

CONSUMER = "bench"
PROBE = "probe"  # the plain consumer whose receive and ack are timed
RATE = 800
SECONDS = 3600.0
QUICK_SECONDS = 60.0
SAMPLE_INTERVAL = 30.0
PROBE_PIECE = 100  # events per probe receive (the Worker's default piece)
EDGE_SECONDS = 300.0  # the first and the last five minutes are compared
GOAL_RATIO = 1.2
BYTES = "bytes"
MS = "ms"

_SIZES = """
select coalesce(sum(n_dead_tup), 0)::bigint,
       coalesce(sum(pg_total_relation_size(relid)) filter (where relname !~ %(event)s), 0)::bigint,
       coalesce(sum(n_dead_tup) filter (where relname !~ %(event)s), 0)::bigint
  from pg_stat_user_tables
 where schemaname = 'pgque'
"""


@dataclass
class _Sample:
    at: float
    non_event_bytes: int
    dead_all: int
    dead_non_event: int
    receive_ack_ms: float  # one receive + ack of a full piece of the probe consumer: median
    cycles: int  # full pieces received and acked
    receive_buffers: int  # shared buffers one receive of the probe touches


class _Prober(threading.Thread):
    """Every SAMPLE_INTERVAL: the tables' sizes and dead tuples, and the probe
    consumer's receive and ack costs, on connections of its own."""

    def __init__(self, dsn: str, queue: str) -> None:
        super().__init__(name="held-horizon-prober", daemon=True)
        self._stats = psycopg.connect(dsn, autocommit=True)
        self._probe = pgque.connect(dsn, pool_size=0)
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
            due = self._start + SAMPLE_INTERVAL
            while not self._done.wait(max(0.0, due - time.monotonic())):
                self.samples.append(self._sample())
                _log(f"  {self.samples[-1].at:7.0f} s: {self.samples[-1]}")
                due += SAMPLE_INTERVAL
        except BaseException as exc:  # raised again by finish()
            self.error = exc

    def finish(self) -> list[_Sample]:
        self._done.set()
        self.join()
        if self.error is not None:
            raise BenchError(f"probing failed: {self.error!r}") from self.error
        return self.samples

    def close(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join()
        self._stats.close()
        self._probe.close()

    def _sample(self) -> _Sample:
        at = time.monotonic() - self._start
        buffers = self._receive_buffers()
        times = []
        while True:
            start = time.perf_counter()
            batch = self._probe.receive(self._queue, PROBE, max_events=PROBE_PIECE)
            if batch is None:
                break
            self._probe.ack(batch)
            if len(batch) == PROBE_PIECE:
                times.append((time.perf_counter() - start) * 1000)
        dead_all, non_event_bytes, dead_non_event = self._stats.execute(
            _SIZES, {"event": _EVENT_TABLE}).fetchone() or (0, 0, 0)
        return _Sample(at=at, non_event_bytes=int(non_event_bytes), dead_all=int(dead_all),
                       dead_non_event=int(dead_non_event),
                       receive_ack_ms=statistics.median(times) if times else float("nan"),
                       cycles=len(times), receive_buffers=buffers)

    def _receive_buffers(self) -> int:
        """One receive of the probe consumer through EXPLAIN ANALYZE BUFFERS, acked."""
        conn = self._probe.conn
        row = conn.execute("explain (analyze, buffers, format json) select * from"
                           " pgque.receive(%s, %s, %s)",
                           (self._queue, PROBE, PROBE_PIECE)).fetchone()
        assert row is not None
        plan = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
        batch_id = conn.execute("select open_batch_id from pgque.consumer_info"
                                " where queue_name = %s and consumer_name = %s",
                                (self._queue, PROBE)).fetchone()
        if batch_id is not None and batch_id[0] is not None:
            self._probe.ack(pgque.Batch(self._queue, PROBE, batch_id[0]))
        return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def _edge(samples: list[_Sample], value: str, last: bool, seconds: float) -> float:
    """The median of ``value`` over the first (or the last) ``seconds`` of samples."""
    end = samples[-1].at
    chosen = [s for s in samples if s.cycles > 0
              and (s.at >= end - seconds if last else s.at <= seconds + SAMPLE_INTERVAL)]
    return float(statistics.median(getattr(s, value) for s in chosen))


def run(ctx: SuiteContext) -> SuiteResult:
    seconds = QUICK_SECONDS if ctx.quick else SECONDS
    edge = min(EDGE_SECONDS, seconds / 4)
    queue = "held_horizon"
    with pgque.connect(ctx.dsn, pool_size=0) as client, \
            psycopg.connect(ctx.dsn, autocommit=True) as plain, \
            psycopg.connect(ctx.dsn) as holder:
        client.create_queue(queue)
        client.subscribe_slots(queue, CONSUMER, slots=SLOTS)
        client.subscribe(queue, PROBE)
        client.maintenance(queue)
        _vacuum(plain)
        worker = WorkerProcess(ctx.dsn, queue, CONSUMER, "--slots", str(SLOTS),
                               "--handler", "noop")
        try:
            wait_for_group(client, queue, CONSUMER, [worker])
            # The held snapshot: idle in a transaction that has one, and no xid.
            holder.execute("set transaction isolation level repeatable read")
            holder.execute("select 1")
            horizon = plain.execute(
                "select backend_xmin::text from pg_stat_activity where pid = %s",
                (holder.info.backend_pid,)).fetchone()
            prober = _Prober(ctx.dsn, queue)
            prober.start()
            try:
                start = time.monotonic()
                sent = _send_paced(client, queue, RATE, seconds)
                sending_s = time.monotonic() - start
                _wait_caught_up(client, queue, worker)
                samples = prober.finish()
            finally:
                prober.close()
            held_dead = _dead_non_event(plain)
            holder.rollback()  # the snapshot goes
            client.conn.execute("select pg_stat_force_next_flush()")
            _vacuum(plain)
            time.sleep(1.5)  # the vacuum's counts reach pg_stat
            left_dead = _dead_non_event(plain)
            result = worker.stop()
        finally:
            worker.close()
        client.drop_queue(queue, force=True)
    handled = set(result.ids)
    if len(result.ids) != len(handled) or handled != set(sent) or result.failed:
        raise BenchError(f"{len(sent)} events sent, {len(result.ids)} handled "
                         f"({len(set(sent) - handled)} lost, {result.failed} failed)")

    sizes = [s.non_event_bytes for s in samples]
    first_ms, last_ms = (_edge(samples, "receive_ack_ms", last, edge) for last in (False, True))
    first_buf, last_buf = (_edge(samples, "receive_buffers", last, edge)
                           for last in (False, True))
    _log(f"  non-event tables: peak {max(sizes):,} bytes, final {sizes[-1]:,}; receive+ack "
         f"{first_ms:.2f} -> {last_ms:.2f} ms ({last_ms / first_ms:.2f}x, goal <= "
         f"{GOAL_RATIO}); receive buffers {first_buf:.0f} -> {last_buf:.0f}; dead tuples of "
         f"non-event tables with the snapshot held {held_dead}, after vacuum {left_dead}")
    events = len(sent)
    group_cost = "what the probe consumer's receive + ack costs (median of the edge minutes)"
    measurements = [
        Measurement(name="non_event_bytes.peak", label="non-event tables: peak size",
                    events=events, values=[float(max(sizes))], median=float(max(sizes)),
                    unit=BYTES, group="size of pgque's tables but the event tables"),
        Measurement(name="non_event_bytes.final", label="non-event tables: final size",
                    events=events, values=[float(sizes[-1])], median=float(sizes[-1]),
                    unit=BYTES, group="size of pgque's tables but the event tables"),
        Measurement(name="receive_ack.first", label="receive + ack, first minutes",
                    events=events, values=[first_ms], median=first_ms, unit=MS,
                    group=group_cost),
        Measurement(name="receive_ack.last", label="receive + ack, last minutes",
                    events=events, values=[last_ms], median=last_ms, unit=MS,
                    group=group_cost, baseline="receive_ack.first", ratio=last_ms / first_ms),
        Measurement(name="receive_buffers.first", label="buffers per receive, first minutes",
                    events=events, values=[first_buf], median=first_buf, unit="buffers",
                    group="shared buffers one receive touches"),
        Measurement(name="receive_buffers.last", label="buffers per receive, last minutes",
                    events=events, values=[last_buf], median=last_buf, unit="buffers",
                    group="shared buffers one receive touches",
                    baseline="receive_buffers.first",
                    ratio=last_buf / first_buf if first_buf else None),
    ]
    return SuiteResult(
        parameters={
            "rate": RATE, "seconds": seconds, "slots": SLOTS, "partition_keys": KEYS,
            "sent_rate": round(len(sent) / sending_s, 1),
            "held_snapshot": {"isolation": "repeatable read", "xid": None,
                              "backend_xmin": horizon[0] if horizon else None},
            "probe": {"consumer": PROBE, "max_events": PROBE_PIECE,
                      "drained": "to the end at every sample"},
            "edge_seconds": edge,
            "goal_ratio": GOAL_RATIO,
            "dead_non_event_with_snapshot_held": held_dead,
            "dead_non_event_after_release_and_vacuum": left_dead,
            "samples": [vars(s) for s in samples],
            "repeats": 1,
        },
        measurements=measurements,
    )


def _dead_non_event(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(_SIZES, {"event": _EVENT_TABLE}).fetchone()
    return int(row[2]) if row else 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


SUITE = register(Suite(
    name="held_horizon",
    description="an hour of 800 events/s through 16 slots while a session holds a snapshot "
                "(long: make bench-held-horizon)",
    run=run,
    default=False,
))
