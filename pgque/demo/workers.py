"""The demo's consumers: worker processes, each a :class:`pgque.Worker` of the group.

In each process (:func:`_worker_main`, started with multiprocessing's spawn) the
handler records every call it makes, with start and end read from the database
clock, and fails on purpose when the event's fate says so. In a transactional
run it is a transactional handler: first it applies the event's effect on the
Worker's connection (an index entry, and the file's bytes added to the
tenant's meter), which commits with the ack or, should the call fail, rolls
back with its savepoint. A :class:`Recorder` beside the Worker copies the
records into the handling table, over a connection of its own (so a failed
call is recorded too). Both are :class:`~pgque.lifecycle.Service` s: SIGTERM
stops the Worker, which finishes its batches and releases its slots, then the
recorder flushes the rest and the process exits 0, which the demo checks.

In the demo's own process, :class:`Workers` starts the processes, tells who
owns which slot, cuts a lane's session mid-batch (:meth:`Workers.cut_session`)
and stops them; :class:`RollingRestart` replaces one of them halfway through
the run, while its slots have a backlog.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.process import BaseProcess
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console

import pgque
from pgque.demo.checks import DOOMED_REASON, HANDLING_COLUMNS
from pgque.lifecycle import Service

__all__ = ["GROUP", "RollingRestart", "SimulatedFailure", "WorkerConfig", "Workers"]

GROUP = "indexer"  # the consumer group the workers form

# How often a worker copies its records into the handling table.
FLUSH_INTERVAL = 0.2


# -- in a worker process -----------------------------------------------------------------------


class SimulatedFailure(Exception):
    """What the demo's handler raises on purpose."""


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker process needs (pickled to a spawned interpreter)."""

    dsn: str
    queue: str
    schema: str  # the scratch schema: the handling table, and the effect's tables
    slots: int
    number: int
    work: float  # seconds of simulated work per event
    retry_after: float
    transactional: bool  # the handler applies the event's effect in the Worker's transaction


class Recorder(Service):
    """Buffers handling rows and copies them into the table every FLUSH_INTERVAL, so
    the handler's own cost is two clock reads, not an insert per event.

    Should its session be lost, the rows wait while it reconnects. A process
    killed outright would lose up to FLUSH_INTERVAL of rows (events acked but
    not recorded); the demo only ever stops workers with SIGTERM, after which
    :meth:`close` flushes the rest.
    """

    log = logging.getLogger("pgque.demo")

    def __init__(self, dsn: str, table: str) -> None:
        super().__init__("demo-recorder")
        self.dsn = dsn
        self._copy = sql.SQL("copy {} ({}) from stdin").format(
            sql.Identifier(*table.split(".")),
            sql.SQL(", ").join(map(sql.Identifier, HANDLING_COLUMNS)))
        self._rows: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def add(self, row: tuple[Any, ...]) -> None:
        """Queue one row for the next flush."""
        with self._lock:
            self._rows.append(row)

    def close(self) -> None:
        """Stop after a last flush; raises if rows are left unrecorded."""
        self.stop()
        if self.error is not None:
            raise self.error
        if self._rows:
            raise RuntimeError(f"{len(self._rows)} handling rows could not be recorded")

    def serve(self) -> None:
        conn = self.connect(self.dsn)
        try:
            while not self.sleep(FLUSH_INTERVAL):
                self._flush(conn)
            self._flush(conn)  # what came in before the stop
        finally:
            conn.close()

    def _flush(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        try:
            with conn.cursor() as cur, cur.copy(self._copy) as copy:
                for row in rows:
                    copy.write_row(row)
        except BaseException:
            with self._lock:  # back in front, for the next session to copy
                self._rows[:0] = rows
            raise


def _effect_statement(schema: str) -> sql.Composed:
    """A transactional handler's effect, in one round trip: the event's index entry
    (a row per application, with no key to refuse a second one) and its bytes added
    to its tenant's meter. Parameters: event id, tenant, bytes."""
    return sql.SQL(
        "with entry as (insert into {schema}.indexed (event_id, tenant, bytes) "
        "values (%s, %s, %s) returning tenant, bytes) "
        "insert into {schema}.metered as m (tenant, bytes) select tenant, bytes from entry "
        "on conflict (tenant) do update set bytes = m.bytes + excluded.bytes"
    ).format(schema=sql.Identifier(schema))


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
    recorder = Recorder(config.dsn, f"{config.schema}.handling")
    effect = _effect_statement(config.schema)
    recorder.start()
    local = threading.local()
    clocks: list[psycopg.Connection[Any]] = []
    clocks_lock = threading.Lock()
    pid = os.getpid()

    def clock() -> datetime:
        # One connection per handler thread, outside the Worker's transaction:
        # besides the effect, reading the database clock is a handler's only
        # round trip.
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

    def handle(message: pgque.Message[Any],
               conn: psycopg.Connection[Any] | None = None) -> None:
        started = clock()
        payload = message.payload
        fails = payload["fail"] == "always" or (payload["fail"] == "once"
                                                and message.retry_count == 0)
        if conn is not None:
            # Before the failure on purpose, so that a failed call has writes to
            # roll back. Should the session be gone this raises, and the call is
            # not recorded: it did nothing, and its batch comes back unacked, to
            # be made again as the same attempt.
            conn.execute(effect, (message.id, message.partition_key, payload["size"]))
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
        transactional=config.transactional, retry_after=config.retry_after,
        rebalance_interval=0.25, poll_interval=0.1,
        # Frequent maintenance brings retries back soon after retry_after.
        ticker=pgque.Ticker(config.dsn, maintenance_interval=0.2,
                            name=f"demo-ticker-{config.number}"),
        name=f"demo-worker-{config.number}",
        record=True)  # for pgque verify, the demo's last check
    worker.run()  # until SIGTERM: finishes its batches and releases its slots
    recorder.close()
    for conn in clocks:
        conn.close()


# -- in the demo's process ---------------------------------------------------------------------


class Workers:
    """The worker processes of one run, by number (1, 2, ...): started, watched,
    stopped with SIGTERM, with their exit codes."""

    def __init__(self, dsn: str, queue: str, schema: str, *, slots: int, work: float,
                 retry_after: float, transactional: bool, console: Console) -> None:
        self.dsn = dsn
        self.queue = queue
        self.schema = schema
        self.slots = slots
        self.work = work  # seconds of simulated work per event
        self.retry_after = retry_after
        self.transactional = transactional
        self.console = console
        self.processes: dict[int, BaseProcess] = {}
        self.exit_codes: dict[int, int | None] = {}
        self.stopping: set[int] = set()  # workers sent SIGTERM

    def spawn(self, number: int) -> None:
        """Start worker process ``number``."""
        context = multiprocessing.get_context("spawn")
        config = WorkerConfig(self.dsn, self.queue, self.schema, self.slots, number, self.work,
                              self.retry_after, self.transactional)
        # daemon: should the demo itself die, multiprocessing still ends its workers.
        process = context.Process(target=_worker_main, args=(config,),
                                  name=f"demo-worker-{number}", daemon=True)
        process.start()
        self.processes[number] = process

    def terminate(self, number: int) -> None:
        """SIGTERM to worker ``number``: it finishes its batches and returns."""
        self.stopping.add(number)
        self.processes[number].terminate()

    def exited(self) -> list[int]:
        """The workers whose process has ended."""
        return [n for n, process in self.processes.items() if process.exitcode is not None]

    def stop_all(self) -> None:
        """SIGTERM every worker still running and collect its exit code (idempotent)."""
        for number, process in self.processes.items():
            if process.exitcode is None:
                self.terminate(number)
        for number, process in sorted(self.processes.items()):
            process.join(30)
            if process.exitcode is None:
                self.console.print(f"[red]worker {number} ignored SIGTERM; killing it[/]")
                process.kill()
                process.join(10)
            self.exit_codes.setdefault(number, process.exitcode)

    def cut_session(self, admin: pgque.Client) -> str | None:
        """Terminate the session of a lane in the middle of a batch (idle in
        transaction: between two events, or in a handler), as a crash would;
        returns the lane's name, or None when no lane was there.

        The lane's transaction goes with its session, and its batch is delivered
        again. Its worker lives on (so does its recorder) and claims slots again,
        as do the others.
        """
        # LIMIT in a subquery: one lane, and the terminate evaluated for it alone.
        row = admin.conn.execute(
            "select name, pg_terminate_backend(pid) from ("
            "  select a.application_name as name, a.pid "
            "  from pgque.group_status(%s, %s) s, unnest(s.owner_pids) o(pid) "
            "  join pg_stat_activity a on a.pid = o.pid "
            "  where a.state = 'idle in transaction' limit 1) lane",
            (self.queue, GROUP)).fetchone()
        return str(row[0]) if row is not None and row[1] else None

    def owned(self, admin: pgque.Client) -> dict[int, list[int]]:
        """The slots each worker owns now."""
        # A worker's lane sessions are named demo-worker-<number>-lane<k> (see
        # _worker_main): the number is the one after "demo-worker-".
        rows = admin.conn.execute(
            "select split_part(a.application_name, '-', 3)::integer, "
            "       array_agg(o.slot - 1 order by o.slot) "
            "from pgque.group_status(%s, %s) s, unnest(s.owner_pids) with ordinality o(pid, slot) "
            "join pg_stat_activity a on a.pid = o.pid group by 1", (self.queue, GROUP)).fetchall()
        return dict(rows)

    def owners(self, admin: pgque.Client) -> str:
        """Which worker owns which slots, e.g. ``w1: 0,5  w2: 1,3``."""
        owned = self.owned(admin)
        return "  ".join(f"w{n}: {','.join(map(str, owned[n]))}" for n in sorted(owned)) or "none"


class RollingRestart:
    """The halfway event of the demo, advanced one step per progress poll.

    The joining worker starts with the producers; once every producer waits
    at the halfway barrier and the newcomer has joined, the leaving worker gets
    SIGTERM. It finishes its batches and releases its slots, which then have a
    backlog; the newcomer, below its share, claims them. The producers go on
    when the leaving worker has exited.
    """

    def __init__(self, workers: Workers, admin: pgque.Client, halfway: threading.Barrier, *,
                 producers: int, leaving: int, joining: int,
                 note: Callable[[str], None]) -> None:
        self.workers = workers
        self.admin = admin
        self.halfway = halfway
        self.producers = producers
        self.leaving = leaving
        self.joining = joining
        self.note = note  # prints above the progress display
        self.state = "start"
        self.slots: list[int] = []

    def step(self) -> None:
        """Advance as far as the situation allows, without blocking."""
        workers = self.workers
        if self.state == "start":
            workers.spawn(self.joining)
            self.state = "joining"
        if self.state == "joining":
            if self.halfway.n_waiting < self.producers:
                return
            status = self.admin.group_status(workers.queue, GROUP)
            if status.members < len(workers.processes):
                return
            self.halfway.wait()  # releases the producers into the barrier's second round
            self.slots = workers.owned(self.admin).get(self.leaving, [])
            pending = sum(s.pending_events or 0  # (None: a drop in progress; not in the demo)
                          for s in self.admin.partition_slot_status(workers.queue)
                          if s.slot in self.slots)
            self.note(f"halfway: worker {self.joining} has joined; SIGTERM to worker "
                      f"{self.leaving}, which owns slots {','.join(map(str, self.slots))} "
                      f"with {pending:,} events pending")
            workers.terminate(self.leaving)
            self.state = "leaving"
        if self.state == "leaving":
            process = workers.processes[self.leaving]
            if process.exitcode is None:
                return
            workers.exit_codes[self.leaving] = process.exitcode
            self.note(f"worker {self.leaving} exited {process.exitcode}")
            self.state = "handing over"
        if self.state == "handing over":
            owned = workers.owned(self.admin)
            if not set(self.slots) <= {s for slots in owned.values() for s in slots}:
                return  # not every slot claimed yet
            heirs = [f"w{n}" for n, slots in sorted(owned.items()) if set(slots) & set(self.slots)]
            self.note(f"slots {','.join(map(str, self.slots))} now belong to {', '.join(heirs)}; "
                      f"the producers go on" if self.slots else "the producers go on")
            self.halfway.wait()
            self.state = "done"
