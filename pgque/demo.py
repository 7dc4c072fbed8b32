"""``make demo``: pgque's motivating workload, end to end, with its guarantees checked.

A multi-tenant storage service emits FileCreated / FileOverwritten / FileDeleted
events, keyed by tenant, from two producers. A consumer group of 8 slots is
handled by 4 worker processes. Halfway, a rolling restart: a fifth worker joins,
worker 1 leaves on SIGTERM, and its slots change hands while they still have a
backlog (``--no-restart`` skips it; the producers pause at the halfway point
until it is over). The handler records every handling in a table, with
start and end taken from the database clock, and fails on purpose now and then:
about 1% of events fail their first attempt (the skip policy retries them) and
one event always fails (it must end up in dead letters).

At the end the records are checked (see :func:`verify`, a pure function):
every event handled, per-tenant send order held, no tenant handled by two
workers at once, retries handled, the doomed event dead-lettered, work spread
over the workers, the workers stopped cleanly. Exits non-zero if a check fails.

Without ``--dsn`` it runs on a throwaway embedded PostgreSQL. With ``--dsn`` it
creates its queue and a scratch schema on that server and drops both at the end
(and uninstalls pgque if it was the one to install it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import random
import secrets
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
)
from rich.table import Table
from rich.text import Text

import pgque
from pgque.localpg import LocalPostgres, find_bindir

__all__ = [
    "CHECK_TITLES",
    "Check",
    "Handling",
    "Letter",
    "Sent",
    "main",
    "verify",
]

GROUP = "indexer"
PGQUE_ROLES = ("pgque_reader", "pgque_writer", "pgque_admin")  # created by the install
KINDS = ("FileCreated", "FileOverwritten", "FileDeleted")
DOOMED_REASON = "is doomed: it fails on every attempt"

# The titles of the checks, in report order (tests look for them).
CHECK_HANDLED = "every event handled"
CHECK_ORDER = "per-tenant order held"
CHECK_EXCLUSIVE = "one handler per tenant at a time"
CHECK_RETRIES = "failed events retried and handled"
CHECK_DEAD_LETTER = "doomed event in dead letters"
CHECK_SPREAD = "slots spread over workers"
CHECK_THROUGHPUT = "throughput"
CHECK_STOPPED = "workers stopped cleanly"
CHECK_TITLES = (CHECK_HANDLED, CHECK_ORDER, CHECK_EXCLUSIVE, CHECK_RETRIES, CHECK_DEAD_LETTER,
                CHECK_SPREAD, CHECK_THROUGHPUT, CHECK_STOPPED)

# Columns of the handling table, in the order the workers copy rows in.
HANDLING_COLUMNS = ("event_id", "tenant", "producer", "seq", "worker", "pid", "attempt", "ok",
                    "started", "ended")


# -- records and checks (pure; see tests/test_demo.py) ----------------------------------------


@dataclass(frozen=True)
class Sent:
    """One event as a producer sent it.

    ``seq`` is its position in its producer's send order; ``fate`` says how the
    handler treats it: ``"ok"``, ``"flaky"`` (fails its first attempt) or
    ``"doomed"`` (fails every attempt).
    """

    event_id: int
    producer: int
    seq: int
    tenant: str
    fate: str = "ok"


@dataclass(frozen=True)
class Handling:
    """One handler call, as a worker recorded it (times from the database clock)."""

    event_id: int
    tenant: str
    producer: int
    seq: int
    worker: int  # the worker's number, 1..workers
    pid: int
    attempt: int  # the message's retry_count: 0 on the first delivery
    ok: bool
    started: datetime
    ended: datetime


@dataclass(frozen=True)
class Letter:
    """A dead letter of the demo queue."""

    event_id: int
    tenant: str | None
    retry_count: int
    reason: str | None


@dataclass(frozen=True)
class Check:
    """One line of the verification report."""

    title: str
    passed: bool
    detail: str


def verify(sent: Sequence[Sent], handlings: Sequence[Handling], letters: Sequence[Letter], *,
           max_retries: int, workers: Sequence[int], slot_of: Mapping[str, int],
           planned: int | None = None) -> list[Check]:
    """Check a run's records against the guarantees; one :class:`Check` per title
    of :data:`CHECK_TITLES` except the workers' exit codes (the caller knows those).

    ``workers`` are the numbers of the workers that ran (each should have handled
    events); ``slot_of`` maps each tenant to its slot; ``planned``, how many events
    the producers were to send (fewer were sent when the run was cut short).
    """
    by_event: dict[int, list[Handling]] = defaultdict(list)
    for handling in sorted(handlings, key=lambda h: (h.started, h.ended)):
        by_event[handling.event_id].append(handling)
    return [
        _check_handled(sent, handlings, by_event, planned),
        _check_order(sent, by_event),
        _check_exclusive(handlings),
        _check_retries(sent, by_event),
        _check_dead_letter(sent, by_event, letters, max_retries),
        _check_spread(handlings, workers, slot_of),
        _check_throughput(by_event),
    ]


def _ids(events: Sequence[int], limit: int = 3) -> str:
    shown = ", ".join(f"#{e}" for e in events[:limit])
    return shown + (f" and {len(events) - limit} more" if len(events) > limit else "")


def _check_handled(sent: Sequence[Sent], handlings: Sequence[Handling],
                   by_event: Mapping[int, list[Handling]], planned: int | None) -> Check:
    # The doomed event counts as handled once attempted: its fate is checked below.
    missing = [s.event_id for s in sent
               if not any(h.ok or s.fate == "doomed" for h in by_event.get(s.event_id, ()))]
    known = {s.event_id for s in sent}
    unknown = sorted(set(by_event) - known)
    # A duplicate is the same delivery (event and attempt) handled again: at-least-once.
    deliveries = Counter((h.event_id, h.attempt) for h in handlings)
    duplicates = sum(n - 1 for n in deliveries.values())
    succeeded = sum(1 for s in sent if any(h.ok for h in by_event.get(s.event_id, ())))
    doomed = sum(1 for s in sent if s.fate == "doomed")
    problems = []
    if planned is not None and len(sent) < planned:
        problems.append(f"only {len(sent):,} of {planned:,} events were sent")
    if missing:
        problems.append(f"{len(missing)} never handled: {_ids(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} handled but never sent: {_ids(unknown)}")
    detail = (f"{succeeded:,} of {len(sent):,} events handled successfully, "
              f"{doomed} doomed; {len(handlings):,} handler calls, "
              f"{duplicates} duplicate deliveries")
    return Check(CHECK_HANDLED, not problems, "; ".join([*problems, detail]))


def _check_order(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]]) -> Check:
    # The first handling of an event is its first attempt, which comes in send
    # order; retries come later by design, so only first handlings are compared.
    streams: dict[tuple[int, str], list[Sent]] = defaultdict(list)
    for s in sorted(sent, key=lambda s: (s.producer, s.seq)):
        streams[(s.producer, s.tenant)].append(s)
    broken: list[str] = []
    compared = 0
    for (producer, tenant), events in streams.items():
        firsts = [(s, by_event[s.event_id][0]) for s in events if by_event.get(s.event_id)]
        for (a, ha), (b, hb) in itertools.pairwise(firsts):
            compared += 1
            if not ha.started < hb.started:
                broken.append(f"producer {producer}, {tenant}: #{b.event_id} (sent {b.seq}) "
                              f"first handled before #{a.event_id} (sent {a.seq})")
    if broken:
        return Check(CHECK_ORDER, False,
                     f"{len(broken)} out of order; e.g. " + "; ".join(broken[:2]))
    return Check(CHECK_ORDER, True,
                 f"{len(streams):,} (producer, tenant) streams: {compared:,} consecutive pairs "
                 f"first handled in send order (retries aside)")


def _check_exclusive(handlings: Sequence[Handling]) -> Check:
    by_tenant: dict[str, list[Handling]] = defaultdict(list)
    for h in handlings:
        by_tenant[h.tenant].append(h)
    overlaps: list[str] = []
    moved = 0
    for tenant, calls in by_tenant.items():
        calls.sort(key=lambda h: (h.started, h.ended))
        moved += len({h.worker for h in calls}) > 1
        # Compare with the latest end so far, not only the previous call: a long
        # call may overlap several later ones.
        latest = calls[0]
        for h in calls[1:]:
            if h.started < latest.ended:
                overlaps.append(f"{tenant}: worker {latest.worker} #{latest.event_id} "
                                f"and worker {h.worker} #{h.event_id}")
            if h.ended > latest.ended:
                latest = h
    if overlaps:
        return Check(CHECK_EXCLUSIVE, False,
                     f"{len(overlaps)} overlapping handler calls; e.g. " + "; ".join(overlaps[:2]))
    return Check(CHECK_EXCLUSIVE, True,
                 f"{len(handlings):,} handler calls of {len(by_tenant)} tenants never overlapped "
                 f"in time; {moved} tenants changed workers during the run")


def _check_retries(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]]) -> Check:
    flaky = [s for s in sent if s.fate == "flaky"]
    not_retried: list[int] = []
    waits: list[float] = []
    for s in flaky:
        calls = by_event.get(s.event_id, [])
        first_fail = next((h for h in calls if h.attempt == 0 and not h.ok), None)
        retry_ok = next((h for h in calls if h.attempt > 0 and h.ok), None)
        if first_fail is None or retry_ok is None:
            not_retried.append(s.event_id)
        else:
            waits.append((retry_ok.started - first_fail.ended).total_seconds())
    # Only flaky first attempts and doomed ones may fail: anything else is a handler bug.
    fates = {s.event_id: s.fate for s in sent}
    unexpected = sorted({h.event_id for calls in by_event.values() for h in calls if not h.ok
                         and not (fates.get(h.event_id) == "doomed"
                                  or (fates.get(h.event_id) == "flaky" and h.attempt == 0))})
    problems = []
    if not flaky:
        problems.append("no event was meant to fail once: nothing was tested")
    if not_retried:
        problems.append(f"{len(not_retried)} not handled on a retry: {_ids(not_retried)}")
    if unexpected:
        problems.append(f"{len(unexpected)} failed unexpectedly: {_ids(unexpected)}")
    if problems:
        return Check(CHECK_RETRIES, False, "; ".join(problems))
    return Check(CHECK_RETRIES, True,
                 f"{len(flaky)} events failed their first attempt; all came back, behind "
                 f"their slot's backlog, and were handled {statistics.median(waits):.2f} s "
                 f"later (median), {max(waits):.2f} s at most")


def _check_dead_letter(sent: Sequence[Sent], by_event: Mapping[int, list[Handling]],
                       letters: Sequence[Letter], max_retries: int) -> Check:
    doomed = [s for s in sent if s.fate == "doomed"]
    if len(doomed) != 1:
        return Check(CHECK_DEAD_LETTER, False, f"expected one doomed event, {len(doomed)} sent")
    event = doomed[0]
    calls = by_event.get(event.event_id, [])
    # A set: a redelivered attempt is a legal duplicate, counted by the first check.
    attempts = sorted({h.attempt for h in calls})
    expected = list(range(max_retries + 1))
    mine = [x for x in letters if x.event_id == event.event_id]
    others = [x.event_id for x in letters if x.event_id != event.event_id]
    problems = []
    if attempts != expected:
        problems.append(f"attempts {attempts}, expected {expected}")
    if any(h.ok for h in calls):
        problems.append("it was handled successfully")
    if len(mine) != 1:
        problems.append(f"{len(mine)} dead letters for it, expected 1")
    elif DOOMED_REASON not in (mine[0].reason or ""):
        problems.append(f"reason {mine[0].reason!r}")
    elif mine[0].retry_count != max_retries:
        problems.append(f"retry count {mine[0].retry_count}, expected {max_retries}")
    if others:
        problems.append(f"other dead letters: {_ids(others)}")
    if problems:
        return Check(CHECK_DEAD_LETTER, False,
                     f"event #{event.event_id} ({event.tenant}): " + "; ".join(problems))
    return Check(CHECK_DEAD_LETTER, True,
                 f"event #{event.event_id} ({event.tenant}) failed {len(calls)} times "
                 f"(max_retries {max_retries}), dead letter reason: {mine[0].reason!r}")


def _check_spread(handlings: Sequence[Handling], workers: Sequence[int],
                  slot_of: Mapping[str, int]) -> Check:
    events: Counter[int] = Counter()
    slots: dict[int, set[int]] = defaultdict(set)
    for h in handlings:
        if h.ok:
            events[h.worker] += 1
            slots[h.worker].add(slot_of[h.tenant])
    idle = [w for w in workers if not events[w]]
    # With more workers than slots some must idle; otherwise every worker should work.
    spare = max(0, len(workers) - len(set(slot_of.values())))
    strangers = sorted(set(events) - set(workers))
    detail = "; ".join(f"w{w}: slots {','.join(map(str, sorted(slots[w]))) or '-'} "
                       f"({events[w]:,} events)" for w in sorted({*workers, *events}))
    problems = []
    if len(idle) > spare:
        problems.append(f"workers {', '.join(map(str, idle))} handled nothing")
    if strangers:
        problems.append(f"unknown workers {', '.join(map(str, strangers))} handled events")
    if problems:
        return Check(CHECK_SPREAD, False, "; ".join([*problems, detail]))
    busy = len(workers) - len(idle)
    return Check(CHECK_SPREAD, True, f"{busy} of {len(workers)} workers handled events: {detail}")


def _check_throughput(by_event: Mapping[int, list[Handling]]) -> Check:
    # Measured over first attempts: the retries' tail is retry_after plus
    # maintenance, a setting rather than a speed.
    firsts = [hs[0] for hs in by_event.values() if hs]
    if not firsts:
        return Check(CHECK_THROUGHPUT, False, "nothing was handled")
    span = (max(h.ended for h in firsts) - min(h.started for h in firsts)).total_seconds()
    rate = len(firsts) / span if span > 0 else math.inf
    calls = [h for hs in by_event.values() for h in hs]
    busy = statistics.median((h.ended - h.started).total_seconds() * 1000 for h in calls)
    return Check(CHECK_THROUGHPUT, True,
                 f"{len(firsts):,} events first handled in {span:.1f} s: {rate:,.0f} events/s "
                 f"over {len({h.worker for h in calls})} workers; handler call median "
                 f"{busy:.2f} ms")


# -- the worker processes -------------------------------------------------------------------


class SimulatedFailure(Exception):
    """What the demo's handler raises on purpose."""


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs (pickled to a spawned interpreter)."""

    dsn: str
    queue: str
    table: str  # schema-qualified name of the handling table
    slots: int
    number: int
    work: float  # seconds of simulated work per event
    retry_after: float


class Recorder:
    """Buffers handling rows and copies them into the table every 0.2 s, so the
    handler's own cost is two clock reads, not an insert per event.

    A process killed outright would lose up to 0.2 s of rows (events acked but
    not recorded); the demo only ever stops workers with SIGTERM, after which
    :meth:`close` flushes the rest.
    """

    def __init__(self, dsn: str, table: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._copy = sql.SQL("copy {} ({}) from stdin").format(
            sql.Identifier(*table.split(".")),
            sql.SQL(", ").join(map(sql.Identifier, HANDLING_COLUMNS)))
        self._rows: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-recorder", daemon=True)
        self._thread.start()

    def add(self, row: tuple[Any, ...]) -> None:
        """Queue one row for the next flush."""
        with self._lock:
            self._rows.append(row)

    def close(self) -> None:
        """Flush what is left and close the connection; raises if that flush fails."""
        self._stop.set()
        self._thread.join()
        self._flush()
        self._conn.close()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._flush()
            except psycopg.Error as exc:  # the rows went back; the next round retries
                logging.getLogger("pgque.demo").warning("recording failed: %s", exc)

    def _flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        try:
            with self._conn.cursor() as cur, cur.copy(self._copy) as copy:
                for row in rows:
                    copy.write_row(row)
        except BaseException:
            with self._lock:
                self._rows[:0] = rows
            raise


class _QuietSimulatedFailures(logging.Filter):
    """Drop the Worker's tracebacks of failures the demo causes on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SimulatedFailure))


def _worker_main(config: WorkerConfig) -> None:
    """Body of a worker process: run a pgque.Worker until SIGTERM, then flush the records.

    Returning normally is exit code 0, which the demo checks.
    """
    logging.basicConfig(level=logging.WARNING,
                        format=f"  [worker {config.number}, pid {os.getpid()}] %(message)s")
    logging.getLogger("pgque.worker").addFilter(_QuietSimulatedFailures())
    recorder = Recorder(config.dsn, config.table)
    local = threading.local()
    clocks: list[psycopg.Connection[Any]] = []
    clocks_lock = threading.Lock()
    pid = os.getpid()

    def clock() -> datetime:
        # One connection per handler thread: reading the database clock is the
        # only round trip a handler makes.
        conn: psycopg.Connection[Any] | None = getattr(local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(config.dsn, autocommit=True)
            local.conn = conn
            with clocks_lock:
                clocks.append(conn)
        row = conn.execute("select clock_timestamp()").fetchone()
        assert row is not None
        value: datetime = row[0]
        return value

    def handle(message: pgque.Message[Any]) -> None:
        started = clock()
        payload = message.payload
        fails = payload["fail"] == "always" or (payload["fail"] == "once"
                                                and message.retry_count == 0)
        if config.work:
            time.sleep(config.work)  # stands for the indexing work
        ended = clock()
        recorder.add((message.id, message.partition_key, payload["producer"], payload["seq"],
                      config.number, pid, message.retry_count, not fails, started, ended))
        if fails:
            what = DOOMED_REASON if payload["fail"] == "always" else "fails its first attempt"
            raise SimulatedFailure(f"event {message.id} {what}")

    worker = pgque.Worker(
        config.dsn, queue=config.queue, consumer=GROUP, slots=config.slots, handler=handle,
        retry_after=config.retry_after, rebalance_interval=0.25, poll_interval=0.1,
        # Frequent maintenance brings retries back soon after retry_after.
        ticker=pgque.Ticker(config.dsn, maintenance_interval=0.2,
                            name=f"demo-ticker-{config.number}"),
        name=f"demo-worker-{config.number}")
    worker.run()  # until SIGTERM: finishes its batches and releases its slots
    recorder.close()
    for conn in clocks:
        conn.close()


# -- the producers ----------------------------------------------------------------------------


@dataclass
class Workload:
    """The events to send, per producer, decided up front from the seed."""

    streams: list[list[pgque.Event]] = field(default_factory=list)
    fates: list[list[str]] = field(default_factory=list)


def plan_workload(events: int, tenants: int, producers: int, flaky: float,
                  seed: int) -> Workload:
    """Split ``events`` over the producers. Tenant sizes follow a mild Zipf law; each
    tenant's files go through create, overwrite and delete. About ``flaky`` of the
    events fail their first attempt; the middle event of producer 0 always fails."""
    rng = random.Random(seed)
    names = [f"tenant-{n:03d}" for n in range(tenants)]
    weights = list(itertools.accumulate(1 / (rank + 1) ** 0.6 for rank in range(tenants)))
    work = Workload()
    for producer in range(producers):
        count = events // producers + (producer < events % producers)
        files: dict[str, list[str]] = defaultdict(list)
        stream: list[pgque.Event] = []
        fates: list[str] = []
        for seq in range(count):
            tenant = rng.choices(names, cum_weights=weights)[0]
            mine = files[tenant]
            kind = "FileCreated" if not mine else rng.choices(KINDS, weights=(4, 4, 2))[0]
            if kind == "FileCreated":
                mine.append(f"/{tenant}/p{producer}/f{seq}.dat")
                path = mine[-1]
            elif kind == "FileOverwritten":
                path = rng.choice(mine)
            else:
                path = mine.pop(rng.randrange(len(mine)))
            fate = ("doomed" if producer == 0 and seq == count // 2
                    else "flaky" if rng.random() < flaky else "ok")
            fail = {"doomed": "always", "flaky": "once"}.get(fate)
            stream.append(pgque.Event(kind, {"path": path, "size": rng.randint(0, 1 << 24),
                                             "producer": producer, "seq": seq, "fail": fail},
                                      tenant))
            fates.append(fate)
        work.streams.append(stream)
        work.fates.append(fates)
    return work


def produce(dsn: str, queue: str, producer: int, work: Workload, chunk: int,
            on_sent: Callable[[int], None], halfway: threading.Barrier | None = None,
            stop: threading.Event | None = None) -> list[Sent]:
    """Send one producer's stream in order, ``chunk`` events per transaction, each
    committed before the next is sent; returns what was sent, in send order.

    With ``halfway``, waits at that barrier (with the other producers and the demo)
    once half the stream is sent, and again before going on. Stops early once
    ``stop`` is set.
    """
    stream, fates = work.streams[producer], work.fates[producer]
    pause = (len(stream) // 2) // chunk * chunk if halfway is not None else -1
    sent: list[Sent] = []
    with pgque.connect(dsn, pool_size=0) as client:
        for start in range(0, len(stream), chunk):
            if stop is not None and stop.is_set():
                break
            if start == pause and halfway is not None:
                halfway.wait()  # everyone is halfway: the demo restarts a worker
                halfway.wait()  # the restart is done
            events = stream[start:start + chunk]
            ids = client.send_batch(queue, events)
            for seq, (event, ev_id) in enumerate(zip(events, ids, strict=True), start):
                assert event.partition_key is not None
                sent.append(Sent(ev_id, producer, seq, event.partition_key, fates[seq]))
            on_sent(len(events))
    return sent


# -- the demo ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The command line, parsed."""

    dsn: str | None
    events: int
    tenants: int
    producers: int
    slots: int
    workers: int
    flaky: float
    work_ms: float
    max_retries: int
    retry_after: float
    timeout: float
    seed: int
    restart: bool


class _Rate(ProgressColumn):
    """Events per second over the last few seconds."""

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text(f"{speed:>7,.0f} ev/s" if speed is not None else "      - ev/s",
                    style="progress.data.speed")


class _RollingRestart:
    """The halfway event of the demo, advanced one step per progress poll.

    The joining worker starts with the producers; once every producer waits
    at the halfway barrier and the newcomer has joined, the leaving worker gets
    SIGTERM. It finishes its batches and releases its slots, which then have a
    backlog; the newcomer, below its share, claims them. The producers go on
    when the leaving worker has exited.
    """

    def __init__(self, demo: Demo, admin: pgque.Client, progress: Progress,
                 halfway: threading.Barrier, *, leaving: int, joining: int) -> None:
        self.demo = demo
        self.admin = admin
        self.progress = progress
        self.halfway = halfway
        self.leaving = leaving
        self.joining = joining
        self.state = "start"
        self.slots: list[int] = []

    def say(self, text: str) -> None:
        """A note above the progress display."""
        self.progress.console.print(f"    [dim]{text}[/]", highlight=False)

    def step(self) -> None:
        """Advance as far as the situation allows, without blocking."""
        demo = self.demo
        if self.state == "start":
            demo.spawn(self.joining)
            self.state = "joining"
        if self.state == "joining":
            if self.halfway.n_waiting < demo.opts.producers:
                return
            status = self.admin.group_status(demo.queue, GROUP)
            if status[0].members < len(demo.processes):
                return
            self.halfway.wait()  # releases the producers into the barrier's second round
            self.slots = demo.owned(self.admin).get(self.leaving, [])
            pending = sum(r["pending_events"] or 0
                          for r in self.admin.partition_slot_status(demo.queue)
                          if r["slot"] in self.slots)
            self.say(f"halfway: worker {self.joining} has joined; SIGTERM to worker "
                     f"{self.leaving}, which owns slots {','.join(map(str, self.slots))} "
                     f"with {pending:,} events pending")
            demo.stopping.add(self.leaving)
            demo.processes[self.leaving].terminate()
            self.state = "leaving"
        if self.state == "leaving":
            process = demo.processes[self.leaving]
            if process.exitcode is None:
                return
            demo.exit_codes[self.leaving] = process.exitcode
            self.say(f"worker {self.leaving} exited {process.exitcode}")
            self.state = "handing over"
        if self.state == "handing over":
            owned = demo.owned(self.admin)
            if not set(self.slots) <= {s for slots in owned.values() for s in slots}:
                return  # not every slot claimed yet
            heirs = [f"w{n}" for n, slots in sorted(owned.items()) if set(slots) & set(self.slots)]
            self.say(f"slots {','.join(map(str, self.slots))} now belong to {', '.join(heirs)}; "
                     f"the producers go on" if self.slots else "the producers go on")
            self.halfway.wait()
            self.state = "done"


class Demo:
    """One run of the demo against the server at ``dsn``."""

    def __init__(self, dsn: str, options: Options, console: Console) -> None:
        self.dsn = dsn
        self.opts = options
        self.console = console
        token = secrets.token_hex(3)
        self.queue = f"demo-storage-{token}"
        self.schema = f"pgque_demo_{token}"
        self.table = f"{self.schema}.handling"
        self.processes: dict[int, BaseProcess] = {}  # by worker number
        self.exit_codes: dict[int, int | None] = {}
        self.stopping: set[int] = set()  # workers sent SIGTERM

    def say(self, text: str) -> None:
        """Print a step of the demo."""
        self.console.print(f"[bold cyan]▸[/] {text}", highlight=False)

    def note(self, text: str) -> None:
        """Print a detail under the current step."""
        self.console.print(f"    [dim]{text}[/]", highlight=False)

    def run(self) -> list[Check]:
        """Set up, play the workload, verify and print the report, clean up; returns the
        checks."""
        opts = self.opts
        with pgque.connect(self.dsn) as admin:
            had_pgque = admin.conn.execute(
                "select to_regnamespace('pgque') is not null").fetchone() == (True,)
            # Installing creates cluster-wide roles; those new ones go again at the end.
            roles = {r for (r,) in admin.conn.execute(
                "select rolname from pg_roles where rolname = any(%s)", (list(PGQUE_ROLES),))}
            version = admin.install()
            try:
                self.say(f"pgque {version} {'found' if had_pgque else 'installed'}; queue "
                         f"[bold]{self.queue}[/] (max_retries {opts.max_retries}), consumer "
                         f"group [bold]{GROUP}[/] of {opts.slots} slots")
                admin.create_queue(self.queue, max_retries=opts.max_retries)
                admin.subscribe_slots(self.queue, GROUP, slots=opts.slots)
                self._create_table(admin.conn)
                self.note(f"handler calls are recorded in {self.table}")
                checks = self._play(admin)
                self._report(checks)
            finally:
                self._stop_workers()
                self._clean_up(uninstall=not had_pgque,
                               roles=[r for r in PGQUE_ROLES if r not in roles])
        return checks

    def _create_table(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("create schema {}").format(sql.Identifier(self.schema)))
        conn.execute(sql.SQL(
            "create table {}.handling (id bigint generated always as identity primary key, "
            "event_id bigint not null, tenant text not null, producer int not null, "
            "seq int not null, worker int not null, pid int not null, attempt int not null, "
            "ok boolean not null, started timestamptz not null, ended timestamptz not null)"
        ).format(sql.Identifier(self.schema)))

    def _play(self, admin: pgque.Client) -> list[Check]:
        opts = self.opts
        work = plan_workload(opts.events, opts.tenants, opts.producers, opts.flaky, opts.seed)
        flaky = sum(f.count("flaky") for f in work.fates)
        self.say(f"Starting {opts.workers} worker processes (multiprocessing, spawn), each a "
                 f"pgque.Worker of group {GROUP}")
        for number in range(1, opts.workers + 1):
            self.spawn(number)
        self._wait_settled(admin)

        self.say(f"Producing {opts.events:,} events for {opts.tenants} tenants from "
                 f"{opts.producers} producers, 50 per transaction, each committed before the "
                 f"next; {flaky} fail their first attempt, 1 fails every time")
        if opts.restart:
            self.note(f"halfway, a rolling restart: worker {opts.workers + 1} joins, worker 1 "
                      f"leaves on SIGTERM, and its slots change hands while they have a backlog")
        started = time.monotonic()
        sent = self._produce_and_wait(admin, work)
        self.note(f"{time.monotonic() - started:.1f} s of producing and handling; slot owners "
                  f"now: {self._owners(admin)}")

        self.say("Stopping the workers with SIGTERM")
        self._stop_workers()
        codes = [self.exit_codes.get(n) for n in sorted(self.processes)]
        self.note("exit codes: " + ", ".join(f"w{n}: {c}" for n, c in enumerate(codes, 1)))

        self.say("Verifying the records")
        handlings = self._handlings(admin.conn)
        letters = [Letter(d.event_id, d.partition_key, d.retry_count, d.reason)
                   for d in admin.dead_letters(self.queue)]
        tenants = sorted({s.tenant for s in sent})
        slot_of = dict(admin.conn.execute(
            "select t, pgque.slot_of(t, %s) from unnest(%s::text[]) t",
            (opts.slots, tenants)).fetchall())
        checks = verify(sent, handlings, letters, max_retries=opts.max_retries,
                        workers=sorted(self.processes), slot_of=slot_of, planned=opts.events)
        clean = bool(codes) and all(c == 0 for c in codes)
        checks.append(Check(CHECK_STOPPED, clean,
                            f"{len(codes)} workers finished their batches, released their slots "
                            f"and exited with {', '.join(map(str, codes))} on SIGTERM"))
        return checks

    def spawn(self, number: int) -> None:
        """Start worker process ``number``."""
        context = multiprocessing.get_context("spawn")
        config = WorkerConfig(self.dsn, self.queue, self.table, self.opts.slots, number,
                              self.opts.work_ms / 1000, self.opts.retry_after)
        # daemon: should the demo itself die, multiprocessing still ends its workers.
        process = context.Process(target=_worker_main, args=(config,),
                                  name=f"demo-worker-{number}", daemon=True)
        process.start()
        self.processes[number] = process

    def _wait_settled(self, admin: pgque.Client, timeout: float = 60.0) -> None:
        """Wait until every worker has joined and they own every slot, fairly shared."""
        members = len(self.processes)
        share = math.ceil(self.opts.slots / members)
        deadline = time.monotonic() + timeout
        with self.console.status(f"waiting for {members} workers to join and share the slots"):
            while True:
                status = admin.group_status(self.queue, GROUP)
                owners = Counter(s.owner_pid for s in status)
                if (status[0].members == members and None not in owners
                        and max(owners.values()) <= share):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not settle within {timeout:.0f} s: "
                                       f"{self._owners(admin)}")
                if any(p.exitcode is not None for p in self.processes.values()):
                    raise RuntimeError("a worker process died while starting")
                time.sleep(0.1)
        self.note(f"{members} workers joined; slot owners: {self._owners(admin)}")

    def owned(self, admin: pgque.Client) -> dict[int, list[int]]:
        """The slots each worker (by number) owns now."""
        rows = admin.conn.execute(
            "select a.application_name, array_agg(s.slot order by s.slot) "
            "from pgque.group_status(%s, %s) s join pg_stat_activity a on a.pid = s.owner_pid "
            "group by 1", (self.queue, GROUP)).fetchall()
        # Worker sessions are named demo-worker-<number> (see _worker_main).
        return {int(name.rsplit("-", 1)[-1]): slots for name, slots in rows}

    def _owners(self, admin: pgque.Client) -> str:
        """Which worker owns which slots, e.g. ``w1: 0,5  w2: 1,3``."""
        owned = self.owned(admin)
        return "  ".join(f"w{n}: {','.join(map(str, owned[n]))}" for n in sorted(owned)) or "none"

    def _produce_and_wait(self, admin: pgque.Client, work: Workload) -> list[Sent]:
        """Run the producers, the rolling restart and the progress display until every
        event is handled (or the timeout); returns what was sent."""
        opts = self.opts
        results: list[list[Sent]] = [[] for _ in range(opts.producers)]
        errors: list[BaseException] = []
        halfway = (threading.Barrier(opts.producers + 1, timeout=opts.timeout)
                   if opts.restart else None)
        stop = threading.Event()
        progress = Progress(TextColumn("{task.description:>8}"), BarColumn(bar_width=24),
                            MofNCompleteColumn(), _Rate(), TextColumn("{task.fields[note]}"),
                            console=self.console, speed_estimate_period=3.0)
        sending = progress.add_task("sent", total=opts.events, note="")
        handled = progress.add_task("handled", total=opts.events, note="")
        restart = (_RollingRestart(self, admin, progress, halfway, leaving=1,
                                   joining=opts.workers + 1) if halfway is not None else None)
        reported: set[int] = set()  # workers whose unexpected exit was reported

        def producer(number: int) -> None:
            try:
                results[number] = produce(self.dsn, self.queue, number, work, 50,
                                          lambda n: progress.advance(sending, n), halfway, stop)
            except BaseException as exc:  # reported below, after the progress display
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(n,), name=f"demo-producer-{n}")
                   for n in range(opts.producers)]
        count_sql = sql.SQL("select count(distinct event_id) filter (where ok), "
                            "count(*) filter (where not ok) from {}").format(
                                sql.Identifier(*self.table.split(".")))
        deadline = time.monotonic() + opts.timeout
        next_line = time.monotonic() + 5
        done = 0
        try:
            with progress:
                for thread in threads:
                    thread.start()
                while time.monotonic() < deadline:
                    if restart is not None:
                        restart.step()
                    for number, process in self.processes.items():
                        if (process.exitcode is not None and number not in reported
                                and number not in self.stopping):
                            reported.add(number)  # its slots go to the others; the checks tell
                            progress.console.print(f"    [red]worker {number} died (exit code "
                                                   f"{process.exitcode})[/]")
                    if all(p.exitcode is not None for p in self.processes.values()):
                        progress.console.print("    [red]no worker left: giving up[/]")
                        break
                    succeeded, failures = admin.conn.execute(count_sql).fetchone() or (0, 0)
                    letters = len(admin.dead_letters(self.queue))
                    done = succeeded + letters
                    progress.update(handled, completed=done,
                                    note=f"{failures} failed, {letters} dead")
                    if errors or (done >= opts.events
                                  and not any(t.is_alive() for t in threads)):
                        break
                    if not self.console.is_terminal and time.monotonic() >= next_line:
                        # No live display on a pipe: a line now and then shows progress.
                        next_line += 5
                        progress.console.print(f"    handled {done:,} of {opts.events:,}")
                    time.sleep(0.2)
        finally:
            stop.set()  # on a timeout or an interrupt: no point sending the rest
            if halfway is not None:  # never leave a producer waiting for a restart to come
                halfway.abort()
            for thread in threads:
                thread.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise RuntimeError(f"a producer failed: {real[0]!r}") from real[0]
        if done < opts.events:
            self.console.print(f"[bold red]gave up waiting after {opts.timeout:.0f} s[/]: "
                               f"{done:,} of {opts.events:,} events handled")
        return [s for part in results for s in part]

    def _handlings(self, conn: psycopg.Connection[Any]) -> list[Handling]:
        query = sql.SQL("select {} from {} order by id").format(
            sql.SQL(", ").join(map(sql.Identifier, HANDLING_COLUMNS)),
            sql.Identifier(*self.table.split(".")))
        return [Handling(*row) for row in conn.execute(query).fetchall()]

    def _stop_workers(self) -> None:
        """SIGTERM every worker still running and collect its exit code (idempotent)."""
        for number, process in self.processes.items():
            if process.exitcode is None:
                self.stopping.add(number)
                process.terminate()  # SIGTERM: the Worker finishes its batches and returns
        for number, process in sorted(self.processes.items()):
            process.join(30)
            if process.exitcode is None:
                self.console.print(f"[red]worker {number} ignored SIGTERM; killing it[/]")
                process.kill()
                process.join(10)
            self.exit_codes.setdefault(number, process.exitcode)

    def _clean_up(self, *, uninstall: bool, roles: Sequence[str]) -> None:
        """Drop the queue and the scratch schema; if the demo installed pgque, uninstall
        it and drop the ``roles`` the install created."""
        # A fresh session: an interrupt may have left the admin one mid-command.
        failed: list[str] = []
        try:
            client = pgque.connect(self.dsn, timeout=5)
        except pgque.ConnectError as exc:
            self.console.print(f"[yellow]cleanup impossible: {escape(str(exc))}[/]")
            return
        with client:
            with self._quietly("dropping the demo queue", failed), \
                    contextlib.suppress(pgque.QueueNotFound):  # interrupted before creating it
                client.drop_queue(self.queue, force=True)
            with self._quietly("dropping the scratch schema", failed):
                client.conn.execute(sql.SQL("drop schema if exists {} cascade").format(
                    sql.Identifier(self.schema)))
            if uninstall:
                with self._quietly("uninstalling pgque", failed):
                    client.uninstall()
                    for role in roles:
                        client.conn.execute(sql.SQL("drop role if exists {}").format(
                            sql.Identifier(role)))
        if not failed:
            self.say(f"Dropped queue {self.queue} and schema {self.schema}"
                     + ("; uninstalled pgque, which was not there before" if uninstall else ""))

    @contextmanager
    def _quietly(self, what: str, failed: list[str]) -> Iterator[None]:
        try:
            yield
        except (psycopg.Error, pgque.PgqueError) as exc:
            failed.append(what)
            self.console.print(f"[yellow]cleanup: {what} failed: {escape(str(exc))}[/]")

    def _report(self, checks: list[Check]) -> None:
        table = Table(title="Verification", title_justify="left", show_lines=True)
        table.add_column("", width=1)
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("result")
        for check in checks:
            mark = "[green]✔[/]" if check.passed else "[red]✘[/]"
            table.add_row(mark, check.title, escape(check.detail))
        self.console.print(table)


def verdict(checks: Sequence[Check]) -> str:
    """The last line of the demo, as rich markup."""
    failed = [c.title for c in checks if not c.passed]
    if failed:
        return f"[bold red]✘ {len(failed)} of {len(checks)} checks failed:[/] " + ", ".join(failed)
    return f"[bold green]✔ all {len(checks)} checks passed[/]"


def parse_args(argv: list[str] | None) -> Options:
    """Parse the command line into :class:`Options`."""
    parser = argparse.ArgumentParser(
        prog="python -m pgque.demo",
        description="pgque's motivating workload (a multi-tenant storage service, partitioned "
                    "by tenant), end to end, with its guarantees checked.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dsn", help="use this server instead of an embedded one")
    parser.add_argument("--events", type=int, default=20_000, help="events to send")
    parser.add_argument("--tenants", type=int, default=300, help="tenants (partition keys)")
    parser.add_argument("--producers", type=int, default=2, help="producer threads")
    parser.add_argument("--slots", type=int, default=8, help="slots of the consumer group")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--flaky", type=float, default=0.01,
                        help="share of events that fail their first attempt")
    parser.add_argument("--work-ms", type=float, default=0.0,
                        help="simulated work per event, in milliseconds")
    parser.add_argument("--max-retries", type=int, default=2, help="the queue's max_retries")
    parser.add_argument("--retry-after", type=float, default=0.2,
                        help="seconds before a failed event comes back")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for every event to be handled")
    parser.add_argument("--seed", type=int, default=1, help="seed of the workload")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="halfway, replace worker 1 by a new one (a rolling restart)")
    args = parser.parse_args(argv)
    if min(args.producers, args.workers, args.tenants) < 1 or args.events < 2 * args.producers:
        parser.error("need a producer, a worker, a tenant and two events per producer")
    if not 0 <= args.flaky < 1:
        parser.error("--flaky is a share: at least 0, below 1")
    return Options(args.dsn, args.events, args.tenants, args.producers, args.slots, args.workers,
                   args.flaky, args.work_ms, args.max_retries, args.retry_after, args.timeout,
                   args.seed, args.restart)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 when every check passed)."""
    options = parse_args(argv)
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=120)  # logs and pipes: fewer wrapped lines
    console.rule("[bold]pgque demo[/]: a multi-tenant storage service, partitioned by tenant")
    started = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so the workers, the queue and the server are cleaned up.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        if options.dsn:
            checks = Demo(options.dsn, options, console).run()
        else:
            server = LocalPostgres(find_bindir("embedded"))
            try:
                with console.status("starting an embedded PostgreSQL"):
                    server.start()
                console.print(f"[bold cyan]▸[/] Embedded PostgreSQL {server.major_version} "
                              f"running at {server.dsn()}", highlight=False)
                checks = Demo(server.dsn(), options, console).run()
            finally:
                server.close()
                console.print("[bold cyan]▸[/] Embedded PostgreSQL stopped and deleted")
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]")
        return 130
    except Exception:  # an exit code for the CLI rather than a raise; cleanup ran already
        console.print_exception(max_frames=8)
        console.print("[bold red]demo failed[/]")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    console.print(f"{verdict(checks)} [dim](the demo took {time.monotonic() - started:.1f} s)[/]")
    return 0 if checks and all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
