# The source of pgque/worker.py, which tools/async_to_sync.py generates  # async-only
# from this file (`make twins`): edit this one, then regenerate. Lines that  # async-only
# end like these are left out of the sync code; "sync-only:" comments become  # async-only
# code there (see tools/async_to_sync.py).  # async-only
"""The partitioned consumer: a Worker owns some slots of a consumer group and
handles their events, one event at a time per slot, slots in parallel.

Sessions
--------
A Worker talks to the database over a *control* session and one or more
*lane* sessions. The control session joins the group (so workers can count
each other), listens for tick notifications and decides which slots this
worker should own. Each lane is one session: it claims the slots the control
hands it, and for each of them receives, has the handler run and acks, on that
session. Plain handlers do not use the session, so a lane serves all its slots
at once: one ``receive_slots`` gets a piece of every slot that has events,
each piece is handled on its own (a thread of the lane's; under asyncio, a
task), and the pieces done by the lane's next call are acked in one
``ack_slots``. The database then does the same work per tick whether the
worker owns 1 slot or 64; this is the default. With ``concurrency`` given
(kept as it was before 0.8) or transactional handlers (which use the lane's
session, inside the transaction that acks), a lane takes its slots in turns
and the default is a lane per slot:
a slot's lock, its receive, its handler's transaction and its ack are all on
one session, and slots on different lanes never wait for each other. A worker
uses at most ``concurrency + 1`` connections, plus one for its Ticker if it
runs one.

How slots are shared
--------------------
There is no leader and no assignor. Each worker claims free slots with a
non-blocking ``pg_try_advisory_lock`` until it owns its fair share: ``N // M``
for M live workers, plus one for the first ``N % M`` of them by the control
session's backend pid, so the shares always add up to N. A worker that owns
more than its share releases the surplus at a batch boundary, and newcomers
pick those slots up. A lane that dies loses its session and with it its locks:
its slots are free at once.

Why this is safe
----------------
Correctness does not rest on this module. The server refuses receive, ack and
nack of a slot from a session that does not hold the slot's lock, and the
receive lock hands a second receiver the same open batch, never another. So
the worst a bug here can do is spread slots badly or stall; it cannot let two
workers hold the same slot or ack a batch somebody else owns. A slot is never
claimed again while a lane that lost it still runs its handler, so one worker
never runs two handlers of one slot at once.

Failures
--------
A handler that raises has its event nacked (the *skip* policy): the event goes
to the slot's retry queue, the rest of the batch proceeds, and the nacks and
the ack of the batch commit in one transaction. Delivery is at least once;
handlers must be idempotent, unless they are *transactional*: then the
handler gets the lane's connection, inside a transaction that also acks the
batch, so the handler's writes and the ack commit together or not at all
(each event in a savepoint: a failed event's writes roll back and it is
nacked in the same transaction). A lane that lost its session can never
commit: the transaction went with it. When a lane's session goes away its
slots are lost with it; in-flight batches are dropped unacked (they will be
delivered again) and the control claims the slots again, on other lanes. A
batch stops at the next event as soon as its session is seen gone (a check of
the idle socket between events, no round trip). Errors that retrying cannot
heal (a wrong slot count, an unknown queue, a pooler swapping the session, a
threaded worker's handler that returns a coroutine instead of handling)
stop the worker: :attr:`Worker.error` keeps them, and ``run()``, the end of a
``with`` block and :meth:`Worker.wait` raise them.

Network
-------
``network_timeout`` (30 s) bounds how long a worker whose network went silent
(no FIN: a partition, a dead host) keeps its slots: the server ends its
sessions within that time (TCP keepalives and ``tcp_user_timeout`` set on each
session), and the client side gives up at about half of it, so the cut-off
worker stops handling before its slots can move. A worker frozen with its
network fine (SIGSTOP, a debugger) is bounded the same way: its sessions fall
silent, and ``idle_session_timeout`` ends them.

asyncio
-------
The worker has an asyncio twin, and one is generated from the other by
tools/async_to_sync.py, so they behave alike: there the handlers are
coroutines, the sessions asynchronous psycopg connections, and every thread named
here a task of the running loop. A handler must not block that loop: a
blocking call holds every lane of the worker (and its heartbeats) until it
returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from psycopg import sql

from pgque._acompat import (
    AHandlerResult,
    AKeyRunner,
    APieces,
    ASpawned,
    acancelled,
    acheck_handler,
    ahandler_result,
    ajoin,
    anotified,
    apause,
    arun_blocking,
    arunning,
    aspawn,
)
from pgque.client_async import AsyncClient, AsyncConn
from pgque.errors import (
    HandlerEndedTransaction,
    HandlerReturnedAwaitable,
    LeaseExpired,
    SlotNotOwned,
)
from pgque.lifecycle_async import (
    STOP_LATENCY,
    AsyncCallWatch,
    AsyncService,
    Stopped,
    client_keepalives,
    is_fatal,
    server_timeouts,
)
from pgque.metrics import Metrics, MetricsServer, TickerMetrics, WorkerMetrics
from pgque.retry import NonRetryable, RetryDelay, check_retry_after, delay_for
from pgque.ticker import Ticker
from pgque.types import Batch, Lease, Message

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

__all__ = ["AsyncWorker"]

T = TypeVar("T")
#: How long a lane of plain handlers keeps a finished piece's ack for its next
#: call, so that the acks of a tick's pieces ride along with one call (a receive,
#: or the ack of several), not one call each.
ACK_DELAY = 0.02
#: How often a slot that found nothing looks again by default: while the worker
#: listens for tick notifications, and while it does not.
LISTENING_POLL_INTERVAL = 1.0
POLL_INTERVAL = 0.2
#: The lease time of a group owned by lease, in seconds, unless given: how long
#: a crashed worker's slots wait for a new owner.
LEASE = 15.0
#: By lease, the share of the lease time after a renewal was sent within which
#: the worker goes on using it (the server's expiry comes later still); leases
#: are renewed every third of it.
LEASE_SAFE_SHARE = 0.8
#: A handler: called with each message.
Handler = Callable[[Message[T]], AHandlerResult]
#: A transactional handler: called with each message and the lane's connection,
#: inside the transaction that acks the batch.
TransactionalHandler = Callable[[Message[T], AsyncConn], AHandlerResult]


def lease_seconds(lease: Lease) -> float:
    return lease.lease.total_seconds()


class _ConnectionLost(Exception):
    """A session of the worker ended; the slots it owned are gone with it."""


class _Session:
    """One connected session: the client over it, the watch on its calls (see
    CallWatch) and when it was last used."""

    def __init__(self, client: AsyncClient, watch: AsyncCallWatch) -> None:
        self.client = client
        self.watch = watch
        self.last_used = time.monotonic()
        #: By lease: until when (time.monotonic()) its lease surely lives, with a
        #: margin; the control moves it on at each renewal. None: advisory locks.
        self.lease_deadline: float | None = None

    def lease_lapsed(self) -> bool:
        return self.lease_deadline is not None and time.monotonic() >= self.lease_deadline

    @contextlib.contextmanager
    def call(self) -> Iterator[AsyncClient]:
        """A call on the session: timed by the watchdog, refused once it is lost
        (or, by lease, once its lease may have expired)."""
        if self.watch.lost:
            raise _ConnectionLost("session gone")
        if self.lease_lapsed():
            raise _ConnectionLost("lease not renewed in time")
        try:
            with self.watch.call():
                yield self.client
        finally:
            self.last_used = time.monotonic()

    def gone(self) -> bool:
        return self.watch.gone() or self.lease_lapsed()


class AsyncWorker(AsyncService, Generic[T]):
    """Consume a queue as one member of a partitioned consumer group.

    ``handler`` is called with each :class:`~pgque.Message`; the events of one
    slot are handled strictly one after another (with ``key_concurrency``, one
    after another per key), and by default every slot the worker owns at the
    same time, received on one session; with ``concurrency`` given, or
    transactional handlers (default: one per slot), that many sessions take
    their slots in turns (see the module docstring). With ``transactional=True``
    the handler is called as ``handler(message, conn)``, inside the transaction
    on ``conn`` that also acks the batch: its writes on ``conn`` commit with the
    ack, exactly once.

    By default the worker also runs a :class:`~pgque.Ticker` (pass
    ``ticker=False`` when something else ticks, or a configured Ticker) and
    listens for tick notifications (``listen``), with ``poll_interval`` as the
    fallback when a notification is lost (by default 1 s while listening, 0.2 s
    without). Under a role that may not tick, that
    Ticker says so once (at INFO) and ends, and the worker runs without
    ticking: another process must tick.

    With ``record=True`` the worker writes each handler call (the event, its
    slot and epoch, start and end by this machine's clock, the outcome) to the
    group's record, before the ack of its piece, for ``pgque verify``
    (:meth:`AsyncClient.verify`) to check per-key order, one handler per key
    at a time and that nothing was lost: one more statement per ack. Every
    worker of the group must record for the check to hold.

    Metrics (see :mod:`pgque.metrics`): with ``opentelemetry-api`` installed
    the worker and its Ticker report on ``meter_provider`` (by default the
    global one); with ``metrics_port`` they are also served in Prometheus's
    text format on ``metrics_host`` (127.0.0.1 unless given; port 0 picks a
    free one, see :attr:`metrics_address`), from the worker's start to its stop.

    ``run()`` blocks until :meth:`stop` (or SIGTERM / SIGINT when run in the
    main thread) and raises the error that stopped the worker, if any;
    ``start()`` runs the same loop in a background thread. A Worker is also a
    context manager: start on enter, stop on exit, and then raise the error
    that stopped the worker, if one did (an exception of the body goes on
    instead). The body waits with :meth:`wait`, which raises that error as
    soon as the worker has stopped with it::

        async with AsyncWorker(dsn, queue="q", consumer="g", slots=4, handler=handle) as worker:
            await worker.wait(lambda: worker.handled >= 100, timeout=60)

    :attr:`error` keeps the error; :meth:`stop` and :meth:`wait_stopped` never
    raise it.
    """

    log = logging.getLogger("pgque.worker")

    def __init__(
        self,
        dsn: str,
        *,
        queue: str,
        consumer: str,
        slots: int,
        handler: Handler[T] | TransactionalHandler[T],
        transactional: bool = False,
        concurrency: int | None = None,
        key_concurrency: int = 1,
        payload_type: type[T] | None = None,
        max_events: int = 100,
        poll_interval: float | None = None,
        retry_after: RetryDelay = 5.0,
        failure_policy: str | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        rebalance_interval: float = 1.0,
        ticker: bool | Ticker = True,
        listen: bool | None = None,
        connect_timeout: float = 30.0,
        network_timeout: float = 30.0,
        name: str | None = None,
        record: bool = False,
        meter_provider: MeterProvider | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        ownership: str = "advisory",
        lease: float = LEASE,
    ) -> None:
        if ownership not in ("advisory", "lease"):
            raise ValueError("ownership must be 'advisory' or 'lease'")
        if not 1 <= lease <= 3600:
            raise ValueError("lease must be 1 to 3600 seconds")
        if listen is None:
            listen = ownership == "advisory"
        elif listen and ownership == "lease":
            raise ValueError("listen=True needs ownership='advisory': LISTEN holds a session, "
                             "which a transaction pooler does not give; by lease the worker "
                             "polls (poll_interval)")
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if concurrency is not None and concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if key_concurrency < 1:
            raise ValueError("key_concurrency must be at least 1")
        if transactional and key_concurrency > 1:
            raise ValueError("key_concurrency must be 1 with transactional=True: the handlers "
                             "of a slot share its session's one transaction")
        if network_timeout < 2:
            raise ValueError("network_timeout must be at least 2 seconds")
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        check_retry_after(retry_after)
        if failure_policy not in (None, "skip", "pause"):
            raise ValueError("failure_policy must be 'skip', 'pause' or None (the group's)")
        acheck_handler(handler)
        super().__init__(name or f"pgque-worker-{queue}-{consumer}",
                         connect_timeout=connect_timeout)
        self.dsn = dsn
        self.queue = queue
        self.consumer = consumer
        self.slots = slots
        self.handler = handler
        self.transactional = transactional
        # Plain handlers do not use the lane's session, so by default one session
        # serves every slot at once (see _Lane._work_together); transactional
        # ones hold it. A concurrency given keeps its meaning of before 0.8:
        # that many lanes, each taking its slots in turns.
        self.together = concurrency is None and not transactional
        self.concurrency = concurrency or (1 if self.together else slots)
        self.key_concurrency = key_concurrency
        self.payload_type = payload_type
        self.max_events = max_events
        # Listening, a poll only covers for a lost notification (a session of the
        # control's that ended) and for what becomes deliverable without a tick
        # (a key resumed): rare enough for a slow poll, and an idle worker's
        # polls are most of what it costs the server.
        self.poll_interval = (poll_interval if poll_interval is not None
                              else LISTENING_POLL_INTERVAL if listen else POLL_INTERVAL)
        self.retry_after = retry_after
        self.failure_policy = failure_policy
        self.non_retryable: tuple[type[BaseException], ...] = (NonRetryable, *non_retryable)
        self._pause = failure_policy == "pause"  # the group's, once serve() read it
        self.rebalance_interval = rebalance_interval
        self.listen = listen
        self.network_timeout = network_timeout
        #: How the group's slots are owned: "advisory" (session locks) or
        #: "lease" (leases of ``lease`` seconds, for a transaction pooler).
        self.ownership = ownership
        self.lease = float(lease)
        self.ticker: Ticker | None
        if isinstance(ticker, Ticker):
            self.ticker = ticker
        else:
            # Not required: under a role that may not tick the worker runs without
            # ticking (it says so once), relying on another process to tick.
            self.ticker = Ticker(dsn, name=f"{self.name}-ticker",
                                 connect_timeout=connect_timeout,
                                 network_timeout=network_timeout,
                                 required=False, ownership=ownership,
                                 lease=lease) if ticker else None

        self._lock = threading.Lock()  # lanes, their slots and requests, the counters
        self._lanes: list[_Lane[T]] = []
        self._lane_numbers = 0
        self._fatal: BaseException | None = None  # a lane's error that retrying cannot heal
        self._lane_failed_at = -float("inf")  # when a lane last failed to connect
        # By lease: the leases of lanes that ended without ending them (their
        # connection broke): the control ends them, so that their slots need
        # not wait for them to expire (as a dead session's locks go at once).
        self._orphaned_leases: list[Lease] = []
        self._control_lease: Lease | None = None
        self._wake = asyncio.Event()  # a lane ended or failed, or stop
        self.handled = 0  # events whose handler returned
        self.failed = 0  # events whose handler raised (nacked)
        self.record = record
        # The record's name for this worker: its calls and which process made them.
        self.record_name = f"{self.name}@{socket.gethostname()}:{os.getpid()}"[:200]
        self.metrics_host = metrics_host
        self.metrics_port = metrics_port
        #: Where the Prometheus metrics are served, (host, port), while they are.
        self.metrics_address: tuple[str, int] | None = None
        self._metrics_server: MetricsServer | None = None
        registry = None
        if metrics_port is not None:
            try:
                import prometheus_client
            except ImportError:
                raise ImportError("metrics_port needs prometheus-client: "
                                  "pip install 'pgque[prometheus]'") from None
            registry = prometheus_client.CollectorRegistry()
        self._registry = registry
        metrics = Metrics.of(meter_provider, registry)
        #: The worker's instruments (None without OpenTelemetry or metrics_port).
        self.metrics = None if metrics is None else WorkerMetrics(metrics, queue, consumer)
        if metrics is not None and self.ticker is not None and not isinstance(ticker, Ticker):
            # Its own Ticker reports where the worker does (a given one as it was made).
            self.ticker.metrics = TickerMetrics(metrics, self.ticker.name)
        self._served = False  # serve() ran before: the next is a reconnect

    # -- public control ----------------------------------------------------

    @property
    def owned_slots(self) -> frozenset[int]:
        """The slots this worker owns right now."""
        with self._lock:
            return frozenset(slot for lane in self._lanes for slot in lane.slots)

    @property
    def sessions(self) -> int:
        """How many lane sessions the worker has open now (its control session and
        its Ticker's not counted)."""
        with self._lock:
            return sum(1 for lane in self._lanes if lane.pid is not None and lane.alive)

    def request_stop(self) -> None:
        """Ask the worker to finish its current batches, release its slots and exit."""
        super().request_stop()
        self._wake.set()
        with self._lock:
            for lane in self._lanes:
                lane.wake()

    # -- the service -----------------------------------------------------------

    async def setup(self) -> None:
        if self._registry is not None:
            try:
                server = MetricsServer.of_registry(self._registry, self.metrics_host,
                                                   self.metrics_port or 0,
                                                   name=f"{self.name}-metrics")
            except OSError as exc:  # the port is taken, say: the worker does not start
                error = OSError(exc.errno, f"cannot serve metrics on {self.metrics_host}:"
                                           f"{self.metrics_port}: {exc.strerror or exc}")
                self.log.error("%s: %s", self.name, error)
                self.error = error
                self.request_stop()
                return
            server.start()
            self._metrics_server = server
            self.metrics_address = server.address
            self.log.info("%s: metrics on http://%s:%s/metrics", self.name,
                          *self.metrics_address)
        if self.ticker is not None and not self.ticker.alive:
            self.ticker.start()

    def connect_options(self) -> dict[str, Any]:
        """Options of the worker's connections: keepalives; by lease (behind a
        transaction pooler, which may not carry prepared statements from one
        transaction to the next) no prepared statements."""
        options: dict[str, Any] = dict(client_keepalives(self.network_timeout))
        if self.ownership == "lease":
            options["prepare_threshold"] = None
        return options

    async def serve(self) -> None:
        conn = await self.connect(self.dsn, writable=True, **self.connect_options())
        if self._served and self.metrics is not None:
            self.metrics.reconnected()
        self._served = True
        control = _Session(AsyncClient(conn), self.watch(conn, self.network_timeout / 2))
        try:
            # The control session is never idle for long (it rebalances every
            # rebalance_interval), so a long silence means a frozen or lost
            # client: the server ends the session, and the worker stops counting.
            settings = server_timeouts(self.network_timeout,
                                       idle_timeout=max(self.network_timeout * 5 / 6,
                                                        3 * self.rebalance_interval))
            with control.call() as client:
                if self.ownership == "advisory":
                    await client.pin_session(settings)
                await client.subscribe_slots(self.queue, self.consumer, slots=self.slots,
                                             policy=self.failure_policy)
                if self.ownership == "lease":
                    # OwnershipMismatch (fatal) while workers own the group's slots
                    # by advisory lock; its member lease stands for join_group.
                    await client.set_ownership(self.queue, self.consumer, "lease",
                                               lease=self.lease)
                    sent = time.monotonic()
                    lease = await client.take_lease(self.queue, self.consumer, name=self.name,
                                                    member=True)
                    control.lease_deadline = sent + lease_seconds(lease) * LEASE_SAFE_SHARE
                    # The lease of the control before a reconnect would count as a
                    # member until it expired: the worker's share would be halved.
                    if self._control_lease is not None:
                        await client.end_lease(self._control_lease)
                    self._control_lease = lease
                if self.record:
                    try:
                        await client.start_recording(self.queue, self.consumer, self.slots)
                    except psycopg.errors.UndefinedFunction:  # (fatal: the worker stops)
                        raise psycopg.errors.UndefinedFunction(
                            "record=True needs pgque 0.12.0 or later installed in the "
                            "database: run pgque install") from None
                self._pause = await self._group_pauses(client)
                if self.ownership == "advisory":
                    await client.join_group(self.queue, self.consumer)
                if self.listen:
                    cur = await conn.execute("select pgque.tick_channel(%s)", (self.queue,))
                    row = await cur.fetchone()
                    assert row is not None
                    await conn.execute(sql.SQL("listen {}").format(sql.Identifier(row[0])))
            if client.lease is not None:
                self.log.info("%s: connected (control lease %s)", self.name, client.lease.id)
            else:
                self.log.info("%s: connected (control backend pid %s)", self.name,
                              client.pinned_pid)
            # The ticks while no session of the control's listened went unheard
            # (lanes outlive it): every lane looks at its slots now.
            with self._lock:
                for lane in self._lanes:
                    if lane.alive and lane.slots:
                        lane.tick(set(lane.slots))
            await self._control_loop(control)
            await self._finish(control)
            if control.client.lease is not None:
                with control.call() as client:
                    await client.end_lease()
                self._control_lease = None
        finally:
            self.unwatch(control.watch)
            with contextlib.suppress(Exception):  # closing a dead connection may fail
                await conn.close()

    async def _group_pauses(self, client: AsyncClient) -> bool:
        """Whether the group's failure policy is pause; skip on a database that
        has no policies yet (a worker started before the install of 0.6)."""
        try:
            policy = await client.failure_policy(self.queue, self.consumer)
        except psycopg.errors.UndefinedFunction:
            if self.failure_policy == "pause":
                raise
            return False
        return policy.policy == "pause"

    def retryable(self, exc: Exception) -> bool:
        # The worker's own Ticker gave up (it never connected, say): with no
        # ticks nothing would ever be delivered, so the worker stops with it.
        if self.ticker is not None and exc is self.ticker.error:
            return False
        return super().retryable(exc)

    async def cleanup(self) -> None:
        # Also after an error that stopped the worker: the lanes finish and leave.
        self._stop.set()
        with self._lock:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.wake()
        for lane in lanes:
            await lane.join()
        if self.ticker is not None:
            await arun_blocking(self.ticker.stop, 5.0)
        if self._metrics_server is not None:
            await arun_blocking(self._metrics_server.stop)
            self._metrics_server = None
            self.metrics_address = None
        self.log.info("%s: stopped (handled %s events, %s failed)", self.name, self.handled,
                      self.failed)

    # -- the control loop --------------------------------------------------------

    async def _control_loop(self, control: _Session) -> None:
        next_rebalance = next_renewal = 0.0
        while not self.stopping:
            if self._fatal is not None:
                raise self._fatal
            if self.ticker is not None and self.ticker.error is not None:
                self.log.error("%s: its Ticker stopped: %r", self.name, self.ticker.error)
                raise self.ticker.error
            now = time.monotonic()
            if self._orphaned_leases:
                with self._lock:
                    orphans = list(self._orphaned_leases)
                with control.call() as client:
                    for lease in orphans:  # kept until ended: this session may be lost too
                        await client.end_lease(lease)
                        with self._lock:
                            self._orphaned_leases.remove(lease)
            if control.client.lease is not None and now >= next_renewal:
                await self._renew_leases(control)
                next_renewal = now + lease_seconds(control.client.lease) / 3
            if now >= next_rebalance:
                await self._rebalance(control)
                next_rebalance = time.monotonic() + self.rebalance_interval
            left = next_rebalance - time.monotonic()
            await self._wait(control, max(0.0, min(left, STOP_LATENCY)))

    async def _wait(self, control: _Session, timeout: float) -> None:
        """Wait up to ``timeout`` for a tick notification, a lane's end, or a stop.
        A notification carries no information and may be lost (NOTIFY is at most
        once): the lanes' polls stay. On one, with lanes that take their slots in turns, the
        control asks which slots have something to receive (one read-only
        query) and wakes only the lanes that own them: with N slots, most ticks
        hold events of few, and N receives that find nothing would compete with
        the one that does. Lanes that serve all their slots at once (plain
        handlers, the default concurrency) are all woken: each receives every
        slot of its own in one call."""
        if not self.listen:
            await apause(timeout, self._wake)
            self._wake.clear()
            return
        try:
            with control.watch.call() as conn:
                heard = await anotified(conn, timeout)
        except psycopg.OperationalError as exc:
            raise _ConnectionLost(str(exc)) from exc
        if heard:
            owned = self.owned_slots
            if len(owned) > 1 and not self.together:
                with control.call() as client:
                    pending = await client.pending_slots(self.queue, self.consumer)
            else:
                # The answer could only be the one slot; or the lanes receive all
                # their slots in one call each (plain handlers), where a slot with
                # nothing costs less than this query would: no round trip for it.
                pending = owned
            with self._lock:
                for lane in self._lanes:
                    if lane.slots & pending:
                        lane.tick(lane.slots & pending)

    async def _renew_leases(self, control: _Session) -> None:
        """By lease: renew the control's lease and every lane's, in one statement,
        and move their deadlines on. A lane whose lease was not renewed (it
        expired: the lane was cut off, say) has its deadline put at once: it
        ends at its next call, and its slots are claimed again on a new lease.
        LeaseExpired when the control's own lease was not renewed."""
        own = control.client.lease
        assert own is not None
        with self._lock:
            held = [(lane, lane.lease, lane.session) for lane in self._lanes if not lane.lost]
        lanes = [(lane, lease, session) for lane, lease, session in held
                 if lease is not None and session is not None]
        sent = time.monotonic()
        with control.call() as client:
            renewed = await client.renew_leases([own, *(lease for _, lease, _ in lanes)])
        if own.id not in renewed:
            raise LeaseExpired(f"the lease of worker {self.name} expired before its renewal")
        deadline = sent + lease_seconds(own) * LEASE_SAFE_SHARE
        control.lease_deadline = deadline
        for lane, lease, session in lanes:
            if lease.id in renewed:
                session.lease_deadline = max(session.lease_deadline or 0, deadline)
            else:
                self.log.warning("%s: the lease of %s expired", self.name, lane.name)
                session.lease_deadline = sent

    async def _rebalance(self, control: _Session) -> None:
        """Claim free slots up to the fair share; release the surplus. Claims and
        releases are handed to the lanes, which make them on their sessions at
        their next batch boundary."""
        with control.call() as client:
            status = await client.group_status(self.queue, self.consumer)
            # Not counted as a member: the group's membership key was renewed (a
            # session of a role outside the group sat on it), so join again. The
            # server refuses (ConsumerAccessDenied, which stops the worker) when
            # this session's role may no longer use the group.
            if (status.my_rank is None and self.ownership == "advisory"
                    and await client.join_group(self.queue, self.consumer)):
                status = await client.group_status(self.queue, self.consumer)
        share = status.fair_share()
        with self._lock:
            self._lanes = [lane for lane in self._lanes if lane.alive]
            by_pid = {lane.pid: lane for lane in self._lanes if lane.pid is not None}
            owned = {s.slot: by_pid[s.owner_pid] for s in status.slots
                     if s.owner_pid in by_pid}
            claiming = {slot for lane in self._lanes for slot in lane.claims}
            # A lane that lost its session may still run a handler of its slot:
            # that slot is not claimed again until the handler has returned.
            in_hand = {slot for lane in self._lanes for slot in lane.in_hand}
            mine = len(owned) + len(claiming - owned.keys())
            if mine > share:
                releasing = {slot for lane in self._lanes for slot in lane.releases}
                surplus = sorted(set(owned) - releasing, reverse=True)
                for slot in surplus[: max(0, mine - share - len(releasing))]:
                    owned[slot].request_release(slot)
                    self.log.info("%s: releasing slot %s (share %s of %s workers)", self.name,
                                  slot, share, status.members)
            elif mine < share:
                free = [s.slot for s in status.slots if s.owner_pid is None
                        and s.slot not in claiming and s.slot not in in_hand]
                random.shuffle(free)
                for slot in free[: share - mine]:
                    lane = self._lane_for_claim()
                    if lane is None:
                        break
                    lane.request_claim(slot)

    def _lane_for_claim(self) -> _Lane[T] | None:
        """The lane a new slot goes to: an idle one, a new one while there are
        fewer than ``concurrency``, else the connected one with the fewest slots.
        No new lane for a while after one could not connect (the server's
        connection limit, say): the slots then take turns on the lanes that did.
        None when there is no lane to give it to. Holds self._lock."""
        live = [lane for lane in self._lanes if lane.alive and not lane.lost]
        idle = [lane for lane in live if not lane.load]
        if idle:
            return idle[0]
        if (len(live) < self.concurrency
                and time.monotonic() - self._lane_failed_at > self.max_backoff):
            self._lane_numbers += 1
            lane = _Lane(self, self._lane_numbers)
            self._lanes.append(lane)
            lane.start()
            return lane
        connected = [lane for lane in live if lane.pid is not None] or live
        return min(connected, key=lambda lane: lane.load, default=None)

    async def _finish(self, control: _Session) -> None:
        """On stop: the lanes finish their batches (they ack) and release their
        slots. Handlers may take a while: keep the control session talking
        meanwhile, or its idle_session_timeout would end it."""
        with self._lock:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.wake()
        for lane in lanes:
            while await lane.join(self.rebalance_interval):
                try:
                    with control.call() as client:
                        await client.conn.execute("select 1")
                except Exception as exc:
                    self.log.warning("%s: control session lost while finishing: %s", self.name,
                                     exc)
                    await lane.join()
                    break

    # -- called by the lanes ------------------------------------------------------

    def _lane_ended(self, lane: _Lane[T], exc: BaseException | None) -> None:
        if exc is not None and is_fatal(exc):  # SessionUnstable among them
            self._fatal = exc
        if exc is not None and lane.lease is not None and not isinstance(exc, LeaseExpired):
            with self._lock:
                self._orphaned_leases.append(lane.lease)
        if exc is not None and lane.pid is None:
            with self._lock:
                self._lane_failed_at = time.monotonic()
        self._wake.set()

    def _count(self, handled: int, failed: int) -> None:
        with self._lock:
            self.handled += handled
            self.failed += failed


class _Lane(Generic[T]):
    """One session of a worker and the one thread that uses it.

    The lane claims and releases the slots the control asks it to (between two
    batches, on its own session) and works its slots in turns: receive a batch
    piece, run the handler on each event, nack the failures and ack. It ends
    when its session is lost (its slots went with it) or when the worker
    stops (after releasing its slots).
    """

    def __init__(self, worker: AsyncWorker[T], number: int) -> None:
        self.worker = worker
        self.name = f"{worker.name}-lane{number}"
        self.pid: int | None = None  # of its session; by lease, its lease's id
        self.lease: Lease | None = None  # by lease
        self.session: _Session | None = None  # once connected
        self.lost = False
        # Guarded by worker._lock: read by the control thread.
        self.slots: set[int] = set()
        self.claims: set[int] = set()
        self.releases: set[int] = set()
        self.in_hand: set[int] = set()  # the slots whose handlers run now
        self._requests: deque[tuple[str, int]] = deque()
        self._wake = asyncio.Event()
        self._pending: set[int] = set()  # slots the control found work for
        self._idle_until: dict[int, float] = {}
        self._turns: deque[int] = deque()  # slots in round-robin order
        self._ended = asyncio.Event()
        self._thread: ASpawned | None = None
        self._keys = AKeyRunner(worker.key_concurrency, name=f"{self.name}-keys")
        # Plain handlers: each slot's pieces on a runner of their own, side by side.
        self._slot_keys: dict[int, AKeyRunner] = {}
        self._pieces = APieces(worker.slots, name=f"{self.name}-piece")

    # -- from the control thread (under worker._lock) --------------------------

    @property
    def load(self) -> int:
        return len(self.slots | self.claims)

    @property
    def alive(self) -> bool:
        return self._thread is None or arunning(self._thread)

    def start(self) -> None:
        self._thread = aspawn(self._run, name=self.name)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for the lane to end; True while it still runs after ``timeout``."""
        if self._thread is None:
            return False
        await ajoin(self._thread, timeout)
        return arunning(self._thread)

    def request_claim(self, slot: int) -> None:
        self.claims.add(slot)
        self._requests.append(("claim", slot))
        self._wake.set()

    def request_release(self, slot: int) -> None:
        self.releases.add(slot)
        self._requests.append(("release", slot))
        self._wake.set()

    def tick(self, slots: AbstractSet[int]) -> None:
        """The control found work for these slots of the lane: receive now."""
        self._pending |= slots
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # -- the lane's thread ---------------------------------------------------------

    async def _run(self) -> None:
        worker = self.worker
        error: BaseException | None = None
        session: _Session | None = None
        try:
            conn = await worker.connect(worker.dsn, writable=True,
                                        application_name=self.name[:63],
                                        **worker.connect_options())
            session = _Session(AsyncClient(conn),
                               worker.watch(conn, worker.network_timeout / 2))
            if worker.ownership == "lease":
                sent = time.monotonic()
                with session.call() as client:
                    self.lease = await client.take_lease(worker.queue, worker.consumer,
                                                         name=self.name)
                session.lease_deadline = sent + lease_seconds(self.lease) * LEASE_SAFE_SHARE
                self.pid = self.lease.id
                self.session = session
                worker.log.info("%s: connected (lease %s)", self.name, self.pid)
            else:
                settings = server_timeouts(worker.network_timeout,
                                           idle_timeout=max(worker.network_timeout * 5 / 6,
                                                            3 * worker.rebalance_interval))
                if not worker.transactional:
                    # This session only moves cursors (the handlers use their own
                    # connections): a cursor move lost in a server crash means events
                    # delivered again, which at-least-once allows, so its commits need
                    # not wait for a WAL flush. Transactional handlers' writes do.
                    settings["synchronous_commit"] = "off"
                with session.call() as client:
                    self.pid = await client.pin_session(settings)
                self.session = session
                worker.log.info("%s: connected (backend pid %s)", self.name, self.pid)
            if worker.metrics is not None:
                worker.metrics.session(True)
            aspawn(self._heartbeat, session, name=f"{self.name}-beat")
            await self._work(session)
            await self._release_all(session)
        except Stopped:
            pass
        except Exception as exc:
            error = exc
            if isinstance(exc, (psycopg.OperationalError, _ConnectionLost)):
                worker.log.warning("%s: session lost: %s", self.name, exc)
            else:
                worker.log.error("%s: %r", self.name, exc)
        finally:
            self.lost = True
            self._ended.set()
            await self._pieces.close()
            await self._keys.close()
            for runner in self._slot_keys.values():
                await runner.close()
            with worker._lock:
                if worker.metrics is not None:
                    for slot in self.slots:  # still ours: gone with the session
                        worker.metrics.released(slot, lost=True)
                    if self.pid is not None:
                        worker.metrics.session(False)
                        if error is not None:
                            worker.metrics.reconnected()
                self.slots.clear()
                self.claims.clear()
                self.releases.clear()
                self.in_hand.clear()
            if session is not None:
                worker.unwatch(session.watch)
                with contextlib.suppress(Exception):
                    await session.client.conn.close()
            worker._lane_ended(self, error)

    async def _heartbeat(self, session: _Session) -> None:
        """While a step runs (handlers may take long), keep the session talking:
        a cheap query whenever it was quiet for a rebalance interval. It keeps
        idle_session_timeout from ending a session whose handlers are slow, and
        it is how a network that went silent shows between two events: the
        query gets no answer, the watchdog gives the session up (within half of
        network_timeout), and the step stops before its next event. A frozen
        process freezes this thread too, so its sessions still go silent."""
        interval = self.worker.rebalance_interval
        conn = session.client.conn
        while not await apause(min(interval / 2, STOP_LATENCY), self._ended):
            if not self.in_hand or time.monotonic() - session.last_used < interval:
                continue
            # A transactional handler's query in flight (say, waiting for a row
            # lock) keeps the session busy already: never queue behind it, or
            # the watchdog would take the wait for a dead network.
            if conn.lock.locked():
                continue
            try:
                with session.call() as client:
                    await client.conn.execute("select 1")
            except (psycopg.OperationalError, _ConnectionLost) as exc:
                # The lane sees it after the handler in hand returns.
                self.worker.log.warning("%s: session lost (heartbeat): %s", self.name, exc)
                return
            except psycopg.Error:
                pass  # say, inside a failed transaction of a handler: the lane's to sort out

    async def _work(self, session: _Session) -> None:
        worker = self.worker
        if worker.together:
            await self._work_together(session)
            return
        keepalive = worker.network_timeout / 3
        last_call = time.monotonic()
        while not worker.stopping and worker._fatal is None:
            if await self._serve_requests(session):
                last_call = time.monotonic()
            with worker._lock:
                pending, self._pending = self._pending, set()
            for ready in pending:  # a new tick with work for them: no waiting out a poll
                self._idle_until.pop(ready, None)
            slot = self._next_slot()
            if slot is None:
                now = time.monotonic()
                if now - last_call > keepalive:  # an idle lane keeps its session
                    with session.call() as client:
                        await client.conn.execute("select 1")
                    last_call = now
                due = min(self._idle_until.values(), default=now + keepalive)
                await apause(max(0.0, min(due - now, STOP_LATENCY, keepalive)), self._wake)
                self._wake.clear()
                continue
            with worker._lock:
                self.in_hand.add(slot)
            try:
                found = await self._step(slot, session)
            except SlotNotOwned:
                worker.log.warning("%s: slot %s is no longer ours", self.name, slot)
                self._drop(slot)
                found = True
            finally:
                with worker._lock:
                    self.in_hand.discard(slot)
            last_call = time.monotonic()
            with worker._lock:
                waits = not found and slot not in self._pending  # no work came meanwhile
            if waits:
                self._idle_until[slot] = time.monotonic() + worker.poll_interval

    async def _work_together(self, session: _Session) -> None:
        """The loop of a lane with plain handlers: every slot of the lane at once.

        The handlers do not use the session, so the lane's slots need not take
        turns on it: one ``receive_slots`` receives a piece of every due slot,
        each piece is handled on its own (in order per key, side by side across
        slots and, up to ``key_concurrency``, across keys), and whatever pieces
        have finished by the lane's next call are acked by one ``ack_slots``
        (the failures' nacks with them), while the other pieces go on. So a
        worker's calls and transactions grow with its ticks and pieces, not with
        its slots. A piece that finished alone, with nothing else in hand or
        due, is acked together with its slot's next receive (one round trip).
        On stop, or on an error of a piece, no new piece starts; the pieces in
        hand are waited for (the ones left are acked on stop, never on error:
        they come again to the slot's next owner)."""
        worker = self.worker
        keepalive = worker.network_timeout / 3
        last_call = time.monotonic()
        running: dict[int, _Piece[T]] = {}
        # Finished pieces without failures whose acks wait for the lane's next
        # call (at most ACK_DELAY): they ride along with it.
        held: dict[int, _Piece[T]] = {}
        held_since = 0.0
        error: BaseException | None = None
        try:
            while True:
                ending = worker.stopping or worker._fatal is not None or error is not None
                if ending and not running and not held:
                    break
                acted = False
                if not ending:
                    acted = await self._serve_requests(session,
                                                       busy=running.keys() | held.keys())
                with worker._lock:
                    pending, self._pending = self._pending, set()
                for ready in pending:  # a new tick with work for them: no waiting out a poll
                    self._idle_until.pop(ready, None)
                    if ready in running:
                        running[ready].ticked = True
                    elif ready in held:
                        held[ready].ticked = True
                finished = [piece for piece in running.values() if piece.done]
                for piece in finished:
                    del running[piece.slot]
                    if piece.error is not None and error is None:
                        error = piece.error
                self._settled(finished)  # their handlers have returned
                if error is not None:
                    # Nothing more on this session: the pieces in hand end at their
                    # next event (the session is seen gone) or finish; none is acked.
                    held.clear()
                    if running:
                        await apause(STOP_LATENCY, self._wake)
                        self._wake.clear()
                    continue
                failed = []
                for piece in finished:
                    assert piece.failures is not None
                    if piece.failures.reasons:
                        failed.append(piece)
                    else:
                        if not held:
                            held_since = time.monotonic()
                        held[piece.slot] = piece
                now = time.monotonic()
                with worker._lock:
                    leaving = set(self.releases)  # asked to go: no new piece for them
                busy = (running.keys() | held.keys() | {piece.slot for piece in failed}
                        | leaving)
                due = [] if ending else [slot for slot in self._turns if slot not in busy
                                         and self._idle_until.get(slot, 0.0) <= now]
                if failed:
                    # Their nacks and acks in one transaction, now.
                    acted = True
                    flags = await self._ack_pieces(session, failed)
                    assert isinstance(flags, list)
                    idle_until = self._next_poll()
                    for piece, batch_ended in zip(failed, flags, strict=True):
                        if ending or piece.slot not in self.slots or piece.slot in leaving:
                            continue
                        if batch_ended and not piece.ticked and not piece.ahead:
                            self._idle_until[piece.slot] = idle_until
                        else:
                            due.append(piece.slot)
                if held and (ending or due or self._requests or leaving & held.keys()
                             or now - held_since >= ACK_DELAY
                             or any(p.ticked or p.ahead for p in held.values())):
                    acted = True
                    acks = list(held.values())
                    held.clear()
                    if (len(acks) == 1 and not due and len(self.slots) == 1
                            and not (ending or leaving)):
                        # A lane of one slot: the ack carries the slot's next receive.
                        more = await self._ack_pieces(session, acks, fuse=True)
                        if isinstance(more, Batch):
                            self._start_piece(more, session, running)
                        elif acks[0].slot in self.slots:
                            self._idle_until[acks[0].slot] = self._next_poll()
                        last_call = time.monotonic()
                        continue
                    # The acked slots are received again in the same call: while a
                    # backlog drains, their next batches are there already.
                    again = [] if ending else [p.slot for p in acks if p.slot in self.slots
                                               and p.slot not in leaving]
                    await self._receive_due(session, sorted(set(due) | set(again)), running,
                                            acks)
                elif due:
                    acted = True
                    await self._receive_due(session, sorted(set(due)), running)
                if acted:
                    last_call = time.monotonic()
                    continue
                now = time.monotonic()
                if not running and not held and now - last_call > keepalive:
                    # An idle lane keeps its session.
                    with session.call() as client:
                        await client.conn.execute("select 1")
                    last_call = now
                # Until the next poll of a slot that may go on (none while ending:
                # only the pieces in hand, which wake the lane, are waited for).
                polls = [] if ending else [at for slot, at in self._idle_until.items()
                                           if slot not in running]
                if held:
                    polls.append(held_since + ACK_DELAY)
                wait = min(polls, default=now + keepalive) - now
                await apause(max(0.0, min(wait, STOP_LATENCY, keepalive)), self._wake)
                self._wake.clear()
        except BaseException as exc:
            if acancelled(exc):  # (under asyncio) the lane is cancelled, and so are its pieces
                self._pieces.cancel()
            raise
        finally:
            if running:  # the lane itself failed (its session, say): let the pieces end
                await self._pieces.close()
                with worker._lock:
                    self.in_hand.clear()
        if error is not None:
            raise error

    def _next_poll(self) -> float:
        """When a slot that found nothing polls again: at least poll_interval from
        now, on a grid of the lane's, so that its idle slots poll together (one
        receive for them all, not one each)."""
        interval = self.worker.poll_interval
        return (time.monotonic() // interval + 2) * interval

    def _start_piece(self, batch: Batch[T], session: _Session,
                     running: dict[int, _Piece[T]], *, ahead: bool = True) -> None:
        assert batch.slot is not None
        piece = _Piece(batch, ahead)
        running[piece.slot] = piece
        self._idle_until.pop(piece.slot, None)  # in hand: not waiting out a poll
        keys = self._slot_keys.get(piece.slot)
        if keys is None:
            keys = self._slot_keys[piece.slot] = AKeyRunner(
                self.worker.key_concurrency, name=f"{self.name}-s{piece.slot}-keys")
        with self.worker._lock:
            self.in_hand.add(piece.slot)
        self._pieces.start(self._run_piece, piece, session, keys)

    async def _run_piece(self, piece: _Piece[T], session: _Session, keys: AKeyRunner) -> None:
        """A piece's handlers (on a thread of the lane's pieces; under asyncio, a
        task); the outcome is left in the piece for the lane, which it wakes."""
        try:
            piece.failures = await self._handle(piece.batch, session, None, keys)
        except BaseException as exc:  # the lane's to act on (it ends on any of them)
            piece.error = exc
        finally:
            piece.done = True
            self._wake.set()

    def _settled(self, pieces: list[_Piece[T]]) -> None:
        """These pieces' handlers have returned: their slots may move again."""
        with self.worker._lock:
            for piece in pieces:
                self.in_hand.discard(piece.slot)

    async def _receive_due(self, session: _Session, due: list[int],
                           running: dict[int, _Piece[T]],
                           acks: list[_Piece[T]] | None = None) -> None:
        """One call that acks the finished pieces ``acks`` (none: no ack) and
        receives for the due slots; a piece starts for each that has one, the
        others wait out their poll interval (a tick that comes clears that)."""
        worker = self.worker
        batches: list[Batch[Any]]
        ahead: set[int]
        acked = [piece.batch for piece in acks or ()]
        if worker.record and acks:
            await self._record(session, [(piece.batch, piece.failures) for piece in acks
                                         if piece.failures is not None])
        try:
            with session.call() as client:
                batches, ahead = await client._receive_slot_pieces(
                    worker.queue, worker.consumer, worker.slots, due, worker.max_events,
                    worker.payload_type, acked=acked)
        except SlotNotOwned:
            # One of them is no longer ours (nothing was acked or received): find
            # which, slot by slot, and let it go.
            if acks:
                await self._ack_pieces(session, acks)
            batches, ahead = [], set()
            for slot in due:
                if slot not in self.slots:
                    continue
                try:
                    with session.call() as client:
                        got, more = await client._receive_slot_pieces(
                            worker.queue, worker.consumer, worker.slots, [slot],
                            worker.max_events, worker.payload_type)
                    batches += got
                    ahead |= more
                except SlotNotOwned:
                    worker.log.warning("%s: slot %s is no longer ours", self.name, slot)
                    self._drop(slot)
        got_slots = set()
        for batch in batches:
            assert batch.slot is not None
            got_slots.add(batch.slot)
            self._start_piece(batch, session, running, ahead=batch.slot in ahead)
        # (A tick that comes from now on clears this at the lane's next turn.)
        idle_until = self._next_poll()
        for slot in due:
            if slot not in got_slots and slot in self.slots:
                self._idle_until[slot] = idle_until

    async def _record(self, session: _Session, done: list[tuple[Batch[T], _Failures]]) -> None:
        """Write the handler calls of these pieces to the group's record
        (Worker(record=True)), in one call and a transaction of its own (or the
        one open on the session: a transactional handler's), before their ack:
        an acked event has its call on record, and a worker that dies in
        between has its events handled again and recorded again."""
        calls = []
        for batch, failures in done:
            if failures.calls:
                calls += [(batch, *call) for call in failures.calls]
            failures.calls = None  # written once, whatever comes of the ack
        if calls:
            with session.call() as client:
                await client._record_calls(self.worker.record_name, calls)

    async def _ack_pieces(self, session: _Session, pieces: list[_Piece[T]], *,
                          fuse: bool = False) -> Batch[T] | list[bool]:
        """Ack finished pieces (and nack their failures) in one transaction; for
        each, whether that ended its batch. With ``fuse`` (one piece, nothing
        else to do) the ack also receives its slot's next piece: returned when
        there is one. A slot found no longer ours is let go (its piece comes
        again to its new owner) and counts as ended."""
        worker = self.worker
        if worker.record:
            await self._record(session, [(piece.batch, piece.failures) for piece in pieces
                                         if piece.failures is not None])
        try:
            with session.call() as client:
                if fuse and len(pieces) == 1:
                    failures = pieces[0].failures
                    assert failures is not None
                    after = await client.ack_and_receive(
                        pieces[0].batch, nack=failures.reasons,
                        retry_after=failures.retry_after, dead=failures.dead,
                        max_events=worker.max_events, payload_type=worker.payload_type)
                    return [True] if after is None else after
                if all(piece.failures is not None and not piece.failures.reasons
                       for piece in pieces):
                    return await client.ack_slots([piece.batch for piece in pieces])
                ended: dict[int, bool] = {}
                async with client.conn.transaction():
                    for piece in sorted(pieces, key=lambda p: p.slot):  # the lock order
                        failures = piece.failures
                        assert failures is not None
                        ended[piece.slot] = await client.ack(
                            piece.batch, nack=failures.reasons,
                            retry_after=failures.retry_after, dead=failures.dead)
                return [ended[piece.slot] for piece in pieces]
        except SlotNotOwned:
            if len(pieces) == 1:
                worker.log.warning("%s: slot %s is no longer ours", self.name, pieces[0].slot)
                self._drop(pieces[0].slot)
                return [True]
            flags: list[bool] = []
            for piece in pieces:  # which one: each on its own
                one = await self._ack_pieces(session, [piece])
                assert isinstance(one, list)
                flags += one
            return flags

    async def _serve_requests(self, session: _Session,
                              busy: AbstractSet[int] = frozenset()) -> bool:
        """Make the claims and releases the control asked for; True if any. The
        release of a ``busy`` slot (its piece still in hand) waits for its ack."""
        worker = self.worker
        served = False
        deferred: list[tuple[str, int]] = []
        while True:
            with worker._lock:
                if not self._requests:
                    self._requests.extend(deferred)
                    return served
                op, slot = self._requests.popleft()
                if slot in busy:
                    deferred.append((op, slot))
                    continue
            served = True
            with session.call() as client:
                if op == "claim":
                    claimed = await client.claim_slot(worker.queue, worker.consumer, slot)
                else:
                    await client.release_slot(worker.queue, worker.consumer, slot)
            with worker._lock:
                if op == "claim":
                    self.claims.discard(slot)
                    if claimed:
                        self.slots.add(slot)
                        if worker.metrics is not None:
                            worker.metrics.claimed(slot)
                        self._turns.append(slot)
                        self._idle_until.pop(slot, None)
                else:
                    self.releases.discard(slot)  # served, whether or not it was ours
                    if slot in self.slots:
                        self._drop_locked(slot, lost=False)
            if op == "claim" and claimed:
                worker.log.info("%s: claimed slot %s", self.name, slot)
            elif op == "release":
                worker.log.info("%s: released slot %s", self.name, slot)

    def _next_slot(self) -> int | None:
        """The next slot in turn that is not waiting out its poll interval."""
        now = time.monotonic()
        for _ in range(len(self._turns)):
            slot = self._turns[0]
            self._turns.rotate(-1)
            if self._idle_until.get(slot, 0.0) <= now:
                return slot
        return None

    def _drop(self, slot: int, *, lost: bool = True) -> None:
        with self.worker._lock:
            self._drop_locked(slot, lost=lost)

    def _drop_locked(self, slot: int, *, lost: bool = True) -> None:
        """The slot is no longer the lane's: released, or ``lost`` (found owned by
        another)."""
        if slot in self.slots and self.worker.metrics is not None:
            self.worker.metrics.released(slot, lost=lost)
        self.slots.discard(slot)
        self.releases.discard(slot)  # a release asked of it has nothing left to do
        self._idle_until.pop(slot, None)
        with contextlib.suppress(ValueError):
            self._turns.remove(slot)

    async def _step(self, slot: int, session: _Session) -> bool:
        """One step of a slot of a lane that takes its slots in turns: receive a
        batch piece, handle its events in order, then nack the failures and ack
        in one transaction (which, for a transactional handler, also holds the
        handler's writes); while the lane has nothing else to do, the ack of a
        plain handler's piece also receives the slot's next piece. Returns False
        when the slot's last receive found nothing (it then waits out its poll
        interval), True when it may have more."""
        worker = self.worker
        with session.call() as client:
            batch = await client.receive_partitioned(
                worker.queue, worker.consumer, slot=slot, slots=worker.slots,
                max_events=worker.max_events, payload_type=worker.payload_type)
        if batch is None:
            return False
        if worker.transactional:
            conn = session.client.conn
            async with conn.transaction():
                failures = await self._handle(batch, session, conn, self._keys)
                if batch.messages:
                    # Releasing the last event's savepoint fails when a handler
                    # ended the worker's transaction and began another (whose
                    # status alone looks the same): then HandlerEndedTransaction,
                    # not an ack in the handler's transaction. One statement a batch.
                    await _on_savepoint(conn, "release savepoint pgque_event")
                if worker.record:  # in the ack's transaction
                    await self._record(session, [(batch, failures)])
                with session.call() as client:
                    await client.ack(batch, nack=failures.reasons,
                                     retry_after=failures.retry_after, dead=failures.dead)
            return True
        while True:
            failures = await self._handle(batch, session, None, self._keys)
            if worker.record:
                await self._record(session, [(batch, failures)])
            with session.call() as client:
                if not self._stays_on(slot):
                    await client.ack(batch, nack=failures.reasons,
                                     retry_after=failures.retry_after, dead=failures.dead)
                    return True
                # The lane's next step is this slot again: the ack carries its
                # receive (one round trip and one commit a piece, not two).
                next_batch = await client.ack_and_receive(
                    batch, nack=failures.reasons, retry_after=failures.retry_after,
                    dead=failures.dead, max_events=worker.max_events,
                    payload_type=worker.payload_type)
            if next_batch is None:
                return False  # acked, and the slot has nothing more: it waits its poll
            batch = next_batch

    def _stays_on(self, slot: int) -> bool:
        """Whether the lane would step this slot next anyway: no claim or release
        asked of it, no stop, and none of its other slots due."""
        worker = self.worker
        if worker.stopping or worker._fatal is not None:
            return False
        now = time.monotonic()
        with worker._lock:
            if self._requests or slot not in self.slots:
                return False
            return all(other == slot or (other not in self._pending
                                         and self._idle_until.get(other, 0.0) > now)
                       for other in self._turns)

    async def _handle(self, batch: Batch[T], session: _Session,
                      conn: AsyncConn | None, keys: AKeyRunner) -> _Failures:
        """Run the handler on each event of the batch (for a transactional handler,
        each in a savepoint of ``conn``'s transaction); returns the failed events
        (their reasons, delays and those not to retry). Raises _ConnectionLost
        when the session was seen gone between events: whoever owns the slot
        next gets the batch again."""
        worker = self.worker
        result = _Failures(worker.retry_after, record=worker.record)
        calls = result.calls
        failures = result.reasons
        handled: list[int] = []  # ids; appended from the runner's threads (atomic)
        # Under the pause policy, the keys with a failed event in this piece: their
        # later events are not handled but nacked with it, so that the server
        # holds them behind it, in order. (A key's events run on one thread, in
        # order, so the set is read after its own key's failure was added.)
        blocked: dict[str, int] = {}
        held = 0

        async def handle(index: int, message: Message[T]) -> None:
            nonlocal held
            if index and session.gone():
                worker.log.warning("%s: session gone; slot %s stops before event %s",
                                   self.name, batch.slot, message.id)
                raise _ConnectionLost("session gone during a batch")
            key = message.partition_key
            if key is not None and key in blocked:
                failures[message.id] = f"held: event {blocked[key]} of its key failed"
                held += 1
                return
            # The record's times: the start by the clock, the end by the start
            # and the call's length on the monotonic clock (a clock step during
            # the call moves both).
            started, began = time.time(), time.monotonic()
            try:
                if conn is None:
                    await ahandler_result(worker.handler(message))  # type: ignore[call-arg]
                else:
                    await self._handle_in_savepoint(message, conn, first=index == 0)
            except (HandlerEndedTransaction, HandlerReturnedAwaitable, _ConnectionLost):
                raise  # no ack: they end the lane (the first two the worker)
            except BaseException as exc:  # also CancelledError & co: the event failed
                if acancelled(exc):
                    # Not the handler's failure: this lane (under asyncio, its
                    # task) is cancelled. Nothing nacked, nothing acked: the
                    # batch comes again, whole, to the slot's next owner.
                    raise
                if conn is not None and conn.broken:
                    raise _ConnectionLost(f"session gone during a handler: {exc}") from exc
                dead = isinstance(exc, worker.non_retryable)
                if calls is not None:
                    calls.append((message, started, started + time.monotonic() - began,
                                  "dead" if dead else "failed"))
                # Expected under the skip policy, hence a warning. The traceback
                # is what a developer needs to fix the handler: logged at the
                # event's first failure only, its retries get one line each.
                worker.log.warning(
                    "%s: handler failed for event %s (key %r, slot %s, retry %s%s): %r",
                    self.name, message.id, message.partition_key, batch.slot,
                    message.retry_count, ", not retryable: to the dead letters" if dead else "",
                    exc, exc_info=message.retry_count == 0)
                result.failed(message, exc, dead=dead)
                if worker._pause and key is not None:
                    blocked[key] = message.id
            else:
                if calls is not None:
                    calls.append((message, started, started + time.monotonic() - began, "ok"))
                handled.append(message.id)

        # One event at a time, or with key_concurrency up to that many keys at
        # once (never two events of one key): the runner stops every key at its
        # next event when one raises, and raises that once the others return.
        began = time.monotonic()
        try:
            await keys.run(batch.messages, _partition_key, handle)
        finally:
            worker._count(len(handled), len(failures) - held)  # one lock a batch, not an event
        if worker.metrics is not None:
            ended = time.monotonic()
            worker.metrics.piece(batch, failures, result.dead, time.time() - (ended - began),
                                 ended - began)
        return result

    async def _handle_in_savepoint(self, message: Message[T], conn: AsyncConn, *,
                                   first: bool) -> None:
        """Run a transactional handler in a savepoint of the lane's transaction:
        on failure only its own writes roll back. A handler that returns with the
        transaction in error (it caught an SQL error) has failed too. A handler
        that ended the transaction (COMMIT or ROLLBACK) broke the promise that
        its writes commit with the ack: HandlerEndedTransaction, and no ack.
        One round trip per event: the statement that opens the event's savepoint
        releases the one before it (the commit releases the last)."""
        await _on_savepoint(conn, "savepoint pgque_event" if first
                            else "release savepoint pgque_event; savepoint pgque_event")
        try:
            await ahandler_result(self.worker.handler(message, conn))  # type: ignore[call-arg]
        except BaseException:
            await _on_savepoint(conn, "rollback to savepoint pgque_event")
            raise
        if await _check_transaction(conn) == psycopg.pq.TransactionStatus.INERROR:
            await _on_savepoint(conn, "rollback to savepoint pgque_event")
            raise HandlerFailed("the handler returned with its transaction in error (it "
                                "caught an SQL error without rolling back to a savepoint)")

    async def _release_all(self, session: _Session) -> None:
        """On stop: release every slot of the lane, so others may take them at once."""
        worker = self.worker
        with worker._lock:
            slots = sorted(self.slots)
        try:
            if self.lease is not None:  # by lease: its end releases them all at once
                with session.call() as client:
                    await client.end_lease()
                for slot in slots:
                    self._drop(slot, lost=False)
                return
            for slot in slots:
                with session.call() as client:
                    await client.release_slot(worker.queue, worker.consumer, slot)
                self._drop(slot, lost=False)
        except (psycopg.Error, _ConnectionLost) as exc:
            worker.log.warning("%s: could not release slots cleanly: %s", self.name, exc)


class _Piece(Generic[T]):
    """A slot's batch piece in the hands of a lane with plain handlers, and its
    outcome once ``done``: the failed events, or the error that ends the lane."""

    def __init__(self, batch: Batch[T], ahead: bool) -> None:
        assert batch.slot is not None
        self.batch = batch
        self.slot: int = batch.slot
        # Its batch ends before the queue's newest tick: once acked, the slot's
        # next batch is there already.
        self.ahead = ahead
        self.failures: _Failures | None = None
        self.error: BaseException | None = None
        self.done = False
        self.ticked = False  # a tick came for the slot while the piece was in hand


class _Failures:
    """The failed events of a piece, as its ack takes them: reasons by id, each
    one's delay when the Worker's retry_after depends on the event (a Backoff,
    or by exception class), and those not to retry."""

    def __init__(self, retry_after: RetryDelay, *, record: bool = False) -> None:
        # The handler calls for the record (Worker(record=True)): each
        # (message, started, ended, outcome), times by time.time(); None once
        # written, or when not recording.
        self.calls: list[tuple[Message[Any], float, float, str]] | None = [] if record else None
        self.reasons: dict[int, str] = {}
        self.dead: list[int] = []
        self._retry_after = retry_after
        self._varies = not isinstance(retry_after, (int, float, timedelta))
        self._delays: dict[int, float] = {}

    def failed(self, message: Message[Any], exc: BaseException, *, dead: bool) -> None:
        self.reasons[message.id] = failure_reason(exc)
        if dead:
            self.dead.append(message.id)
        elif self._varies:
            self._delays[message.id] = delay_for(self._retry_after, message.retry_count, exc)

    @property
    def retry_after(self) -> float | timedelta | dict[int, float]:
        """For the ack: one delay for all (the usual, and the call of 0.5), or
        one per failed event."""
        if self._varies:
            return self._delays
        assert isinstance(self._retry_after, (int, float, timedelta))
        return self._retry_after


class HandlerFailed(Exception):
    """A transactional handler returned, but its event failed anyway."""


async def _check_transaction(conn: AsyncConn) -> psycopg.pq.TransactionStatus:
    """Whether the worker's transaction is still there after a handler: a lost
    session is _ConnectionLost (the heartbeat may have found out first), a
    transaction the handler ended is HandlerEndedTransaction."""
    # Under the connection's lock: the lane's heartbeat may have a query in
    # flight on it (the status would read ACTIVE meanwhile).
    async with conn.lock:
        status = conn.info.transaction_status
    if conn.broken or conn.closed or status == psycopg.pq.TransactionStatus.UNKNOWN:
        raise _ConnectionLost("session gone during a handler")
    if status not in (psycopg.pq.TransactionStatus.INTRANS,
                      psycopg.pq.TransactionStatus.INERROR):
        raise HandlerEndedTransaction(
            f"a transactional handler ended the worker's transaction (COMMIT or ROLLBACK; "
            f"the transaction status is {status.name}): its batch is not acked; leave the "
            f"transaction to the worker")
    return status


async def _on_savepoint(conn: AsyncConn, statement: str) -> None:
    """Run a statement on the worker's savepoint, once the handler is known to
    have left the transaction to the worker."""
    await _check_transaction(conn)
    try:
        await conn.execute(statement.encode())
    except psycopg.errors.InvalidSavepointSpecification as exc:  # released by the handler
        raise HandlerEndedTransaction(
            f"a transactional handler released the worker's savepoint: {exc}") from exc


def _partition_key(message: Message[T]) -> str | None:
    return message.partition_key


def failure_reason(exc: BaseException) -> str:
    """The reason stored with a failed event: the exception's type and message,
    cut to 1,000 characters and made storable (no NUL, no lone surrogates), so
    that no exception can stop its event from being nacked."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # a __str__ that raises
        text = f"{type(exc).__name__}: <unprintable>"
    text = text.replace("\x00", "\\0")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:1000]
