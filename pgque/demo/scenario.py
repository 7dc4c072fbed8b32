"""One run of the demo against a server, from setup to cleanup.

:class:`Demo` installs pgque where it is missing, creates the queue, the
consumer group and a scratch schema for the records (and, in a transactional
run, for the handlers' effects), starts the workers, runs the producers under a
progress display (with the rolling restart halfway, unless ``--no-restart``,
and in a transactional run a lane's session cut mid-batch at three quarters),
stops the workers, verifies the records and prints the report. Whatever
happens, it drops its queue and schema at the end (and uninstalls pgque if it
was the one to install it).
"""

from __future__ import annotations

import contextlib
import math
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from pgque.demo.checks import (
    CHECK_STOPPED,
    CHECK_VERIFIED,
    HANDLING_COLUMNS,
    Check,
    Effects,
    Handling,
    Letter,
    Sent,
    verify,
)
from pgque.demo.workers import GROUP, RollingRestart, Workers
from pgque.demo.workload import Workload, plan_workload, produce

__all__ = ["Demo", "Options"]

PGQUE_ROLES = ("pgque_reader", "pgque_writer", "pgque_admin")  # created by the install


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
    transactional: bool
    policy: str = "skip"  # the group's failure policy


class _Rate(ProgressColumn):
    """Events per second over the last few seconds."""

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text(f"{speed:>7,.0f} ev/s" if speed is not None else "      - ev/s",
                    style="progress.data.speed")


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
        self.workers = Workers(dsn, self.queue, self.schema, slots=options.slots,
                               work=options.work_ms / 1000, retry_after=options.retry_after,
                               transactional=options.transactional, console=console)

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
                if opts.policy == "pause":
                    # A tenant waits for its failed event: max_retries + 1 attempts,
                    # as many as skip makes, then the dead letters.
                    admin.set_failure_policy(self.queue, GROUP, "pause",
                                             max_attempts=opts.max_retries + 1,
                                             pause_timeout=None)
                    self.note("failure policy pause: a failed event holds its tenant's later "
                              "events back until it is handled or dead-lettered")
                self._create_tables(admin.conn)
                self.note(f"handler calls are recorded in {self.table}")
                if opts.transactional:
                    self.note(f"transactional handlers: each event's effect (a row of "
                              f"{self.schema}.indexed, its file's bytes added to its tenant's "
                              f"total in {self.schema}.metered) commits with the ack, or not "
                              f"at all")
                checks = self._play(admin)
                self._report(checks)
            finally:
                self.workers.stop_all()
                self._clean_up(uninstall=not had_pgque,
                               roles=[r for r in PGQUE_ROLES if r not in roles])
        return checks

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        schema = sql.Identifier(self.schema)
        conn.execute(sql.SQL("create schema {}").format(schema))
        conn.execute(sql.SQL(
            "create table {}.handling (id bigint generated always as identity primary key, "
            "event_id bigint not null, tenant text not null, producer int not null, "
            "seq int not null, worker int not null, pid int not null, attempt int not null, "
            "ok boolean not null, started timestamptz not null, ended timestamptz not null)"
        ).format(schema))
        if self.opts.transactional:
            # The effect's tables (see workers._effect_statement). No key on
            # indexed: an event applied twice shows as two rows, for the check.
            conn.execute(sql.SQL(
                "create table {}.indexed (event_id bigint not null, tenant text not null, "
                "bytes bigint not null)").format(schema))
            conn.execute(sql.SQL(
                "create table {}.metered (tenant text primary key, bytes bigint not null)"
            ).format(schema))

    def _play(self, admin: pgque.Client) -> list[Check]:
        opts = self.opts
        work = plan_workload(opts.events, opts.tenants, opts.producers, opts.flaky, opts.seed)
        flaky = sum(f.count("flaky") for f in work.fates)
        self.say(f"Starting {opts.workers} worker processes (multiprocessing, spawn), each a "
                 f"pgque.Worker of group {GROUP}"
                 + (", transactional" if opts.transactional else ", with plain handlers "
                    "(at least once)"))
        for number in range(1, opts.workers + 1):
            self.workers.spawn(number)
        self._wait_settled(admin)

        self.say(f"Producing {opts.events:,} events for {opts.tenants} tenants from "
                 f"{opts.producers} producers, 50 per transaction, each committed before the "
                 f"next; {flaky} fail their first attempt, 1 fails every time")
        if opts.restart:
            self.note(f"halfway, a rolling restart: worker {opts.workers + 1} joins, worker 1 "
                      f"leaves on SIGTERM, and its slots change hands while they have a backlog")
        if opts.transactional:
            self.note("at three quarters, a lane's session is cut mid-batch, as a crash would: "
                      "its uncommitted effects roll back and its batch is delivered again")
        started = time.monotonic()
        sent = self._produce_and_wait(admin, work)
        self.note(f"{time.monotonic() - started:.1f} s of producing and handling; slot owners "
                  f"now: {self.workers.owners(admin)}")

        self.say("Stopping the workers with SIGTERM")
        self.workers.stop_all()
        codes = [self.workers.exit_codes.get(n) for n in sorted(self.workers.processes)]
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
                        workers=sorted(self.workers.processes), slot_of=slot_of,
                        planned=opts.events, policy=opts.policy,
                        effects=self._effects(admin.conn) if opts.transactional else None)
        clean = bool(codes) and all(c == 0 for c in codes)
        checks.append(Check(CHECK_STOPPED, clean,
                            f"{len(codes)} workers finished their batches, released their slots "
                            f"and exited with {', '.join(map(str, codes))} on SIGTERM"))
        checks.append(_verified(admin.verify(self.queue, GROUP)))
        return checks

    def _wait_settled(self, admin: pgque.Client, timeout: float = 60.0) -> None:
        """Wait until every worker has joined and they own every slot, fairly shared."""
        members = len(self.workers.processes)
        share = math.ceil(self.opts.slots / members)
        deadline = time.monotonic() + timeout
        with self.console.status(f"waiting for {members} workers to join and share the slots"):
            while True:
                status = admin.group_status(self.queue, GROUP)
                # Shares are per worker: a slot's owner pid is one of its worker's lanes.
                shares = [len(slots) for slots in self.workers.owned(admin).values()]
                if (status.members == members and all(s.owner_pid for s in status.slots)
                        and max(shares, default=0) <= share):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers did not settle within {timeout:.0f} s: "
                                       f"{self.workers.owners(admin)}")
                if self.workers.exited():
                    raise RuntimeError("a worker process died while starting")
                time.sleep(0.1)
        self.note(f"{members} workers joined; slot owners: {self.workers.owners(admin)}")

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
        restart = (RollingRestart(self.workers, admin, halfway, producers=opts.producers,
                                  leaving=1, joining=opts.workers + 1, note=self.note)
                   if halfway is not None else None)
        reported: set[int] = set()  # workers whose unexpected exit was reported

        def producer(number: int) -> None:
            try:
                results[number] = produce(self.dsn, self.queue, number, work, 50,
                                          lambda n: progress.advance(sending, n), halfway, stop)
            except BaseException as exc:  # reported below, after the progress display
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(n,), name=f"demo-producer-{n}")
                   for n in range(opts.producers)]
        count_sql = self._count_sql()
        cut_at = opts.events * 3 // 4 if opts.transactional else None
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
                    exited = self.workers.exited()
                    for number in exited:
                        if number not in reported and number not in self.workers.stopping:
                            reported.add(number)  # its slots go to the others; the checks tell
                            code = self.workers.processes[number].exitcode
                            progress.console.print(f"    [red]worker {number} died (exit code "
                                                   f"{code})[/]")
                    if len(exited) == len(self.workers.processes):
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
                    if cut_at is not None and done >= cut_at:
                        lane = self.workers.cut_session(admin)
                        if lane is not None:  # else none was mid-batch: the next poll tries
                            cut_at = None
                            self.note(f"{done:,} events handled: cut the session of {lane}, "
                                      f"mid-batch")
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
        elif cut_at is not None:
            self.note("no lane was found mid-batch after three quarters: no session was cut")
        return [s for part in results for s in part]

    def _count_sql(self) -> sql.Composed:
        """Progress: the events handled, the handler calls that failed. Transactional
        handlers' events count once their effect has committed: a call whose
        transaction went with its session must be made again."""
        schema = sql.Identifier(self.schema)
        if self.opts.transactional:
            return sql.SQL("select (select count(distinct event_id) from {}.indexed), "
                           "(select count(*) from {}.handling where not ok)").format(
                               schema, schema)
        return sql.SQL("select count(distinct event_id) filter (where ok), "
                       "count(*) filter (where not ok) from {}.handling").format(schema)

    def _handlings(self, conn: psycopg.Connection[Any]) -> list[Handling]:
        query = sql.SQL("select {} from {} order by id").format(
            sql.SQL(", ").join(map(sql.Identifier, HANDLING_COLUMNS)),
            sql.Identifier(*self.table.split(".")))
        return [Handling(*row) for row in conn.execute(query).fetchall()]

    def _effects(self, conn: psycopg.Connection[Any]) -> Effects:
        schema = sql.Identifier(self.schema)
        entries = conn.execute(sql.SQL(
            "select event_id, count(*) from {}.indexed group by event_id").format(schema))
        metered = conn.execute(sql.SQL("select tenant, bytes from {}.metered").format(schema))
        return Effects(dict(entries.fetchall()), dict(metered.fetchall()))

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


def _verified(result: pgque.Verification) -> Check:
    """The check of the workers' own record (Worker(record=True)) by pgque verify."""
    summary = result.summary
    detail = (f"{summary.calls:,} recorded handler calls of {summary.events:,} events by "
              f"{summary.workers} workers: ")
    if result.ok:
        detail += "per-key order, one handler per key at a time and no loss held"
    else:
        detail += "; ".join(f"{v.kind} of event {v.ev_id} (key {v.partition_key})"
                            for v in result.violations[:3])
    windows = len(result.findings) - len(result.violations)
    if windows:
        detail += f" ({windows} zombie windows, which are no violation)"
    return Check(CHECK_VERIFIED, result.ok, detail)
