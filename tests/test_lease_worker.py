"""The Worker and the Ticker with ``ownership="lease"``, behind a real PgBouncer
in transaction mode (with other clients' traffic, so consecutive transactions
of a worker land on different server sessions).

What must hold there as it does on direct connections: every event handled,
per key in order, one handler per key at a time, the slots shared by the
workers; exactly-once effects of transactional handlers; a killed worker's
slots taken over once its lease expires; a frozen worker fenced out; and a
group that owns by advisory lock refusing a worker by lease (and the reverse)
with OwnershipMismatch. The fault scenarios by lease: tests/test_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import long_variant, scalar, wait_for
from psycopg.conninfo import conninfo_to_dict
from test_pooler import Recorder, churn

import pgque

EVENTS = 300
KEYS = 41
SLOTS = 8
LEASE = 2.0


def dbname(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def make_group(client: pgque.Client) -> list[int]:
    client.create_queue("q", ticker_max_lag=0, ticker_max_count=200)
    client.subscribe_slots("q", "g", slots=SLOTS)
    return client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}") for i in range(EVENTS)])


def lease_worker(dsn: str, handler: Any, name: str, **options: Any) -> pgque.Worker[Any]:
    settings: dict[str, Any] = {"ticker": False, "poll_interval": 0.05,
                                "rebalance_interval": 0.2, "connect_timeout": 10,
                                "ownership": "lease", "lease": LEASE, "name": name}
    return pgque.Worker(dsn, queue="q", consumer="g", slots=SLOTS, handler=handler,
                        **{**settings, **options})


def in_key_order(handled: list[int], ids: list[int]) -> None:
    """The first handling of each key's events came in send order."""
    key = {event: n % KEYS for n, event in enumerate(ids)}
    firsts: dict[int, list[int]] = {}
    seen: set[int] = set()
    for event in handled:
        if event not in seen:
            seen.add(event)
            firsts.setdefault(key[event], []).append(event)
    for events in firsts.values():
        assert events == sorted(events), f"a key's events out of order: {events}"


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
def test_two_workers_by_lease_behind_a_transaction_pooler(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    ids = make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    recorder = Recorder()
    with churn(pooled, clients=2), \
            pgque.Ticker(pooled, ownership="lease", lease=LEASE) as ticker, \
            lease_worker(pooled, recorder, "lease-a") as a, \
            lease_worker(pooled, recorder, "lease-b") as b:
        assert ticker.wait_active(10)
        a.wait(lambda: set(recorder.handled) >= set(ids), timeout=60)
        # Both own their fair share, as the server sees it.
        a.wait(lambda: len(a.owned_slots) == len(b.owned_slots) == SLOTS // 2, timeout=30)
        status = client.group_status("q", "g")
        assert status.members == 2 and all(s.owner_pid is not None for s in status.slots)
        more = client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}")
                                       for i in range(EVENTS, 2 * EVENTS)])
        a.wait(lambda: set(recorder.handled) >= set(more), timeout=60)
    assert not recorder.overlaps, f"one key handled by two owners at once: {recorder.overlaps}"
    in_key_order(recorder.handled, ids + more)
    # Stopped: their leases ended, and with them every claim.
    assert scalar(client.conn, "select count(*) from pgque.lease") == 0
    assert client.group_status("q", "g").members == 0


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
def test_transactional_effects_exactly_once_by_lease(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    ids = make_group(client)
    client.conn.execute("create table effects (ev_id bigint not null)")
    client.conn.execute("grant all on effects to public")
    pooled = pgbouncer.dsn(dbname(dsn))
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    def handle(message: pgque.Message[Any], conn: psycopg.Connection[Any]) -> None:
        conn.execute("insert into effects values (%s)", (message.id,))
        with lock:
            calls[message.id] += 1
        if calls[message.id] == 1 and message.id % 7 == 0:
            raise RuntimeError("fails once")  # its effect rolls back with its savepoint

    with churn(pooled, clients=2), pgque.Ticker(dsn), \
            lease_worker(pooled, handle, "tx", transactional=True, retry_after=0) as worker:
        worker.wait(lambda: scalar(client.conn, "select count(distinct ev_id) from effects")
                    == len(ids), timeout=60)
    counts = dict(client.conn.execute("select ev_id, count(*) from effects group by 1"))
    assert counts == dict.fromkeys(ids, 1)


def spawn_lease_worker(pooled: str, name: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    """A worker by lease in a process of its own, recording each handler call
    (start and end on the database's clock) in the table handled."""
    script = Path(__file__).with_name("lease_worker_process.py")
    log = (tmp_path / f"{name}.log").open("wb")
    return subprocess.Popen([sys.executable, str(script), pooled, name, str(SLOTS), str(LEASE),
                             "20"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.mark.parametrize("worker_flavour", ["sync", long_variant("async", id="async-long")],
                         indirect=True)
def test_a_killed_workers_slots_move_within_the_lease_and_a_frozen_one_is_fenced_out(
        client: pgque.Client, dsn: str, pgbouncer: Any, tmp_path: Path) -> None:
    """Two worker processes by lease; one is killed (SIGKILL): its slots move
    to the other once its lease expires, within the lease time plus a
    rebalance. Then the survivor freezes (SIGSTOP) while a new one runs: once
    its lease expired its slots move, and after SIGCONT it starts no handler of
    the slots it lost and commits nothing of them."""
    make_group(client)
    client.conn.execute("create table handled (ev_id bigint, pid integer, worker text, "
                        "started timestamptz default clock_timestamp(), ended timestamptz)")
    client.conn.execute("grant all on handled to public")
    pooled = pgbouncer.dsn(dbname(dsn))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with churn(pooled), pgque.Ticker(dsn):
            procs = [spawn_lease_worker(pooled, name, tmp_path) for name in ("pa", "pb")]
            wait_for(lambda: shares(client) == {"pa": SLOTS // 2, "pb": SLOTS // 2} or None,
                     timeout=30, what="both workers to own half the slots", dsn=dsn)
            # SIGKILL: nothing released; the lease must expire first.
            procs[0].kill()
            procs[0].wait()
            killed_at = time.monotonic()
            wait_for(lambda: shares(client) == {"pb": SLOTS} or None, timeout=30,
                     what="the survivor to own every slot", dsn=dsn)
            moved = time.monotonic() - killed_at
            assert moved < LEASE + 4, f"the killed worker's slots moved after {moved:.1f}s"
            # SIGSTOP: the frozen worker's slots move once its lease expires.
            procs.append(spawn_lease_worker(pooled, "pc", tmp_path))
            wait_for(lambda: shares(client) == {"pb": SLOTS // 2, "pc": SLOTS // 2} or None,
                     timeout=30, what="the newcomer's share", dsn=dsn)
            # Frozen in the middle of its pieces (20 ms an event, 50 events a slot).
            busy = client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}") for i in range(400)])
            wait_for(lambda: scalar(client.conn, "select count(*) from handled where worker = "
                                                 "'pb' and ev_id >= %s", (busy[0],)) >= 8
                     or None, timeout=30, what="the worker to be busy", dsn=dsn)
            procs[1].send_signal(signal.SIGSTOP)
            frozen = scalar(client.conn, "select clock_timestamp()")
            wait_for(lambda: shares(client) == {"pc": SLOTS} or None, timeout=30,
                     what="the frozen worker's slots to move", dsn=dsn)
            wait_for(lambda: scalar(client.conn, "select count(distinct ev_id) from handled "
                                                 "where ev_id >= %s", (busy[0],)) == len(busy)
                     or None, timeout=60, what="every event handled meanwhile", dsn=dsn)
            thawed = scalar(client.conn, "select clock_timestamp()")
            procs[1].send_signal(signal.SIGCONT)
            wait_for(lambda: "pb" in shares(client) or None, timeout=30,
                     what="the thawed worker to own slots again", dsn=dsn)
            wait_for(lambda: scalar(client.conn, "select count(*) from handled h "
                                                 "where h.ended is null and worker <> 'pa'")
                     == 0 or None, timeout=30, what="every handler call to end", dsn=dsn)
            # Nothing lost to the kill or the freeze.
            wait_for(lambda: scalar(client.conn, "select count(distinct ev_id) from handled")
                     == EVENTS + len(busy) or None, timeout=30, what="every event handled",
                     dsn=dsn)
        # After the thaw the frozen worker started no handler of an event the
        # new owner handled during the freeze (a zombie call): its lanes saw
        # their leases lapse before their next event.
        zombies = scalar(client.conn, """
            select count(*) from handled z join handled o on o.ev_id = z.ev_id
             where z.worker = 'pb' and o.worker = 'pc' and z.started > %s
               and o.started between %s and %s""", (thawed, frozen, thawed))
        assert zombies == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def shares(client: pgque.Client) -> dict[str, int]:
    """How many slots each worker (by its lanes' lease names) owns now."""
    rows = client.conn.execute("""
        select split_part(l.lease_name, '-lane', 1), count(*)
          from pgque.slot_claim c join pgque.lease l on l.lease_id = c.sc_lease
         where l.lease_until > clock_timestamp()
         group by 1""").fetchall()
    return dict(rows)


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
def test_the_modes_do_not_mix_in_a_group(client: pgque.Client, dsn: str,
                                         pgbouncer: Any) -> None:
    make_group(client)
    pooled = pgbouncer.dsn(dbname(dsn))
    recorder = Recorder()
    with pgque.Worker(dsn, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                      ticker=False, name="advisory") as advisory:
        advisory.wait(lambda: len(advisory.owned_slots) == SLOTS, timeout=30)
        leased = lease_worker(pooled, recorder, "by-lease")
        leased.start()
        assert leased.wait_stopped(30)
        assert isinstance(leased.error, pgque.OwnershipMismatch), leased.error
        assert "in use" in str(leased.error)
    with lease_worker(pooled, recorder, "by-lease") as leased:
        leased.wait(lambda: len(leased.owned_slots) == SLOTS, timeout=30)
        advisory = pgque.Worker(dsn, queue="q", consumer="g", slots=SLOTS, handler=recorder,
                                ticker=False, name="advisory")
        advisory.start()
        assert advisory.wait_stopped(30)
        assert isinstance(advisory.error, pgque.OwnershipMismatch), advisory.error


def test_listen_needs_advisory_ownership() -> None:
    with pytest.raises(ValueError, match="listen=True needs ownership='advisory'"):
        pgque.Worker("dbname=x", queue="q", consumer="g", slots=2, handler=print,
                     ownership="lease", listen=True)
    with pytest.raises(ValueError, match="ownership must be"):
        pgque.Worker("dbname=x", queue="q", consumer="g", slots=2, handler=print,
                     ownership="leases")
    with pytest.raises(ValueError, match="lease must be"):
        pgque.Ticker("dbname=x", ownership="lease", lease=0.5)


@pytest.mark.both_workers  # with the Worker and the AsyncWorker (conftest.py)
def test_a_cut_connection_does_not_keep_the_slots_for_the_lease_time(
        client: pgque.Client, dsn: str, pgbouncer: Any) -> None:
    """The worker's connections to the pooler are cut (a pooler restart, a
    network blip): its lanes end, and so would their leases, only after the
    lease time (30 s here). The worker ends them itself over its new
    connection, and the old member lease of its control too (which would halve
    its fair share): it owns every slot again long before the lease expired."""
    from faults import TcpProxy

    ids = make_group(client)
    proxy = TcpProxy("127.0.0.1", int(conninfo_to_dict(pgbouncer.dsn("x"))["port"]))
    try:
        recorder = Recorder()
        with pgque.Ticker(dsn), lease_worker(proxy.dsn(pgbouncer.dsn(dbname(dsn))), recorder,
                                              "cut", lease=30) as worker:
            worker.wait(lambda: len(worker.owned_slots) == SLOTS, timeout=30)
            worker.wait(lambda: set(recorder.handled) >= set(ids), timeout=60)
            leases = {s.owner_pid for s in client.group_status("q", "g").slots}
            assert proxy.cut() > 0
            deadline = scalar(client.conn, "select clock_timestamp() + interval '15 seconds'")

            def owns_all_anew() -> bool | None:
                status = client.group_status("q", "g")
                owners = {s.owner_pid for s in status.slots}
                return (status.members == 1 and None not in owners
                        and not owners & leases) or None
            wait_for(owns_all_anew, timeout=20, what="every slot owned on new leases", dsn=dsn)
            assert scalar(client.conn, "select clock_timestamp()") < deadline
            more = client.send_batch("q", [("e", {"n": i}, f"k{i % KEYS}") for i in range(50)])
            worker.wait(lambda: set(recorder.handled) >= set(more), timeout=30)
        assert not recorder.overlaps
    finally:
        proxy.stop()
