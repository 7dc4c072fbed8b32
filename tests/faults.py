"""Harness of the fault suite (tests/test_faults.py): real Worker processes and
producers against the test server, one fault injected per scenario, then checks
and a report.

Pieces
------
* :class:`FaultRun` sets a scenario up (queue, consumer group, bookkeeping
  tables), starts worker processes (tests/fault_worker.py, named ``fw-<i>``;
  they log in as a team's role with ``pgque_reader``, their Tickers as the
  admin, as docs/operations.md recommends),
  producers (threads) and a :class:`Monitor`, injects faults, drains, stops
  everything and checks (:meth:`FaultRun.conclude`).
* Producers write each event with a row in ``fault_sent`` in the SAME
  transaction, so ``fault_sent`` is exactly what committed, even when a commit's
  outcome is unknown to the producer (a server restart). What they roll back
  (or what fails before commit) they keep in memory.
* Workers record every handler call in ``fault_handled`` (see fault_worker.py),
  on the database clock.
* The :class:`Monitor` samples, every 50 ms, which backend of which worker
  holds which slot's advisory lock and the ticker's, so the checks know what a
  victim owned when it was hit and when it owned slots again.
* :class:`TcpProxy` sits between one worker and the server and can cut its
  connections or blackhole them; :class:`NetnsNetwork` puts one worker in a
  network namespace (tests/netns.py) whose veth link to the server nftables
  can blackhole for real.
* Workers also copy their own log lines (connected, session gone, giving up,
  reconnecting) into ``fault_log``, so the harness knows when the victim's
  client side noticed a fault.

Faults are recorded as :class:`Fault` with times on the database clock.

Checks (every scenario)
-----------------------
* no committed event lost: each is handled successfully at least once, or,
  when its payload makes it always fail, dead-lettered;
* nothing delivered that did not commit (rolled back, aborted, or unknown);
* per (producer, key), first handlings (retry_count 0) in send order;
* each always-failing event has exactly one dead letter, with
  ev_retry == max_retries; no other event is dead-lettered;
* under the pause policy (``Workload.failure_policy``), after a failed call of
  an event no later event of its (producer, key) starts before it succeeded or
  was dead-lettered;
* zombie bound (faults that end the victim's sessions on the server side:
  pg_terminate_backend, a proxy cut or close, idle_session_timeout of a frozen
  worker, a server restart, a netns partition): the victim starts at most as
  many handler calls after its sessions ended (and before it owned a slot
  again) as it owned slots;
* a netns partition (:meth:`FaultRun.partition`): the server ends the victim's
  slot session during the blackhole, the victim's client side notices before
  the server does, and after the heal the victim reconnects, owns a slot and
  handles events again (the test adds bounds on the times);
* latency bound (a frozen worker holding the ticker election): events of
  the healthy workers' slots sent during the freeze are first handled within
  ``latency_bound`` seconds of being sent;
* every worker still alive exits 0 on SIGTERM.

Reported (not asserted): duplicate handlings (calls beyond one per event and
retry count), overlapping handler calls of one key (pairs of calls whose
intervals intersect, and how many calls were still running when another call
of their key started: one frozen call overlapping many is one), and per fault
the time until each slot the victim owned was handled by another process
("moved") or by anyone ("resumed"), the victim's zombie starts, and the worst
first-handling latency of the other slots' events sent during the fault.

Networks
--------
A blackhole through the proxy is not real packet loss: the proxy's kernel
still ACKs, so no TCP timeout fires. :class:`NetnsNetwork` (kind ``netns``
of ``network_factories()``) is: the worker runs inside a network namespace of
tests/netns.py and reaches the server (a ``netns.LinkServer``) over a veth
link whose frames nftables drops at both ends.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgque

WORKER_SCRIPT = str(Path(__file__).with_name("fault_worker.py"))
CONSUMER = "g"
DOOMED_KEY = "doomed"  # its events always fail
ALWAYS_FAILS = 99  # a payload "fail" above any max_retries
WORKER_NAME = re.compile(r"^(fw-\d+)(?:-|$)")

SCHEMA = """
create table fault_sent (
    ev_id    bigint primary key,
    producer int not null,
    key      text,
    seq      int not null,
    fail     int not null,
    sent_at  timestamptz not null default clock_timestamp()
);
create table fault_handled (
    id      bigserial primary key,
    token   text unique not null,
    ev_id   bigint not null,
    key     text,
    producer int,
    seq     int,
    retry   int,
    pid     int,
    worker  text,
    started timestamptz not null,
    ended   timestamptz,
    outcome text
);
-- What transactional handlers change, in the transaction that acks (see
-- fault_worker.py): one row per applied event, and a running total per key.
create table fault_effects (
    id     bigserial primary key,
    ev_id  bigint not null,
    key    text,
    amount int not null,
    worker text
);
create table fault_balance (
    key   text primary key,
    total bigint not null
);
create table fault_log (
    id      bigserial primary key,
    worker  text not null,
    pid     int not null,
    at      timestamptz not null,
    logger  text,
    level   text,
    message text
);
"""


# -- settings ---------------------------------------------------------------------


@dataclass
class Workload:
    """Sizes and rates of a scenario; the defaults keep one under ~15 s."""

    slots: int = 6
    workers: int = 3
    producers: int = 3
    rate: float = 25.0  # events per second per producer
    keys: int = 12  # spread evenly over the slots (every slot gets keys)
    several_share: float = 0.15  # transactions carrying 2-4 events
    fail_once: float = 0.04  # events whose first call fails
    fail_twice: float = 0.02  # events whose first two calls fail
    doomed_every: int = 25  # every n-th event of a producer goes to the always-failing key
    max_retries: int = 2
    retry_after: float = 0.05
    max_events: int = 20
    delay_ms: tuple[float, float] = (1.0, 8.0)  # handler duration
    # A victim's handlers are slower, so its slots lag a little and a fault
    # finds it mid-handler with more of the batch still to go.
    victim_delay_ms: tuple[float, float] = (20.0, 80.0)
    burst: int = 40  # events sent to a victim's slots right before a mid-batch fault
    poll_interval: float = 0.05
    rebalance_interval: float = 0.2
    warmup: float = 0.8  # seconds of traffic before the fault
    cooldown: float = 1.0  # seconds of traffic after it
    drain_timeout: float = 90.0
    latency_bound: float = 5.0
    seed: int = 1
    # Transactional handlers (Worker(transactional=True)): each call also writes
    # its effect (fault_effects, fault_balance) in the transaction that acks.
    transactional: bool = False
    # The group's failure policy. Under "pause" a failed event blocks its key
    # until it succeeds or is dead-lettered, after max_retries + 1 attempts (so
    # its dead letter has ev_retry == max_retries too).
    failure_policy: str = "skip"
    # How the group's slots are owned: "advisory" (session locks, the workers
    # straight to the server) or "lease" (the workers behind a PgBouncer in
    # transaction mode, Worker(ownership="lease", lease=lease); their Tickers
    # stay on the admin's direct connection, by lock).
    ownership: str = "advisory"
    lease: float = 2.0


def effect_amount(producer: int, seq: int) -> int:
    """The amount an event adds to its key's balance; fault_worker.py uses the same."""
    return (producer * 7 + seq) % 13 + 1


# -- database access ------------------------------------------------------------


class Db:
    """An autocommit connection that reconnects (for up to ``patience`` seconds)
    whenever the server went away, so the harness survives restarts."""

    def __init__(self, dsn: str, name: str, patience: float = 60.0) -> None:
        self.dsn = dsn
        self.name = name
        self.patience = patience
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5,
                                         application_name=self.name)
        return self._conn

    def rows(self, query: str, params: Any = ()) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + self.patience
        while True:
            try:
                cur = self._connection().execute(query, params)
                return cur.fetchall() if cur.description is not None else []
            except psycopg.OperationalError:
                self.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def value(self, query: str, params: Any = ()) -> Any:
        return self.rows(query, params)[0][0]

    def now(self) -> datetime:
        """The database clock."""
        now: datetime = self.value("select clock_timestamp()")
        return now

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


# -- monitor ------------------------------------------------------------------------


@dataclass
class Session:
    pid: int
    app: str
    worker: str | None  # fw-<i> when the session is a worker's
    backend_start: datetime
    slots: set[int] = field(default_factory=set)
    ticker: bool = False


@dataclass
class Sample:
    at: datetime
    sessions: dict[int, Session]

    def of(self, worker: str) -> list[Session]:
        return [s for s in self.sessions.values() if s.worker == worker]

    def slots_of(self, worker: str) -> set[int]:
        return {slot for s in self.of(worker) for slot in s.slots}

    def owners(self) -> dict[int, str | None]:
        return {slot: s.worker for s in self.sessions.values() for slot in s.slots}

    def ticker_holder(self) -> str | None:
        return next((s.worker for s in self.sessions.values() if s.ticker), None)


class Monitor:
    """Samples the database's sessions and their slot and ticker locks every
    ``interval`` seconds in a thread; survives server restarts."""

    QUERY = """
        select clock_timestamp(), a.pid, coalesce(a.application_name, ''), a.backend_start,
               l.classid::bigint, l.objid::bigint
          from pg_stat_activity a
          left join pg_locks l on l.pid = a.pid and l.locktype = 'advisory' and l.granted
                               and l.mode = 'ExclusiveLock' and l.objsubid = 1
         where a.datname = current_database() and a.backend_type = 'client backend'
    """

    # By lease, each live lease is a session of its own: pid minus its id,
    # application name its name, backend start its creation; its slots are the
    # claims that name it. The worker's real sessions (the pooler's, shared by
    # anyone) count for nothing but the election, which stays on a direct one.
    LEASE_QUERY = """
        select clock_timestamp(), -l.lease_id, l.lease_name, l.lease_created, c.sc_sub,
               c.sc_time
          from pgque.lease l
          left join pgque.slot_claim c on c.sc_lease = l.lease_id
         where l.lease_until > clock_timestamp()
    """

    def __init__(self, dsn: str, lock_slots: dict[tuple[int, int], int], ticker_key: int,
                 interval: float = 0.05, sub_slots: dict[int, int] | None = None,
                 pooled_role: str | None = None) -> None:
        self.lock_slots = lock_slots  # (classid, objid) -> slot
        self.ticker_key = ticker_key  # the election key, as pg_locks shows it (unsigned)
        self.sub_slots = sub_slots  # by lease: subscription id -> slot
        self.pooled_role = pooled_role  # by lease: the role of the pooler's sessions
        self.interval = interval
        self.samples: list[Sample] = []
        self._db = Db(dsn, "fault-monitor")
        self._probe_db = Db(dsn, "fault-monitor-probe")
        self._probe_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fault-monitor", daemon=True)
        self._thread.start()

    def _sample(self, db: Db) -> Sample:
        rows = db.rows(self.QUERY)
        sessions: dict[int, Session] = {}
        at = rows[0][0] if rows else db.now()
        pooled: set[int] = set()
        if self.sub_slots is not None:
            pooled = {pid for (pid,) in db.rows("select pid from pg_stat_activity "
                                                "where usename = %s", (self.pooled_role,))}
            for _, lease, name, created, sub, claimed in db.rows(self.LEASE_QUERY):
                match = WORKER_NAME.match(name)
                session = sessions.setdefault(lease, Session(
                    lease, name, match.group(1) if match else None, created))
                if sub in self.sub_slots:
                    session.slots.add(self.sub_slots[sub])
                    # A lease's "start", for owned_again: its latest claim (a
                    # worker may claim a slot again on a lane it had already).
                    session.backend_start = max(session.backend_start, claimed)
        for _, pid, app, backend_start, classid, objid in rows:
            session = sessions.get(pid)
            if session is None:
                match = WORKER_NAME.match(app)
                worker = match.group(1) if match and (
                    self.sub_slots is None or pid not in pooled) else None
                session = sessions[pid] = Session(pid, app, worker, backend_start)
            if classid is None:
                continue
            slot = self.lock_slots.get((classid, objid))
            if slot is not None:
                session.slots.add(slot)
            elif (classid << 32) | objid == self.ticker_key:
                session.ticker = True
        return Sample(at, sessions)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.samples.append(self._sample(self._db))
            except Exception:  # the server is down: keep trying
                self._db.close()
            self._stopping.wait(self.interval)

    def now(self) -> Sample:
        """A fresh sample, taken in the caller's thread."""
        with self._probe_lock:
            sample = self._sample(self._probe_db)
        self.samples.append(sample)
        return sample

    def owned_again(self, worker: str, old_pids: set[int], after: datetime) -> datetime | None:
        """When the worker owned a slot again after ``after`` on a new session: the
        earliest backend_start of its new sessions seen holding a slot lock (a lower
        bound of the claim, so the zombie count never counts a legitimate call).
        By lease: the earliest claim after ``after`` by a lease of the worker's
        other than ``old_pids`` (those that held its slots then)."""
        starts = [s.backend_start for sample in list(self.samples) if sample.at > after
                  for s in sample.of(worker) if s.slots and s.pid not in old_pids
                  and (self.sub_slots is None or s.backend_start > after)]
        return min(starts, default=None)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)
        self._db.close()
        self._probe_db.close()


# -- network --------------------------------------------------------------------


class Network(Protocol):
    """A network path between one worker and the server that faults can be put on.

    :class:`TcpProxy` is one, :class:`NetnsNetwork` (real packet loss) the
    other. ``dsn`` turns the server's DSN into the one the worker must use.
    """

    def dsn(self, dsn: str) -> str: ...
    def cut(self) -> int: ...
    def blackhole(self) -> None: ...
    def heal(self) -> None: ...
    def stop(self) -> None: ...


def network_factories() -> dict[str, Callable[[FaultRun, Any], Network]]:
    """The networks a blackhole runs on, by kind: ``make(run, server)`` gives
    the run a :class:`Network` to the ``server`` it runs on.

    * ``proxy``: a :class:`TcpProxy` on 127.0.0.1 in front of any server. Its
      blackhole is not packet loss: the proxy's kernel still ACKs both sides.
    * ``netns``: :class:`NetnsNetwork`, real packet loss. The server must be a
      ``netns.LinkServer`` (the ``netns_server`` fixture): the worker runs in
      its network namespace and connects over the veth data link, which
      nftables blackholes at both ends. Its records still reach the server
      (the namespace's 127.0.0.1 goes over a control link that is never cut).
    """
    return {"proxy": lambda run, server: run.network(TcpProxy),
            "netns": lambda run, server: run.add_network(NetnsNetwork(server.link))}


class NetnsNetwork:
    """:class:`Network` over a ``netns.NetnsLink`` (tests/netns.py): real packet
    loss between the worker, which :meth:`popen` starts inside the namespace,
    and the server. ``blackhole()`` drops every frame of the data link at both
    ends (nftables netdev ingress: no ACK, no RST, no ICMP); ``heal()`` lets
    them through again; ``cut()`` aborts the link's connections (``ss -K``).
    ``arm_answer_trip(ports)``/``tripped()`` cut the server-to-worker
    direction the moment the server sends data to one of those client ports.
    """

    def __init__(self, link: Any) -> None:
        self.link = link

    def dsn(self, dsn: str) -> str:
        return str(self.link.dsn(dsn))

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = self.link.popen(argv, **kwargs)
        return proc

    def cut(self) -> int:
        return int(self.link.cut())

    def blackhole(self) -> None:
        self.link.blackhole()

    def heal(self) -> None:
        self.link.heal()

    def arm_answer_trip(self, ports: list[int]) -> None:
        self.link.arm_answer_trip(ports)

    def tripped(self) -> bool:
        return bool(self.link.tripped())

    def stop(self) -> None:
        self.link.heal()  # the run kills its workers itself; the namespace stays


class _Link:
    """One proxied connection: the client's socket and the server's."""

    def __init__(self, proxy: TcpProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        # A connection made during a blackhole gets no further than the kernel.
        if not self.proxy.wait_flowing(self):
            return
        try:
            upstream = socket.create_connection(self.proxy.target, timeout=5)
        except OSError:
            self.close()
            return
        upstream.settimeout(None)
        for sock in (upstream, self.client):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self.closed.is_set():
                upstream.close()
                return
            self.upstream = upstream
        threading.Thread(target=self._pump, args=(upstream, self.client), daemon=True,
                         name="proxy-down").start()
        self._pump(self.client, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while self.proxy.wait_flowing(self):
                data = src.recv(65536)
                # Held, not forwarded, while blackholed: also an end of stream.
                if not self.proxy.wait_flowing(self) or not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv
            sock.close()


class TcpProxy:
    """A TCP proxy on 127.0.0.1 in front of the server, for one worker.

    ``cut()`` closes both sockets of every current connection (new ones still
    go through); ``blackhole()`` stops forwarding in both directions, keeping
    the sockets open (connections made meanwhile are accepted and held);
    ``heal()`` forwards again, what was held first.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port: int = self._server.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    def dsn(self, dsn: str) -> str:
        return make_conninfo(dsn, host="127.0.0.1", port=str(self.port))

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            link = _Link(self, client)
            with self._lock:
                self._links = [li for li in self._links if not li.closed.is_set()]
                self._links.append(link)
                self.accepted += 1
            threading.Thread(target=link.run, name="proxy-up", daemon=True).start()

    def wait_flowing(self, link: _Link) -> bool:
        """Block while blackholed; False once the link is closed."""
        while not self._flowing.wait(0.05):
            if link.closed.is_set() or self._stopping.is_set():
                return False
        return not link.closed.is_set()

    def cut(self) -> int:
        with self._lock:
            links, self._links = self._links, []
        live = [li for li in links if not li.closed.is_set()]
        for link in live:
            link.close()
        return len(live)

    def blackhole(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def stop(self) -> None:
        self._stopping.set()
        self._server.close()
        self.cut()
        self.heal()
        self._thread.join(2)


# -- workers ----------------------------------------------------------------------


@dataclass
class FaultWorker:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    killed_at: datetime | None = None
    stopped: bool = False  # SIGSTOPped and not yet continued

    @property
    def pid(self) -> int:
        return self.proc.pid


# -- producers --------------------------------------------------------------------


class Producer(threading.Thread):
    """Sends events until stopped, each transaction recording its events in
    fault_sent. With ``hold``, keeps every transaction open for that many
    seconds (a (low, high) range) and rolls back every other one."""

    def __init__(self, run: FaultRun, index: int, *, rate: float,
                 hold: tuple[float, float] | None = None) -> None:
        super().__init__(name=f"producer-{index}", daemon=True)
        self.run_ = run
        self.index = index
        self.rate = rate
        self.hold = hold
        self.rng = random.Random(run.workload.seed * 1000 + index)
        self.seq = 0
        self.transactions = 0
        # Sends as (event id, producer, seq): after a crash the server may give an
        # uncommitted send's ids again (a sequence's advance is WAL-logged but not
        # flushed until some commit), so only (producer, seq) names a send for sure.
        self.rolled_back: list[tuple[int, int, int]] = []  # certainly not committed
        self.unknown: list[tuple[int, int, int]] = []  # the commit's outcome was lost
        self.connection_errors = 0
        self.errors: list[str] = []  # anything but a lost connection

    def _events(self) -> list[tuple[str, dict[str, Any], str]]:
        w = self.run_.workload
        count = self.rng.randint(2, 4) if self.rng.random() < w.several_share else 1
        events = []
        for _ in range(count):
            self.seq += 1
            if self.seq % w.doomed_every == 0:
                key, fail = DOOMED_KEY, ALWAYS_FAILS
            else:
                key = self.rng.choice(self.run_.keys)
                roll = self.rng.random()
                fail = 1 if roll < w.fail_once else 2 if roll < w.fail_once + w.fail_twice else 0
            events.append(("e", {"p": self.index, "s": self.seq, "k": key, "fail": fail}, key))
        return events

    def run(self) -> None:
        stop = self.run_.stop_producing
        conn: psycopg.Connection[Any] | None = None
        next_at = time.monotonic()
        while not stop.is_set():
            sends: list[tuple[int, int, int]] = []
            committing = False
            try:
                if conn is None:
                    conn = psycopg.connect(self.run_.dsn, connect_timeout=5,
                                           application_name=f"producer-{self.index}")
                    # An immediate server stop must not lose what was acknowledged.
                    conn.execute("set synchronous_commit = on")
                    conn.commit()
                events = self._events()
                client = pgque.Client(conn)
                ids = client.send_batch(self.run_.queue, events, conn=conn)
                sends = [(i, self.index, e[1]["s"]) for i, e in zip(ids, events, strict=True)]
                conn.execute(
                    "insert into fault_sent (ev_id, producer, key, seq, fail) select * from "
                    "unnest(%s::bigint[], %s::int[], %s::text[], %s::int[], %s::int[])",
                    (ids, [self.index] * len(ids), [e[2] for e in events],
                     [e[1]["s"] for e in events], [e[1]["fail"] for e in events]))
                self.transactions += 1
                if self.hold is not None:
                    stop.wait(self.rng.uniform(*self.hold))  # the fault: a long transaction
                    if self.transactions % 2 == 0:
                        conn.rollback()
                        self.rolled_back.extend(sends)
                        continue
                committing = True
                conn.commit()
            except (psycopg.OperationalError, pgque.ConnectError):
                self.connection_errors += 1
                (self.unknown if committing else self.rolled_back).extend(sends)
                if conn is not None:
                    conn.close()
                conn = None
                stop.wait(0.1)
                continue
            except Exception as exc:
                self.errors.append(repr(exc))
                (self.unknown if committing else self.rolled_back).extend(sends)
                if conn is not None:
                    conn.close()
                conn = None
                stop.wait(0.1)
                continue
            next_at = max(next_at + len(sends) / self.rate, time.monotonic() - 1.0)
            stop.wait(max(0.0, next_at - time.monotonic()))  # pacing, not synchronisation
        if conn is not None:
            conn.close()


# -- faults -----------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    victim: str  # worker name
    victim_pid: int
    at: datetime  # injection, database clock
    slots: set[int]  # what the victim owned then
    session_pids: set[int]  # the backends that held those slots
    all_pids: set[int]  # every backend of the victim then
    ticker: bool  # whether the victim held the ticker election
    session_end: datetime | None = None  # when the server had ended the victim's slot sessions
    until: datetime | None = None  # end of the fault (SIGCONT, heal, restart done)
    zombie_bound: bool = False
    latency_bound: bool = False
    notes: list[str] = field(default_factory=list)
    # Real packet loss (a netns partition): when the server had ended every
    # session of the victim, not only its slot sessions.
    all_sessions_end: datetime | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # extra figures for the report


# -- the run ----------------------------------------------------------------------


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    if a is None or b is None:
        return None
    return round((b - a).total_seconds(), 3)


class FaultRun:
    """One scenario: see the module docstring."""

    def __init__(self, scenario: str, dsn: str, workdir: Path, workload: Workload,
                 server_major: int) -> None:
        self.scenario = scenario
        self.dsn = dsn
        self.workdir = workdir
        self.workload = workload
        self.server_major = server_major
        self.queue = "faults"
        self.db = Db(dsn, "fault-harness")
        self.stop_producing = threading.Event()
        self.producers: list[Producer] = []
        self.workers: list[FaultWorker] = []
        self.faults: list[Fault] = []
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.networks: list[Network] = []
        self._names = itertools.count()
        self._bursts = itertools.count(100)  # producer indexes of bursts
        self._clock = time.monotonic()
        self.timings: dict[str, float] = {}  # seconds spent per phase
        self.db.rows(SCHEMA)
        # The workers log in as a team's role, as docs/operations.md recommends:
        # pgque_reader, the consumer group its own, the bookkeeping tables (their
        # transactional effects) granted; tickers and the harness are admins.
        self.team = f"fault_team_{secrets.token_hex(4)}"
        password = secrets.token_hex(12)
        self.db.rows(f"create role {self.team} login password '{password}' in role pgque_reader;"
                     f" grant select, insert, update, delete on all tables in schema public"
                     f" to {self.team};"
                     f" grant usage, select on all sequences in schema public to {self.team}")
        self.worker_dsn = make_conninfo(dsn, user=self.team, password=password)
        # By lease, the workers sit behind a PgBouncer in transaction mode that
        # logs them in as the team (their Tickers stay on the admin's DSN).
        self.pooler: Any = None
        if workload.ownership == "lease":
            from pgbouncer import PgBouncer  # tests/pgbouncer.py

            self.pooler = PgBouncer(dsn, pool_mode="transaction", pool_size=8,
                                    users={self.team: password})
            self.pooler.start()
            self.worker_dsn = self.pooler.dsn(str(conninfo_to_dict(dsn)["dbname"]),
                                              user=self.team)
            # As docs/operations.md advises for transactional handlers by lease: a
            # frozen worker's open transaction (which keeps its slot's rows
            # locked) ends within about the lease time, not when it thaws.
            self.db.rows(f"alter role {self.team} set idle_in_transaction_session_timeout "
                         f"= {int(workload.lease * 1000)}")
        with pgque.connect(dsn) as client:
            client.create_queue(self.queue, ticker_max_lag=0, ticker_max_count=100,
                                max_retries=workload.max_retries)
        with pgque.connect(self.worker_dsn) as team, pgque.connect(dsn) as client:
            team.subscribe_slots(self.queue, CONSUMER, slots=workload.slots)
            if workload.ownership == "lease":
                team.set_ownership(self.queue, CONSUMER, "lease", lease=workload.lease)
            if workload.failure_policy != "skip":
                team.set_failure_policy(self.queue, CONSUMER, workload.failure_policy,
                                        max_attempts=workload.max_retries + 1,
                                        pause_timeout=None)
            lock_slots = {}
            # By lease the slots have no lock key (the Monitor reads the claims).
            for slot in range(workload.slots if workload.ownership == "advisory" else 0):
                key = client.slot_lock_key(self.queue, CONSUMER, slot)
                lock_slots[((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)] = slot
        # The same number of keys in every slot, so every slot has traffic.
        per_slot = max(1, workload.keys // workload.slots)
        by_slot: dict[int, list[str]] = defaultdict(list)
        for key, slot in self.db.rows("select 'k' || n, pgque.slot_of('k' || n, %s) "
                                      "from generate_series(0, 999) n", (workload.slots,)):
            if len(by_slot[slot]) < per_slot:
                by_slot[slot].append(key)
        self.keys = sorted(k for keys in by_slot.values() for k in keys)
        self.key_slot = {k: slot for slot, keys in by_slot.items() for k in keys}
        ticker_key = self.db.rows("select te_key from pgque.ticker_election")[0][0]
        sub_slots = None
        if workload.ownership == "lease":
            sub_slots = dict(self.db.rows(
                "select s.sub_id, n from generate_series(0, %s - 1) n "
                "join pgque.subscription s on s.sub_consumer = pgque._slot_name(%s, n, %s)",
                (workload.slots, CONSUMER, workload.slots)))
        self.monitor = Monitor(dsn, lock_slots, ticker_key & 0xFFFFFFFFFFFFFFFF,
                               sub_slots=sub_slots, pooled_role=self.team)

    # -- workers ---------------------------------------------------------------

    def spawn(self, *, dsn: str | None = None, ticker_dsn: str | None = None,
              network_timeout: float | None = None, network: Network | None = None,
              victim: bool = False) -> FaultWorker:
        """Start a worker process ``fw-<i>``: its DSN defaults to the team's, its
        Ticker's to the admin's (the team may not tick), both through ``network``
        when given; a ``victim`` has slower handlers."""
        if network is not None and dsn is None:
            dsn = network.dsn(self.worker_dsn)
        if ticker_dsn is None:  # by lease, the Tickers stay on the admin's direct DSN
            ticker_dsn = (network.dsn(self.dsn) if network is not None and self.pooler is None
                          else self.dsn)
        w = self.workload
        index = next(self._names)
        name = f"fw-{index}"
        config = {
            "dsn": dsn or self.worker_dsn, "record_dsn": self.dsn, "queue": self.queue,
            "consumer": CONSUMER, "slots": w.slots, "name": name, "max_events": w.max_events,
            "poll_interval": w.poll_interval, "rebalance_interval": w.rebalance_interval,
            "retry_after": w.retry_after,
            "delay_ms": list(w.victim_delay_ms if victim else w.delay_ms),
            "seed": w.seed * 100 + index, "network_timeout": network_timeout,
            "ticker_dsn": ticker_dsn, "transactional": w.transactional,
            "failure_policy": w.failure_policy,
            **({"ownership": "lease", "lease": w.lease} if w.ownership == "lease" else {}),
        }
        log = self.workdir / f"{name}.log"
        argv = [sys.executable, WORKER_SCRIPT, json.dumps(config)]
        # A network that isolates its worker (netns) starts the process itself.
        popen = getattr(network, "popen", None) or subprocess.Popen
        with log.open("wb") as out:
            proc = popen(argv, stdout=out, stderr=subprocess.STDOUT)
        worker = FaultWorker(name, proc, log)
        self.workers.append(worker)
        return worker

    def live_workers(self) -> list[FaultWorker]:
        return [w for w in self.workers if w.killed_at is None and w.proc.poll() is None]

    def wait_ticker(self, worker: FaultWorker, timeout: float = 30.0) -> None:
        """Wait until ``worker`` holds the ticker election."""
        self._wait(lambda: self.monitor.now().ticker_holder() == worker.name, timeout,
                   f"{worker.name} to hold the ticker election")

    def wait_spread(self, timeout: float = 30.0) -> None:
        """Wait until every slot is owned and every live worker owns one."""
        def spread() -> bool:
            sample = self.monitor.now()
            owners = sample.owners()
            live = {w.name for w in self.live_workers()}
            return (len(owners) == self.workload.slots and set(owners.values()) <= live
                    and all(sample.slots_of(name) for name in live))
        self._wait(spread, timeout, "every slot owned and every worker owning one")

    def wait_balanced(self, timeout: float = 30.0) -> None:
        """Wait until every slot is owned and every live worker owns its fair
        share (slots // workers, or one more)."""
        def balanced() -> bool:
            sample = self.monitor.now()
            owners = sample.owners()
            live = {w.name for w in self.live_workers()}
            share = self.workload.slots // max(1, len(live))
            return (len(owners) == self.workload.slots and set(owners.values()) <= live
                    and all(share <= len(sample.slots_of(name)) <= share + 1
                            for name in live))
        self._wait(balanced, timeout, "every worker owning its fair share of the slots")

    def start(self, workers: int | None = None, *, first: dict[str, Any] | None = None,
              each: Callable[[int], dict[str, Any]] | None = None, slow: int = 0) -> None:
        """Start the workers (the first one alone, until it holds the ticker
        election), wait until slots are spread, then the producers, then warm up."""
        count = self.workload.workers if workers is None else workers
        began = time.monotonic()
        for i in range(count):
            options = dict(first or {}) if i == 0 else {}
            if each is not None:
                options.update(each(i))
            worker = self.spawn(**options)
            if i == 0:
                self.wait_ticker(worker)
        self.wait_spread()
        # The slots are held by the team's role: the harness tests that deployment.
        owners = self.db.rows(
            "select distinct a.usename from pg_locks l join pg_stat_activity a using (pid)"
            " where l.locktype = 'advisory' and l.granted and l.objsubid = 1"
            "   and a.application_name like 'fw-%%-lane%%'"
            if self.workload.ownership == "advisory" else
            "select distinct r.rolname::text from pgque.lease l"
            " join pg_roles r on r.oid = l.lease_role where l.lease_name like 'fw-%%-lane%%'")
        assert owners == [(self.team,)], f"slot owners log in as {owners}, not {self.team}"
        self.timings["start"] = round(time.monotonic() - began, 2)
        self.start_producers(slow=slow)
        time.sleep(self.workload.warmup)  # traffic before the fault, not a synchronisation

    def start_producers(self, *, slow: int = 0, hold: tuple[float, float] = (2.0, 4.0)) -> None:
        w = self.workload
        for i in range(w.producers):
            self.producers.append(Producer(self, i, rate=w.rate))
        for i in range(slow):
            self.producers.append(Producer(self, w.producers + i, rate=w.rate, hold=hold))
        for producer in self.producers:
            producer.start()

    # -- helpers for faults ------------------------------------------------------

    def _wait(self, probe: Callable[[], Any], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                self.dump_logs()
                raise AssertionError(f"{self.scenario}: timed out after {timeout}s waiting "
                                     f"for {what}")
            time.sleep(0.02)

    def _victim(self, kind: str, worker: FaultWorker) -> Fault:
        sample = self.monitor.now()
        sessions = sample.of(worker.name)
        holders = {s.pid for s in sessions if s.slots}
        fault = Fault(kind=kind, victim=worker.name, victim_pid=worker.pid, at=sample.at,
                      slots=sample.slots_of(worker.name), session_pids=holders,
                      all_pids={s.pid for s in sessions},
                      ticker=any(s.ticker for s in sessions))
        self.faults.append(fault)
        return fault

    def send_burst(self, slots: set[int]) -> int:
        """Send ``workload.burst`` events in one transaction, round robin over the
        keys of ``slots``, as a producer of its own; returns that producer's index."""
        index = next(self._bursts)
        keys = [k for k in self.keys if self.key_slot[k] in slots] or self.keys
        events = [("e", {"p": index, "s": seq, "k": keys[seq % len(keys)], "fail": 0},
                   keys[seq % len(keys)]) for seq in range(1, self.workload.burst + 1)]
        with psycopg.connect(self.dsn, application_name="fault-burst") as conn:
            conn.execute("set synchronous_commit = on")
            ids = pgque.Client(conn).send_batch(self.queue, events, conn=conn)
            conn.execute(
                "insert into fault_sent (ev_id, producer, key, seq, fail) select * from "
                "unnest(%s::bigint[], %s::int[], %s::text[], %s::int[], %s::int[])",
                (ids, [index] * len(ids), [e[2] for e in events], [e[1]["s"] for e in events],
                 [0] * len(ids)))
        return index

    def catch_mid_handler(self, fault: Fault, timeout: float = 5.0) -> None:
        """Make the fault hit the victim mid-batch: send it a burst (one batch of
        ``workload.burst`` events for its slots) and wait until it is handling the
        burst's first quarter, or else any event; set the fault's time (the
        database's) to then."""
        burst = self.send_burst(fault.slots) if self.workload.burst and fault.slots else None
        deadline = time.monotonic() + timeout
        while True:
            now, in_burst, busy = self.db.rows(
                "select clock_timestamp(), coalesce(bool_or(producer = %s and seq <= %s), false), "
                "count(*) > 0 from fault_handled where pid = %s and ended is null "
                "and started > clock_timestamp() - interval '1s'",
                (burst, self.workload.burst // 4, fault.victim_pid))[0]
            fault.at = now
            if in_burst or (busy and burst is None):
                return
            if time.monotonic() > deadline:
                if busy:
                    fault.notes.append("caught mid-handler, not in its burst")
                    return
                if time.monotonic() > deadline + timeout:
                    fault.notes.append("not caught mid-handler")
                    return
            time.sleep(0.001)

    def sessions_gone(self, pids: set[int], timeout: float) -> datetime | None:
        """The database time at which none of ``pids`` is a session any more,
        polled; None if some still is after timeout seconds. By lease, the
        victim's sessions are its leases (negative pids: see Monitor): when
        none of them lives any more (expired or ended)."""
        deadline = time.monotonic() + timeout
        query = ("select clock_timestamp(), count(*) from pg_stat_activity where pid = any(%s)"
                 if self.workload.ownership == "advisory" else
                 "select clock_timestamp(), count(*) from pgque.lease where -lease_id = any(%s)"
                 " and lease_until > clock_timestamp()")
        while True:
            now, left = self.db.rows(query, (list(pids),))[0]
            if left == 0:
                return now  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    # -- faults ----------------------------------------------------------------

    def sigkill(self, worker: FaultWorker) -> Fault:
        """SIGKILL the worker, mid-handler when possible."""
        fault = self._victim("sigkill", worker)
        self.catch_mid_handler(fault)
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        worker.killed_at = fault.at
        fault.session_end = self.sessions_gone(fault.all_pids, 30)
        return fault

    def sigstop(self, worker: FaultWorker, seconds: float, *, expect_session_end: bool,
                latency_bound: bool) -> Fault:
        """Freeze the worker for ``seconds``; note when the server ended its slot
        sessions meanwhile (idle_session_timeout)."""
        fault = self._victim("sigstop", worker)
        fault.zombie_bound = expect_session_end
        fault.latency_bound = latency_bound
        self.catch_mid_handler(fault)
        started = time.monotonic()
        worker.proc.send_signal(signal.SIGSTOP)
        worker.stopped = True
        fault.session_end = self.sessions_gone(fault.session_pids, seconds)
        if expect_session_end and fault.session_end is None:
            self.failures.append(f"{worker.name}: the server did not end the frozen worker's "
                                 f"slot sessions within {seconds}s (idle_session_timeout)")
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))  # the freeze itself
        worker.proc.send_signal(signal.SIGCONT)
        worker.stopped = False
        fault.until = self.db.now()
        return fault

    def terminate(self, worker: FaultWorker) -> Fault:
        """pg_terminate_backend every session of the worker, mid-handler when possible."""
        fault = self._victim("terminate", worker)
        fault.zombie_bound = True
        self.catch_mid_handler(fault)
        self.db.rows("select pg_terminate_backend(pid) from unnest(%s::int[]) pid",
                     (sorted(fault.all_pids),))
        fault.session_end = self.sessions_gone(fault.all_pids, 10)
        return fault

    def network(self, factory: Callable[[str, int], Network] = TcpProxy) -> Network:
        # By lease, between the workers and their pooler.
        params = conninfo_to_dict(self.worker_dsn if self.pooler is not None else self.dsn)
        net = factory(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
        self.networks.append(net)
        return net

    def add_network(self, net: Network) -> Network:
        """Register a network made elsewhere (stopped with the run)."""
        self.networks.append(net)
        return net

    def cut(self, worker: FaultWorker, net: Network) -> Fault:
        """Close both sides of every connection of the worker, mid-handler."""
        fault = self._victim("cut", worker)
        fault.zombie_bound = True
        self.catch_mid_handler(fault)
        fault.notes.append(f"{net.cut()} connections cut")
        fault.session_end = self.sessions_gone(fault.session_pids, 10)
        return fault

    def blackhole(self, worker: FaultWorker, net: Network, seconds: float, *,
                  end: str) -> Fault:
        """Stop the worker's traffic for ``seconds``, then heal, or close its
        connections (``end`` = "heal" or "close")."""
        fault = self._victim(f"blackhole-{end}", worker)
        started = time.monotonic()
        fault.at = self.db.now()
        net.blackhole()
        # Over real packet loss the server may end the sessions meanwhile.
        fault.session_end = self.sessions_gone(fault.session_pids, seconds)
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))  # the blackhole itself
        if end == "close":
            net.cut()
            net.heal()
            if fault.session_end is None:
                fault.session_end = self.sessions_gone(fault.session_pids, 10)
        else:
            net.heal()
        fault.zombie_bound = fault.session_end is not None
        fault.until = self.db.now()
        return fault

    def partition(self, worker: FaultWorker, net: NetnsNetwork, *, answer: bool = False,
                  max_seconds: float = 20.0, linger: float = 0.3,
                  rejoin_timeout: float = 30.0, server_log: Path | None = None) -> Fault:
        """Real packet loss (a :class:`NetnsNetwork`) on a worker busy with a batch.

        The worker is caught mid-handler (a burst for its slots), then its data
        link goes dark in both directions: at once (``answer`` False: its next
        request on its slot session is lost, the server's session is idle), or
        (``answer`` True) the moment the server sends data to its slot session,
        so the server's answer is what is lost: the server holds unacknowledged
        data (its ``tcp_user_timeout`` ends the session, keepalives do not run)
        and the worker waits for an answer (its keepalives, capped by its
        ``tcp_user_timeout``).

        The blackhole lasts until the server has ended every session of the
        worker, the worker has noticed (it logged a lost session), and another
        worker owns each of its slots, plus ``linger`` seconds; at most
        ``max_seconds``. Then it heals, and the worker must reconnect, own a
        slot and handle an event again within ``rejoin_timeout``. Figures
        (seconds from the fault, or from the heal) go to ``fault.figures``,
        with what the ``server_log`` says about the victim's sessions (how the
        server ended them); the zombie bound applies."""
        log_offset = server_log.stat().st_size if server_log is not None else 0
        fault = self._victim("partition-answer" if answer else "partition-busy", worker)
        fault.zombie_bound = True
        self.catch_mid_handler(fault)
        figures = fault.figures
        if answer:
            ports = [r[0] for r in self.db.rows(
                "select client_port from pg_stat_activity where pid = any(%s)",
                (sorted(fault.session_pids),))]
            net.arm_answer_trip(ports)
            armed = time.monotonic()
            while not net.tripped():
                if time.monotonic() > armed + 5:
                    fault.notes.append("the server sent the slot session nothing for 5s: "
                                       "cut anyway")
                    break
                time.sleep(0.005)
            figures["trip_wait_s"] = round(time.monotonic() - armed, 3)
            fault.at = self.db.now()
            figures["lost_answer_to"] = [" ".join(r[0].split())[:80] for r in self.db.rows(
                "select query from pg_stat_activity where pid = any(%s)",
                (sorted(fault.session_pids),))]
        began = time.monotonic()
        net.blackhole()
        figures["blackhole_install_s"] = round(time.monotonic() - began, 3)
        noticed = moved = None
        held = set(fault.slots)  # and what the lost session was granted meanwhile
        while time.monotonic() - began < max_seconds:
            now, slot_left, all_left = self.db.rows(
                "select clock_timestamp(), count(*) filter (where pid = any(%s)), count(*) "
                "from pg_stat_activity where pid = any(%s)",
                (sorted(fault.session_pids), sorted(fault.all_pids)))[0]
            if fault.session_end is None and slot_left == 0:
                fault.session_end = now
            if fault.all_sessions_end is None and all_left == 0:
                fault.all_sessions_end = now
            if noticed is None:
                noticed = self.noticed_lost_session(worker, fault.at)
            sample = self.monitor.now()
            if fault.session_end is None:
                held |= {slot for session in sample.of(worker.name)
                         if session.pid in fault.all_pids for slot in session.slots}
            if moved is None:
                owners = sample.owners()
                if all(owners.get(slot) not in (None, worker.name) for slot in held):
                    moved = now
            if None not in (fault.session_end, noticed, moved):
                time.sleep(linger)
                break
            time.sleep(0.02)
        lingering = [r[0] for r in self.db.rows(
            "select application_name from pg_stat_activity where pid = any(%s) order by 1",
            (sorted(fault.all_pids),))]
        net.heal()
        fault.until = self.db.now()
        if held - fault.slots:
            # A claim whose answer was lost: the server granted the slot to a
            # session the worker had already given up on.
            fault.notes.append(f"slots granted to the lost session during the blackhole: "
                               f"{sorted(held - fault.slots)}")
            fault.slots |= held
        if lingering:
            fault.notes.append(f"sessions of {worker.name} still on the server at the heal: "
                               f"{', '.join(lingering)}")
        if noticed is not None:
            figures["client_gave_up_by"] = self.db.value(
                "select message from fault_log where pid = %s and at = %s limit 1",
                (worker.pid, noticed))
        figures["server_ended_slot_session_s"] = _seconds(fault.at, fault.session_end)
        figures["server_ended_all_sessions_s"] = _seconds(fault.at, fault.all_sessions_end)
        figures["client_gave_up_s"] = _seconds(fault.at, noticed)
        figures["slots_owned_by_others_s"] = _seconds(fault.at, moved)
        figures["healed_s"] = _seconds(fault.at, fault.until)
        if fault.session_end is None:
            self.failures.append(f"{worker.name}: the server did not end its slot session "
                                 f"within {max_seconds}s of the blackhole")
        if noticed is None:
            self.failures.append(f"{worker.name}: did not notice its lost session within "
                                 f"{max_seconds}s of the blackhole")
        elif fault.session_end is not None and noticed > fault.session_end:
            self.failures.append(
                f"{worker.name}: noticed its lost session {_seconds(fault.at, noticed)}s after "
                f"the blackhole, after the server ended it "
                f"({figures['server_ended_slot_session_s']}s): the client must give up first")
        # Rejoin: reconnected (logged), owns a slot, handles an event; and when
        # the server let go of the sessions that outlived the blackhole.
        healed = time.monotonic()
        reconnected = owns = handles = None
        while time.monotonic() - healed < rejoin_timeout:
            if fault.all_sessions_end is None:
                now, left = self.db.rows("select clock_timestamp(), count(*) from "
                                         "pg_stat_activity where pid = any(%s)",
                                         (sorted(fault.all_pids),))[0]
                if left == 0:
                    fault.all_sessions_end = now
                    figures["old_sessions_gone_after_heal_s"] = _seconds(fault.until, now)
            if reconnected is None:
                reconnected = self.db.value(
                    "select min(at) from fault_log where pid = %s and at > %s "
                    "and logger = 'pgque.worker' and message like '%%: connected%%'",
                    (worker.pid, fault.until))
            if owns is None:
                owns = min((sample.at for sample in list(self.monitor.samples)
                            if sample.at > fault.until and sample.slots_of(worker.name)),
                           default=None)
            if handles is None:
                handles = self.db.value("select min(started) from fault_handled where pid = %s "
                                        "and started > %s", (worker.pid, fault.until))
            if None not in (owns, handles, fault.all_sessions_end):
                break
            self.monitor.now()
            time.sleep(0.05)
        figures["reconnected_after_heal_s"] = _seconds(fault.until, reconnected)
        figures["owns_slot_after_heal_s"] = _seconds(fault.until, owns)
        figures["handles_after_heal_s"] = _seconds(fault.until, handles)
        if server_log is not None:
            with server_log.open("rb") as log:
                log.seek(log_offset)
                lines = log.read().decode(errors="replace").splitlines()
            figures["server_log"] = [line for line in lines
                                     if any(f"[{pid}]" in line for pid in fault.all_pids)][:8]
        # Owning a slot and handling again are the rejoin; the logged reconnect
        # is a figure only (its log line is copied by a thread that may lag).
        if None in (owns, handles):
            self.failures.append(f"{worker.name}: not back within {rejoin_timeout}s of the heal "
                                 f"(reconnected/owns a slot/handles: {reconnected}/{owns}/"
                                 f"{handles})")
        return fault

    def noticed_lost_session(self, worker: FaultWorker, after: datetime) -> datetime | None:
        """When the worker first logged that its session was lost after ``after``."""
        noticed: datetime | None = self.db.value(
            "select min(at) from fault_log where pid = %s and at > %s "
            "and logger = 'pgque.worker' and level = 'WARNING' "
            "and (message like '%%reconnecting in%%' or message like '%%session gone%%' "
            "or message like '%%giving up on the connection%%')",
            (worker.pid, after))
        return noticed

    def restart(self, server: Any, mode: str) -> list[Fault]:
        """Restart the server (``fast`` or ``immediate`` stop); every worker is a victim."""
        faults = [self._victim(f"restart-{mode}", w) for w in self.live_workers()]
        self.catch_mid_handler(faults[0])  # the first worker is mid-batch
        at = faults[0].at
        self.db.close()
        # When the stop ended the sessions: a session of our own, polled, ends
        # with the victims' (a fast or immediate stop signals every backend at
        # once). Taken on this host's clock, which is the server's (a
        # restartable server is a local one). Calls the victims started
        # between `at` and then were legitimate.
        stopped: list[datetime] = []
        watching = threading.Event()
        done = threading.Event()

        def watch() -> None:
            try:
                with psycopg.connect(self.dsn, autocommit=True,
                                     application_name="fault-restart-watch") as conn:
                    watching.set()
                    while not done.is_set():
                        conn.execute("select 1")
                        time.sleep(0.002)
            except psycopg.Error:
                stopped.append(datetime.now(timezone.utc))
            finally:
                watching.set()

        watcher = threading.Thread(target=watch, name="fault-restart-watch", daemon=True)
        watcher.start()
        watching.wait(5)
        if "mode" in inspect.signature(server.restart).parameters:
            server.restart(mode=mode)
        elif mode == "fast":
            server.restart()
        else:  # pgtest.LocalServer: its LocalPostgres stops in any mode
            server.postgres.stop(mode)
            server.postgres.start()
        done.set()
        watcher.join(5)
        until = self.db.now()
        session_end = min(stopped[0], until) if stopped else at
        for fault in faults:
            fault.at = at
            fault.until = until
            if self.pooler is not None:
                # By lease, ownership is a row, not a session: a lease outlives a
                # restart shorter than it, and its holder rightly goes on. The
                # victim's leases end when its lanes that lost their connections
                # end them, or when they expire: that is when the bound begins.
                fault.session_end = self.sessions_gone(fault.session_pids,
                                                       self.workload.lease + 5)
                fault.zombie_bound = fault.session_end is not None
                if fault.session_end is None:
                    fault.notes.append("a lease of before the restart lives on: no bound")
                continue
            fault.session_end = session_end  # no session of before the stop outlives it
            fault.zombie_bound = True
            if not stopped:
                fault.notes.append("the end of the sessions was not observed: counted from "
                                   "before the stop")
        return faults

    # -- the end ---------------------------------------------------------------

    def unresolved(self) -> int:
        """Committed events neither handled successfully nor dead-lettered."""
        return int(self.db.value(
            "with dead as (select ev_id from pgque.dead_letters(%s, %s, 1000000)) "
            "select count(*) from fault_sent s where not exists (select 1 from fault_handled h "
            "where h.ev_id = s.ev_id and h.outcome = 'ok') "
            "and not exists (select 1 from dead d where d.ev_id = s.ev_id)",
            (self.queue, CONSUMER)))

    def settled(self) -> bool:
        if self.unresolved():
            return False
        with pgque.connect(self.dsn) as client:
            status = client.partition_slot_status(self.queue)
        if any(s.retries_waiting or s.pending_events for s in status):
            return False
        live = [w.pid for w in self.live_workers()]
        return not self.db.value("select exists (select 1 from fault_handled where "
                                 "ended is null and pid = any(%s))", (live,))

    def finish(self) -> None:
        """Stop producing, wait until everything is handled or dead-lettered, then
        stop the workers with SIGTERM."""
        self.stop_producing.set()
        began = time.monotonic()
        self.timings["until_finish"] = round(began - self._clock, 2)
        for producer in self.producers:
            producer.join(30)
        deadline = time.monotonic() + self.workload.drain_timeout
        while not self.settled():
            if time.monotonic() > deadline:
                self.failures.append(f"not settled within {self.workload.drain_timeout}s: "
                                     f"{self.unresolved()} events neither handled nor "
                                     f"dead-lettered")
                break
            time.sleep(0.2)
        self.timings["drain"] = round(time.monotonic() - began, 2)
        began = time.monotonic()
        self.stop_workers()
        self.timings["stop"] = round(time.monotonic() - began, 2)

    def stop_workers(self) -> None:
        for w in self.workers:
            code = w.proc.poll()
            if w.killed_at is None and code is not None:
                self.failures.append(f"{w.name} exited by itself with code {code}")
                w.killed_at = self.db.now()  # its unfinished calls end no later than this
        live = self.live_workers()
        for w in live:
            if w.stopped:
                w.proc.send_signal(signal.SIGCONT)
                w.stopped = False
            w.proc.send_signal(signal.SIGTERM)
        for w in live:
            try:
                code = w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.send_signal(signal.SIGUSR1)  # dump its stacks into its log
                time.sleep(1)
                w.proc.kill()
                w.proc.wait(10)
                self.failures.append(f"{w.name} did not exit within 30s of SIGTERM")
                continue
            if code != 0:
                self.failures.append(f"{w.name} exited {code} after SIGTERM")

    def close(self) -> None:
        """Release everything, whatever state the scenario died in."""
        self.stop_producing.set()
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()
                w.proc.wait(10)
        for net in self.networks:
            net.stop()
        if self.pooler is not None:
            self.pooler.close()
        self.monitor.stop()
        with contextlib.suppress(psycopg.Error):  # roles are the server's, not the database's
            self.db.rows(f"drop owned by {self.team}; drop role {self.team}")
        self.db.close()

    def dump_logs(self, lines: int = 30) -> None:
        for w in self.workers:
            with contextlib.suppress(OSError):
                tail = w.log.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    print(f"--- {w.name} (pid {w.pid}) log tail:", *tail, sep="\n")

    # -- checks and report -------------------------------------------------------

    def conclude(self) -> dict[str, Any]:
        """Compute the checks and figures; returns the report (``failures`` lists
        every check that failed)."""
        w = self.workload
        sent = {r[0]: r for r in self.db.rows(
            "select ev_id, producer, key, seq, fail, sent_at from fault_sent")}
        calls = self.db.rows("select id, ev_id, key, producer, seq, retry, pid, worker, "
                             "started, ended, outcome from fault_handled order by id")
        dead = self.db.rows("select ev_id, ev_retry from pgque.dead_letters(%s, %s, 1000000)",
                            (self.queue, CONSUMER))
        keys = sorted({r[2] for r in sent.values()} | {c[2] for c in calls})
        slot_of = dict(self.db.rows("select k, pgque.slot_of(k, %s) from unnest(%s::text[]) k",
                                    (w.slots, keys)))
        failures = self.failures

        # A send is named by (producer, seq); its event id alone may have been
        # given again after a crash (see Producer.rolled_back).
        rolled_back = {(p_, s_) for p in self.producers for _, p_, s_ in p.rolled_back}
        unknown = {(p_, s_) for p in self.producers for _, p_, s_ in p.unknown}
        sent_sends = {(r[1], r[3]) for r in sent.values()}
        ids_again = ({ev for p in self.producers for ev, _, _ in p.rolled_back + p.unknown}
                     & set(sent)) - {ev for ev, r in sent.items() if (r[1], r[3]) in unknown}
        for p in self.producers:
            if p.errors:
                failures.append(f"producer {p.index} errors: {p.errors[:3]}")

        # No committed event lost.
        ok = {c[1] for c in calls if c[10] == "ok"}
        dead_ids = Counter(d[0] for d in dead)
        lost = [ev for ev, r in sent.items()
                if (r[4] > w.max_retries and ev not in dead_ids)
                or (r[4] <= w.max_retries and ev not in ok)]
        if lost:
            failures.append(f"{len(lost)} committed events lost, e.g. {sorted(lost)[:10]}")

        # Nothing delivered that did not commit: each call's (event id, producer,
        # seq) is a committed send's.
        sent_ids = {(ev, r[1], r[3]) for ev, r in sent.items()}
        bad_rb = sorted({(c[1], c[3], c[4]) for c in calls if (c[3], c[4]) in rolled_back})
        if bad_rb:
            failures.append(f"{len(bad_rb)} rolled-back events delivered, (id, producer, seq):"
                            f" {bad_rb[:10]}")
        ghosts = sorted({(c[1], c[3], c[4]) for c in calls
                         if (c[1], c[3], c[4]) not in sent_ids
                         and (c[3], c[4]) not in rolled_back})
        if ghosts:
            failures.append(f"{len(ghosts)} events delivered that are not in fault_sent as "
                            f"(id, producer, seq): {ghosts[:10]}")
        if unknown & sent_sends:
            self.notes.append(f"{len(unknown & sent_sends)} commits with a lost outcome did "
                              f"commit")
        if ids_again:
            self.notes.append(f"{len(ids_again)} ids of uncommitted sends were given again "
                              f"after a crash")

        # First handlings (retry 0) in send order per (producer, key).
        first: dict[int, tuple[datetime, int]] = {}
        for c in calls:
            if c[5] == 0 and (c[1] not in first or (c[8], c[0]) < first[c[1]]):
                first[c[1]] = (c[8], c[0])
        by_pk: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
        for ev, r in sent.items():
            by_pk[(r[1], r[2])].append((r[3], ev))
        order_breaks = []
        for pk, evs in by_pk.items():
            seen = [first[ev] + (seq, ev) for seq, ev in sorted(evs) if ev in first]
            for a, b in itertools.pairwise(seen):
                if b[:2] < a[:2]:
                    order_breaks.append((pk, a[3], b[3]))
        if order_breaks:
            failures.append(f"{len(order_breaks)} first handlings out of send order, e.g. "
                            f"(producer, key), earlier event, later event: {order_breaks[:3]}")

        # Under pause, nothing of a key after a failed event starts before that
        # event succeeded or was dead-lettered (per (producer, key), by send order).
        held_breaks = self._held_breaks(sent, calls, by_pk) if w.failure_policy == "pause" else []
        if held_breaks:
            failures.append(f"{len(held_breaks)} events of a blocked key started before the "
                            f"failed one was handled, e.g. (failed, later): {held_breaks[:3]}")

        # Dead letters: exactly the always-failing events, once each, after max_retries.
        doomed = {ev for ev, r in sent.items() if r[4] > w.max_retries}
        wrong_retry = sorted({d[0] for d in dead if d[1] != w.max_retries})
        twice = sorted(ev for ev, n in dead_ids.items() if n > 1)
        undeserved = sorted(set(dead_ids) - doomed)
        if wrong_retry:
            failures.append(f"{len(wrong_retry)} dead letters with ev_retry != "
                            f"{w.max_retries}: {wrong_retry[:10]}")
        if twice:
            failures.append(f"{len(twice)} events dead-lettered more than once: {twice[:10]}")
        if undeserved:
            failures.append(f"{len(undeserved)} events dead-lettered that should have "
                            f"succeeded: {undeserved[:10]}")

        # Transactional handlers: every effect applied exactly once.
        effects_duplicated = effects_lost = 0
        if w.transactional:
            applied = Counter(ev for (ev,) in self.db.rows("select ev_id from fault_effects"))
            expected = {ev for ev, r in sent.items() if r[4] <= w.max_retries}
            duplicated = sorted(ev for ev, n in applied.items() if n > 1)
            missing = sorted(expected - set(applied))
            stray = sorted(set(applied) - expected)
            effects_duplicated, effects_lost = len(duplicated), len(missing)
            if duplicated:
                failures.append(f"{len(duplicated)} effects applied more than once: "
                                f"{duplicated[:10]}")
            if missing:
                failures.append(f"{len(missing)} effects lost: {missing[:10]}")
            if stray:
                failures.append(f"{len(stray)} effects of events that always fail (or were "
                                f"never sent): {stray[:10]}")
            # The balances, against what the sent events add up to.
            want: Counter[str] = Counter()
            for ev in expected:
                r = sent[ev]
                want[r[2]] += effect_amount(r[1], r[3])
            have = dict(self.db.rows("select key, total from fault_balance"))
            wrong = {k: (have.get(k, 0), want[k]) for k in set(want) | set(have)
                     if have.get(k, 0) != want[k]}
            if wrong:
                failures.append(f"{len(wrong)} balances differ (have, want): "
                                f"{dict(list(wrong.items())[:5])}")

        # Duplicates and overlaps (reported).
        per_call = Counter((c[1], c[5]) for c in calls)
        duplicates = sum(n - 1 for n in per_call.values())
        killed_at = {wk.pid: wk.killed_at for wk in self.workers if wk.killed_at is not None}
        spans: dict[str, list[tuple[datetime, datetime, int]]] = defaultdict(list)
        for c in calls:
            end = c[9] or killed_at.get(c[6]) or c[8]
            spans[c[2]].append((c[8], end, c[0]))
        overlaps = 0  # pairs of calls of one key whose intervals intersect
        overlapped: set[int] = set()  # calls still running when another of their key started
        overlap_seconds = 0.0
        for key_spans in spans.values():
            active: list[tuple[datetime, int]] = []  # (end, call id), a heap
            for start, end, call in sorted(key_spans):
                while active and active[0][0] <= start:
                    heapq.heappop(active)
                overlaps += len(active)
                overlapped.update(a[1] for a in active)
                if active:
                    overlap_seconds = max(overlap_seconds, (min(max(active)[0], end)
                                                            - start).total_seconds())
                heapq.heappush(active, (end, call))

        # pgque verify over the workers' own record: it must find what the
        # checks above find (nothing, or they failed already), and no more.
        findings = self.db.rows("select kind, violation, ev_id, other_ev_id, detail"
                                " from pgque.verify_handling(%s, %s)", (self.queue, CONSUMER))
        violations = [f for f in findings if f[1]]
        if violations:
            failures.append(f"pgque verify found {len(violations)} violations, e.g. "
                            f"{violations[:3]}")

        # Per fault: slot moves, zombie starts, healthy latency.
        fault_reports = []
        for fault in self.faults:
            fault_reports.append(self._fault_report(fault, sent, calls, slot_of, first))

        report: dict[str, Any] = {
            "scenario": self.scenario,
            "server_major": self.server_major,
            "seconds": round(time.monotonic() - self._clock, 1),
            "committed": len(sent),
            "rolled_back": len(rolled_back),
            "unknown_commits": len(unknown),
            "calls": len(calls),
            "duplicates": duplicates,
            "overlaps": overlaps,
            "overlapped_calls": len(overlapped),
            "max_overlap_s": round(overlap_seconds, 3),
            "dead_letters": len(dead),
            "doomed": len(doomed),
            "order_breaks": len(order_breaks),
            "failure_policy": w.failure_policy,
            "held_breaks": len(held_breaks),
            "lost": len(lost),
            "verify_violations": len(violations),
            "zombie_windows": len(findings) - len(violations),
            "transactional": w.transactional,
            "effects_duplicated": effects_duplicated,
            "effects_lost": effects_lost,
            "faults": fault_reports,
            "timings": self.timings,
            "notes": self.notes,
            "failures": failures,
        }
        return report

    def _held_breaks(self, sent: dict[int, tuple[Any, ...]], calls: list[tuple[Any, ...]],
                     by_pk: dict[tuple[int, str], list[tuple[int, int]]]
                     ) -> list[tuple[int, int]]:
        """The pause policy's promise, checked on the calls: after a call of event
        e that failed, no call of a later event of e's (producer, key) starts
        before a call of e that succeeded ended, or e's dead letter was written."""
        dead_at = dict(self.db.rows(
            "select ev_id, dl_time from pgque.dead_letters(%s, %s, 1000000)",
            (self.queue, CONSUMER)))
        calls_of: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        for c in calls:
            calls_of[c[1]].append(c)
        breaks = []
        for evs in by_pk.values():
            order = [ev for _seq, ev in sorted(evs)]
            for i, ev in enumerate(order):
                for failed in (c for c in calls_of[ev] if c[10] == "fail" and c[9] is not None):
                    oks = [c[9] for c in calls_of[ev]
                           if c[10] == "ok" and c[9] is not None and c[8] > failed[8]]
                    released = min([*oks, *([dead_at[ev]] if ev in dead_at else [])],
                                   default=None)
                    for later in order[i + 1:]:
                        if any(failed[9] < c[8] and (released is None or c[8] < released)
                               for c in calls_of[later]):
                            breaks.append((ev, later))
        return breaks

    def _fault_report(self, fault: Fault, sent: dict[int, tuple[Any, ...]],
                      calls: list[tuple[Any, ...]], slot_of: dict[str, int],
                      first: dict[int, tuple[datetime, int]]) -> dict[str, Any]:
        moved: dict[int, float | None] = {}
        resumed: dict[int, float | None] = {}
        after = fault.until or fault.at
        for slot in sorted(fault.slots):
            in_slot = [c for c in calls if slot_of.get(c[2]) == slot and c[8] > fault.at]
            by_other = [c[8] for c in in_slot if c[6] != fault.victim_pid]
            by_any = [c[8] for c in in_slot if c[8] > after] + by_other
            moved[slot] = _seconds(fault.at, min(by_other, default=None))
            resumed[slot] = _seconds(fault.at, min(by_any, default=None))

        zombies: list[tuple[Any, ...]] = []
        owned_again = None
        if fault.session_end is not None:
            owned_again = self.monitor.owned_again(
                fault.victim, fault.all_pids if self.pooler is None else fault.session_pids,
                fault.at)
            zombies = [c for c in calls if c[6] == fault.victim_pid and c[8] > fault.session_end
                       and (owned_again is None or c[8] < owned_again)]
        if fault.zombie_bound and len(zombies) > len(fault.slots):
            self.failures.append(
                f"zombie bound: {fault.victim} ({fault.kind}) started {len(zombies)} handler "
                f"calls after its sessions ended (owned {len(fault.slots)} slots), the first "
                f"{_seconds(fault.session_end, zombies[0][8])}s and the last "
                f"{_seconds(fault.session_end, zombies[-1][8])}s after")

        latencies: list[float] = []
        late: list[tuple[int, float]] = []
        if fault.until is not None and not fault.kind.startswith("restart"):
            for ev, r in sent.items():
                if (fault.at <= r[5] <= fault.until and slot_of.get(r[2]) not in fault.slots
                        and ev in first):
                    latency = (first[ev][0] - r[5]).total_seconds()
                    latencies.append(latency)
                    if latency > self.workload.latency_bound:
                        late.append((ev, round(latency, 2)))
        if fault.latency_bound and late:
            self.failures.append(
                f"latency bound: {len(late)} of {len(latencies)} events of healthy slots sent "
                f"during the fault on {fault.victim} (ticker holder: {fault.ticker}) were "
                f"first handled more than {self.workload.latency_bound}s after sending, "
                f"worst {max(x for _, x in late)}s")
        return {
            "kind": fault.kind,
            "victim": fault.victim,
            "ticker_holder": fault.ticker,
            "slots": sorted(fault.slots),
            "session_end_s": _seconds(fault.at, fault.session_end),
            "until_s": _seconds(fault.at, fault.until),
            "moved_s": moved,
            "resumed_s": resumed,
            "zombie_starts": len(zombies),
            "zombie_bound": len(fault.slots) if fault.zombie_bound else None,
            "owned_again_s": _seconds(fault.at, owned_again),
            "healthy_latency_max_s": round(max(latencies), 3) if latencies else None,
            **fault.figures,
            "notes": fault.notes,
        }


def summary_line(report: dict[str, Any]) -> str:
    """One line per scenario for the terminal."""
    def worst(values: dict[int, float | None]) -> str:
        if not values:
            return "-"
        if any(v is None for v in values.values()):
            return "never"
        return f"{max(v for v in values.values() if v is not None):.2f}s"

    parts = []
    for f in report["faults"]:
        part = (f"{f['kind']}:{f['victim']} moved={worst(f['moved_s'])} "
                f"resumed={worst(f['resumed_s'])}")
        if f["session_end_s"] is not None:
            part += f" zombies={f['zombie_starts']}"
            if f["zombie_bound"] is not None:
                part += f"/{f['zombie_bound']}"
        if f["healthy_latency_max_s"] is not None:
            part += f" lat={f['healthy_latency_max_s']:.2f}s"
        if "client_gave_up_s" in f:  # a partition: real packet loss
            def sec(name: str, f: dict[str, Any] = f) -> str:
                return "-" if f.get(name) is None else f"{f[name]:.2f}s"
            part += (f" [server-ended={sec('server_ended_slot_session_s')}"
                     f" client-gave-up={sec('client_gave_up_s')}"
                     f" slots-taken={sec('slots_owned_by_others_s')}"
                     f" healed={sec('healed_s')}; after heal: reconnected="
                     f"{sec('reconnected_after_heal_s')} owns={sec('owns_slot_after_heal_s')}"
                     f" handles={sec('handles_after_heal_s')}]")
        parts.append(part)
    kinds = Counter(parts)
    faults = "; ".join(p if n == 1 else f"{p} x{n}" for p, n in kinds.items()) or "no fault"
    status = "OK" if not report["failures"] else f"FAILED {len(report['failures'])}"
    return (f"FAULTS {report['scenario']} pg{report['server_major']} {report['seconds']}s "
            f"{status}: events={report['committed']} rb={report['rolled_back']} "
            f"calls={report['calls']} dup={report['duplicates']} "
            f"overlaps={report['overlapped_calls']}({report['overlaps']} pairs) "
            f"dl={report['dead_letters']}/{report['doomed']} "
            + (f"effects dup={report['effects_duplicated']} lost={report['effects_lost']} "
               if report.get("transactional") else "")
            + f"| {faults}")


def append_report(path: Path, report: dict[str, Any]) -> None:
    """Add the report to the JSON list at ``path``."""
    reports: list[Any] = []
    if path.exists():
        with contextlib.suppress(ValueError):
            reports = json.loads(path.read_text())
    reports.append(report)
    path.write_text(json.dumps(reports, indent=1, default=str))


@contextlib.contextmanager
def fault_run(scenario: str, dsn: str, workdir: Path, workload: Workload,
              server_major: int) -> Iterator[FaultRun]:
    run = FaultRun(scenario, dsn, workdir, workload, server_major)
    try:
        yield run
    except BaseException:
        run.dump_logs()
        raise
    finally:
        run.close()


def report_path(default_dir: Path) -> Path:
    configured = os.environ.get("PGQUE_FAULTS_REPORT")
    return Path(configured) if configured else default_dir / "fault_report.json"
