"""A primary failover under load: a real streaming-replication pair
(tests/replication.py), the recommended deployment on it, Workers with
transactional handlers, a Ticker and a producer, all given a multi-host DSN
(``host=a,b target_session_attrs=read-write``). The primary is killed (an
immediate stop) and the standby promoted while events flow.

Under synchronous replication every event whose send returned is handled on
the new primary, exactly once (its effect, written in the transaction that
acks, is there once), and each key's events in send order. Under asynchronous
replication what was lost is measured (events whose send returned but that the
new primary never had), not asserted; what survived is handled exactly once and
in order. Each run prints a ``FAILOVER`` line with its figures (the time from
the kill to the first handler call on the new primary, events, lost) and adds
them to the fault report (tests/faults.py: ``fault_report.json``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pgtest
import psycopg
import pytest
from faults import append_report, report_path
from helpers import wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from replication import ReplicaPair
from test_faults import long_variant

import pgque
from pgque.testing import Deployment, ExternalServer

QUEUE = "orders"
GROUP = "billing"
SLOTS = 4
KEYS = 7


@pytest.fixture(params=["sync", "async"])
def pair(request: pytest.FixtureRequest, pg_server: pgtest.PgServer) -> Iterator[ReplicaPair]:
    """A primary and a streaming standby of the test server's binaries."""
    postgres = getattr(pg_server, "postgres", None)
    if postgres is None:
        pytest.skip("the failover tests start servers of their own: they need the "
                    "binaries of a local test server (not an external one)")
    with ReplicaPair(postgres.bindir, sync=request.param == "sync",
                     tmpdir=postgres.tmpdir) as made:
        yield made


def multi_host(pair: ReplicaPair, dsn: str) -> str:
    """``dsn`` (a role's, on the primary) over both servers, to whichever writes."""
    assert pair.standby is not None
    params = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1,127.0.0.1",
                  port=f"{pair.primary.port},{pair.standby.port}",
                  target_session_attrs="read-write", connect_timeout="3")
    return make_conninfo(**params)


class Producer(threading.Thread):
    """Sends an event at a time (a key of KEYS each) until stopped, reconnecting
    through the outage; keeps the ids whose send returned (committed)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(name="failover-producer", daemon=True)
        self.dsn = dsn
        self.confirmed: list[tuple[int, str]] = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        client: pgque.Client | None = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = pgque.connect(self.dsn, pool_size=0)
                key = f"k{n % KEYS}"
                event_id = client.send(QUEUE, "Order", {"n": n}, partition_key=key)
                self.confirmed.append((event_id, key))
                n += 1
                self.stop.wait(0.005)
            except (psycopg.Error, pgque.PgqueError):
                self.failed += 1
                if client is not None:
                    client.close()
                    client = None
                self.stop.wait(0.05)
        if client is not None:
            client.close()


@pytest.mark.parametrize("after", [1.0, long_variant(15.0, id="15s-long")])
def test_a_group_rides_through_a_primary_failover(
        pair: ReplicaPair, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str], after: float) -> None:
    # The recommended deployment on the primary; nothing to drop afterwards:
    # the pair goes with its servers (and the primary is dead by then).
    server = ExternalServer(pair.primary.dsn())
    template = Deployment.create(server)
    d = replace(template, dbname="app")
    with server.admin() as conn:
        conn.execute(f'create database app owner "{d.owner}" template "{template.dbname}"')
    team = d.teams[0]
    with psycopg.connect(d.dsn(d.owner), autocommit=True) as owner:
        pgque.Client(owner).create_queue(QUEUE, ticker_max_lag=0)
        owner.execute("create table effects (id bigserial primary key, ev_id bigint not "
                      "null, key text not null, at timestamptz not null default "
                      "clock_timestamp())")
        owner.execute(f'grant insert, select on effects to "{team}"')
        owner.execute(f'grant usage on sequence effects_id_seq to "{team}"')
    worker_dsn = multi_host(pair, d.dsn(d.login(team)))
    with pgque.connect(worker_dsn) as client:
        client.conn.execute(f'set role "{team}"')
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)

    def handle(message: pgque.Message[Any], conn: psycopg.Connection[Any]) -> None:
        conn.execute(f'set local role "{team}"')
        conn.execute("insert into effects (ev_id, key) values (%s, %s)",
                     (message.id, message.partition_key))

    producer = Producer(multi_host(pair, d.dsn(d.producer)))
    options: dict[str, Any] = {
        "queue": QUEUE, "consumer": GROUP, "slots": SLOTS, "handler": handle,
        "transactional": True, "ticker": False, "poll_interval": 0.05,
        "rebalance_interval": 0.2, "network_timeout": 6}
    with pgque.Ticker(multi_host(pair, d.dsn(d.ticker))) as ticker, \
            pgque.Worker(worker_dsn, name="w1", **options) as w1, \
            pgque.Worker(worker_dsn, name="w2", **options) as w2:
        assert ticker.wait_active(30)
        producer.start()
        w1.wait(lambda: w1.handled + w2.handled >= 100, timeout=30)
        with psycopg.connect(pair.primary.dsn(d.dbname), autocommit=True) as conn:
            before = conn.execute("select max(sc_epoch) from pgque.slot_claim").fetchone()
        killed_at = datetime.now(timezone.utc)
        killed = time.monotonic()
        pair.fail_over()
        promoted = time.monotonic() - killed
        promoted_at = datetime.now(timezone.utc)
        # Handling again on the new primary: a handler call committed after
        # the promotion (a commit racing the kill may be in before it).
        assert pair.standby is not None
        new_primary = pair.standby.dsn(d.dbname)

        def resumed() -> datetime | None:
            with psycopg.connect(new_primary, autocommit=True) as conn:
                row = conn.execute("select min(at) from effects where at > %s",
                                   (promoted_at,)).fetchone()
            return row[0] if row else None
        resumed_at = wait_for(resumed, timeout=60, what="handling on the new primary")
        time.sleep(after)  # traffic after the failover, not a synchronisation
        producer.stop.set()
        producer.join(30)
        confirmed = dict(producer.confirmed)

        def drained() -> bool | None:
            # Every event the new primary has is handled: none pending, none
            # in an open batch or waiting to be retried, and none confirmed
            # and unhandled unless it never reached the new primary (async).
            with psycopg.connect(new_primary, autocommit=True) as conn:
                slots = conn.execute(
                    "select coalesce(sum(pending_events), 1), count(open_batch_id), "
                    "sum(retries_waiting) from pgque.partition_slot_status "
                    "where queue_name = %s", (QUEUE,)).fetchone()
                handled = {r[0] for r in conn.execute("select ev_id from effects")}
            assert slots is not None
            return (slots[0] == 0 and slots[1] == 0 and slots[2] == 0
                    and (not pair.sync or set(confirmed) <= handled)) or None
        wait_for(drained, timeout=60, what="every surviving event handled")
    with psycopg.connect(new_primary, autocommit=True) as conn:
        effects = conn.execute("select ev_id, key from effects order by id").fetchall()
        handled = [ev for ev, _key in effects]
        lost = sorted(e for e in confirmed if e not in set(handled))
    figures = {
        "scenario": f"failover-{'sync' if pair.sync else 'async'}",
        "server_major": pair.primary.major_version,
        "events_confirmed": len(confirmed),
        "events_handled": len(set(handled)),
        "lost": len(lost),
        "duplicates": len(handled) - len(set(handled)),
        "promote_s": round(promoted, 3),
        "resumed_s": round((resumed_at - killed_at).total_seconds(), 3),
        "producer_errors": producer.failed,
    }
    append_report(report_path(tmp_path_factory.getbasetemp()), figures)
    with capsys.disabled():
        print(f"\nFAILOVER {figures}", flush=True)
    # Exactly once and in order per key, whatever the replication.
    assert figures["duplicates"] == 0, figures
    by_key: dict[str, list[int]] = {}
    for ev, key in effects:
        by_key.setdefault(key, []).append(ev)
    for key, events in by_key.items():
        assert events == sorted(events), f"key {key} out of order"
    if pair.sync:
        assert lost == [], f"committed events lost under synchronous replication: {lost}"
    # The claims on the new primary took epochs above every one of before.
    with psycopg.connect(new_primary, autocommit=True) as conn:
        after = conn.execute("select min(sc_epoch) from pgque.slot_claim "
                             "where sc_time > %s", (killed_at,)).fetchone()
    assert before is not None and after is not None and after[0] > before[0]


@pytest.mark.parametrize("pair", ["async"], indirect=True)
def test_a_hot_standby_reads_refuses_writes_clearly_and_serves_once_promoted(
        pair: ReplicaPair, caplog: pytest.LogCaptureFixture) -> None:
    """The reading calls work on a hot standby; a write raises ServerReadOnly
    (25006); a Worker pointed at the standby alone keeps reconnecting (it is not
    an error that stops it) and handles events once the standby is promoted;
    the old primary, back as a primary, hands out only lower epochs."""
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        pgque.install(conn)
        primary = pgque.Client(conn)
        primary.create_queue(QUEUE, ticker_max_lag=0)
        primary.subscribe_slots(QUEUE, GROUP, slots=2)
        sent = primary.send_batch(QUEUE, [("Order", {"n": n}, f"k{n}") for n in range(10)])
        primary.tick(QUEUE)
        lsn = conn.execute("select pg_current_wal_lsn()").fetchone()
    assert pair.standby is not None and lsn is not None
    standby_dsn = pair.standby.dsn()
    with pgque.connect(standby_dsn) as standby:
        wait_for(lambda: standby.conn.execute(
            "select pg_last_wal_replay_lsn() >= %s::pg_lsn", lsn).fetchone()[0] or None,
            timeout=30, what="the standby to replay the sends")
        assert [q.queue_name for q in standby.queue_info()] == [QUEUE]
        assert [g.consumer_name for g in standby.group_info()] == [GROUP]
        assert sum(s.pending_events or 0 for s in standby.partition_slot_status()) == len(sent)
        assert len(standby.key_lag(QUEUE, GROUP)) == len(sent)
        for write in (lambda: standby.send(QUEUE, "Order", {}, partition_key="x"),
                      lambda: standby.tick(QUEUE),
                      lambda: standby.claim_slot(QUEUE, GROUP, 0)):
            with pytest.raises(pgque.ServerReadOnly):
                write()
    handled: list[int] = []
    with pgque.Worker(standby_dsn, queue=QUEUE, consumer=GROUP, slots=2,
                      handler=lambda m: handled.append(m.id), ticker=True,
                      poll_interval=0.05, connect_timeout=5) as worker:
        # It refuses the standby as it connects, and backs off as from a server
        # that is down (it reconnected ten times a second: the connection reset
        # the backoff).
        def delays() -> list[float]:
            return [float(m) for r in caplog.records if r.name == "pgque.worker"
                    for m in re.findall(r"standby.*reconnecting in ([0-9.]+)s",
                                        r.getMessage())]
        wait_for(lambda: len(delays()) >= 4 or None, timeout=30,
                 what="the worker to try the standby four times")
        assert delays()[3] > delays()[0], delays()
        assert worker.alive and worker.error is None and not handled
        pair.primary.stop("immediate")
        pair.standby.promote()
        worker.wait(lambda: sorted(handled) == sent, timeout=30)
    # The old primary started again as a primary (what a failover manager must
    # prevent: it would run a second copy of the queues): every epoch it hands
    # out is below every epoch of the new primary's, so a system that keeps the
    # highest epoch seen per slot refuses its owners' writes.
    pair.primary.start()
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as old, \
            psycopg.connect(standby_dsn, autocommit=True) as new:
        taken = new.execute("select min(sc_epoch) from pgque.slot_claim").fetchone()
        assert taken is not None and taken[0] is not None
        for _ in range(3):
            zombie_epoch = old.execute("select pgque._new_epoch()").fetchone()
            assert zombie_epoch is not None and zombie_epoch[0] < taken[0]
