"""Suite ``engine``: what the PL/pgSQL engine costs per event, next to plain INSERTs.

Measured on one server, in one database, from one connection per side:

* ``send``: one event per transaction, against a plain one-row INSERT into a
  table shaped like pgque's event tables; ``send.sql`` the same through
  ``select pgque.send(...)`` on a plain connection, without the Client;
* ``send_batch``: 1,000 events per call and transaction, against a plain
  multi-row INSERT ... SELECT FROM unnest() of the same rows;
* both again into a queue with a consumer group of 8 slots (``*.slot_index``),
  whose event tables carry the group's slot index, against the plain ``send``
  and ``send_batch``: what the index costs producers;
* drain: receive + ack over a pre-filled queue (a tick every 1,000 events),
  whole batches and pieces of ``max_events=100``; every event is counted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

import pgque
from bench.measure import Case, Workload, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register
from pgque.codec import encode_payload

__all__ = ["SUITE"]

EVENT_TYPE = "e"
CONSUMER = "bench"
SLOTS = 8  # the consumer group of the *.slot_index cases
POOL_SIZE = 10_000  # distinct events cycled through; a multiple of every batch size

# Shaped like pgque.event_template with the defaults create_queue() gives an
# event table, and like each of its event tables indexed on ev_txid only.
_PLAIN_TABLE_DDL = """
create table {table} (
    ev_id     bigint not null default nextval('{table}_seq'),
    ev_time   timestamptz not null default now(),
    ev_txid   xid8 not null default pg_current_xact_id(),
    ev_owner  integer,
    ev_retry  integer not null default 0,
    ev_type   text,
    ev_data   text,
    ev_extra1 text
);
create index {table}_txid_idx on {table} (ev_txid)
"""

# RETURNING ev_id: send and send_batch hand the new ids back too. The arrays go
# in binary (%b), as pgque's client sends them: the comparison is then of the
# server side, not of psycopg's text-array encoding (several times slower).
_PLAIN_INSERT = (
    "insert into {table} (ev_type, ev_data, ev_extra1) values (%s, %s, %s) returning ev_id"
)
# The statement the Client sends for Client.send.
_SEND = "select pgque.send(%s, %s, %s::text, %s)"
_PLAIN_INSERT_MANY = (
    "insert into {table} (ev_type, ev_data, ev_extra1)"
    " select * from unnest(%b::text[], %b::text[], %b::text[]) returning ev_id"
)

Row = tuple[str, dict[str, Any], str]


@dataclass(frozen=True)
class Sizes:
    """How many events each measurement handles per run."""

    send: int
    batch_total: int
    batch_size: int
    drain_total: int
    tick_every: int
    piece: int

    @classmethod
    def for_run(cls, quick: bool) -> Sizes:
        if quick:
            return cls(send=2_000, batch_total=20_000, batch_size=1_000, drain_total=20_000,
                       tick_every=1_000, piece=100)
        return cls(send=20_000, batch_total=200_000, batch_size=1_000, drain_total=200_000,
                   tick_every=1_000, piece=100)


def payload(i: int) -> dict[str, Any]:
    """A small, realistic event: a file change of one of 64 tenants."""
    return {"tenant": f"t-{i % 64}", "path": f"/a/b/{i}/c.txt", "size": 1000 + i * 37 % 90_000}


def _rows(count: int) -> list[Row]:
    return [(EVENT_TYPE, p, p["tenant"]) for p in map(payload, range(count))]


def _chunks(rows: list[Row], count: int, size: int) -> Iterator[list[Row]]:
    """``count`` events in lists of ``size``, cycling through ``rows``."""
    if count % size or len(rows) % size:
        raise ValueError(f"{count} events do not split into batches of {size}")
    for offset in range(0, count, size):
        start = offset % len(rows)
        yield rows[start:start + size]


def _warmup(count: int, unit: int) -> int:
    """About 5% of a run, in whole units (batches), at least one."""
    return max(unit, count // 20 // unit * unit)


class _Producers:
    """pgque's send/send_batch and their plain-INSERT baselines, one connection each."""

    def __init__(self, client: pgque.Client, plain: psycopg.Connection[Any],
                 rows: list[Row]) -> None:
        self.client = client
        self.plain = plain
        self.rows = rows

    def send(self, queue: str) -> Workload:
        def run(count: int) -> int:
            ids = [self.client.send(queue, etype, data, partition_key=key)
                   for etype, data, key in itertools.islice(itertools.cycle(self.rows), count)]
            return len(set(ids))  # one new id per call, or the count comes out short
        return run

    def send_sql(self, queue: str) -> Workload:
        def run(count: int) -> int:
            ids = {self.plain.execute(_SEND, (queue, etype, encode_payload(data), key)).fetchone()
                   for etype, data, key in itertools.islice(itertools.cycle(self.rows), count)}
            return len(ids)
        return run

    def plain_insert(self, table: str) -> Workload:
        statement = _PLAIN_INSERT.format(table=table)

        def run(count: int) -> int:
            done = 0
            for etype, data, key in itertools.islice(itertools.cycle(self.rows), count):
                row = self.plain.execute(statement, (etype, encode_payload(data), key)).fetchone()
                done += row is not None
            return done
        return run

    def send_batch(self, queue: str, size: int) -> Workload:
        def run(count: int) -> int:
            return sum(len(self.client.send_batch(queue, chunk))
                       for chunk in _chunks(self.rows, count, size))
        return run

    def plain_insert_many(self, table: str, size: int) -> Workload:
        statement = _PLAIN_INSERT_MANY.format(table=table)

        def run(count: int) -> int:
            done = 0
            for chunk in _chunks(self.rows, count, size):
                columns = ([r[0] for r in chunk], [encode_payload(r[1]) for r in chunk],
                           [r[2] for r in chunk])
                done += len(self.plain.execute(statement, columns).fetchall())
            return done
        return run


class _Drain:
    """A fresh queue per run, filled before the clock starts, then drained by one consumer."""

    def __init__(self, client: pgque.Client, rows: list[Row], tick_every: int) -> None:
        self.client = client
        self.rows = rows
        self.tick_every = tick_every
        self.queue: str | None = None
        self._made = 0

    def prepare(self, count: int) -> None:
        if self.queue is not None:
            self.client.drop_queue(self.queue, force=True)
        self._made += 1
        self.queue = f"drain_{self._made}"
        # Ticks are forced below, as a ticker would make them at this rate;
        # ticker_max_count says the same, for anyone who calls ticker().
        self.client.create_queue(self.queue, ticker_max_count=self.tick_every)
        self.client.subscribe(self.queue, CONSUMER)  # before the events: it sees them all
        for chunk in _chunks(self.rows, count, self.tick_every):
            self.client.send_batch(self.queue, chunk)
            self.client.tick(self.queue)

    def receive_all(self, max_events: int | None) -> Workload:
        def run(count: int) -> int:
            assert self.queue is not None, "prepare() fills the queue first"
            received = 0
            while (batch := self.client.receive(self.queue, CONSUMER,
                                                max_events=max_events)) is not None:
                received += len(batch)
                self.client.ack(batch)
            return received
        return run


def run(ctx: SuiteContext) -> SuiteResult:
    """Measure send, send_batch and drain with their baselines, one group after the other."""
    sizes = Sizes.for_run(ctx.quick)
    rows = _rows(POOL_SIZE)
    # The Client as users get it (pgque.connect's defaults): its sends from this
    # thread go on its own connection, its pool is for other threads'.
    with pgque.connect(ctx.dsn) as client, \
            psycopg.connect(ctx.dsn, autocommit=True) as plain:
        for table in ("plain_send", "plain_batch"):
            plain.execute(f"create sequence {table}_seq")
            plain.execute(_PLAIN_TABLE_DDL.format(table=table))
        for queue in ("send", "batch", "send_indexed", "batch_indexed"):
            client.create_queue(queue)
        # What a consumer group's slot index costs producers: the same sends
        # into a queue with a group of SLOTS slots (its event tables then have
        # an index on the routing formula besides the ev_txid one).
        for queue in ("send_indexed", "batch_indexed"):
            client.subscribe_slots(queue, CONSUMER, slots=SLOTS)
            client.maintenance(queue)  # which makes the group's slot index
        producers = _Producers(client, plain, rows)
        drain = _Drain(client, rows, sizes.tick_every)
        batch_warmup = _warmup(sizes.batch_total, sizes.batch_size)
        drain_warmup = _warmup(sizes.drain_total, sizes.tick_every)
        groups = [
            [Case("send", "pgque send, 1 event/tx", sizes.send, producers.send("send"),
                  warmup=_warmup(sizes.send, 1), baseline="send.plain"),
             Case("send.sql", "select pgque.send(), 1 event/tx", sizes.send,
                  producers.send_sql("send"), warmup=_warmup(sizes.send, 1),
                  baseline="send.plain"),
             Case("send.plain", "plain INSERT, 1 row/tx", sizes.send,
                  producers.plain_insert("plain_send"), warmup=_warmup(sizes.send, 1)),
             Case("send.slot_index", f"pgque send, 1 event/tx, a group of {SLOTS} slots",
                  sizes.send, producers.send("send_indexed"), warmup=_warmup(sizes.send, 1),
                  baseline="send")],
            [Case("send_batch", f"pgque send_batch, {sizes.batch_size}/tx", sizes.batch_total,
                  producers.send_batch("batch", sizes.batch_size), warmup=batch_warmup,
                  baseline="send_batch.plain"),
             Case("send_batch.plain", f"plain INSERT unnest, {sizes.batch_size}/tx",
                  sizes.batch_total, producers.plain_insert_many("plain_batch", sizes.batch_size),
                  warmup=batch_warmup),
             Case("send_batch.slot_index",
                  f"pgque send_batch, {sizes.batch_size}/tx, a group of {SLOTS} slots",
                  sizes.batch_total, producers.send_batch("batch_indexed", sizes.batch_size),
                  warmup=batch_warmup, baseline="send_batch")],
            [Case("drain", "receive+ack, whole batches", sizes.drain_total,
                  drain.receive_all(None), warmup=drain_warmup, prepare=drain.prepare),
             Case(f"drain.max_events_{sizes.piece}", f"receive+ack, max_events={sizes.piece}",
                  sizes.drain_total, drain.receive_all(sizes.piece), warmup=drain_warmup,
                  prepare=drain.prepare)],
        ]
        measurements = []
        for cases in groups:
            measurements += measure(cases, ctx.repeats)
    return SuiteResult(
        parameters={
            "events_per_run": {m.name: m.events for m in measurements},
            "batch_size": sizes.batch_size,
            "tick_every": sizes.tick_every,
            "repeats": ctx.repeats,
            "payload_example": payload(17),
            "partition_key": "payload's tenant (64 tenants)",
            "slot_index_group_slots": SLOTS,
        },
        measurements=measurements,
    )


SUITE = register(Suite(
    name="engine",
    description="send, send_batch and drain events/s, next to plain INSERTs",
    run=run,
))
