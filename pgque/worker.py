"""The partitioned consumer: a Worker owns some slots of a consumer group and
handles their events, one event at a time per slot, slots in parallel.

How slots are shared
--------------------
There is no leader and no assignor. Each worker joins the group (a shared
advisory lock, so workers can count each other) and claims free slots with a
non-blocking ``pg_try_advisory_lock`` until it owns its fair share:
``N // M`` for M live workers, plus one for the first ``N % M`` of them by
backend pid, so the shares always add up to N. A worker that owns more than its share releases
the surplus at a batch boundary, and newcomers pick those slots up. A worker
that dies loses its session and with it its locks: its slots are free at once.

Why this is safe
----------------
Correctness does not rest on this module. The server refuses receive, ack and
nack of a slot from a session that does not hold the slot's lock, and the
receive lock hands a second receiver the same open batch, never another. So
the worst a bug here can do is spread slots badly or stall; it cannot let two
workers hold the same slot or ack a batch somebody else owns.

Failures
--------
A handler that raises has its event nacked (the *skip* policy): the event goes
to the slot's retry queue, the rest of the batch proceeds, and the nacks and
the ack of the batch commit in one transaction. Delivery is at least once;
handlers must be idempotent. When the connection goes away every slot is lost
with it: in-flight batches are dropped unacked (they will be delivered again),
the worker reconnects with backoff, rejoins and claims again. A batch stops at
the next event as soon as its session is seen gone (a check of the idle
socket between events, no round trip), so after a takeover at most the event
already in flight overlaps the new owner. Errors that retrying cannot heal (a
wrong slot count, an unknown queue, a pooler swapping the session) stop the
worker: ``run()`` raises them and :attr:`Worker.error` keeps them.

Network
-------
``network_timeout`` (30 s) bounds how long a worker whose network went silent
(no FIN: a partition, a dead host) keeps its slots: the server ends its
session within that time (TCP keepalives and ``tcp_user_timeout`` set on the
session), and the client side gives up at about half of it, so the cut-off
worker stops handling before its slots can move. A worker frozen with its
network fine (SIGSTOP, a debugger) is bounded the same way: its session falls
silent, and ``idle_session_timeout`` ends it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Generic, TypeVar

import psycopg
from psycopg import sql

from pgque.client import Client, open_connection
from pgque.errors import SessionUnstable, SlotNotOwned
from pgque.lifecycle import (
    STOP_LATENCY,
    CallWatch,
    Service,
    client_keepalives,
    is_fatal,
    server_timeouts,
)
from pgque.ticker import Ticker
from pgque.types import Batch, Message

__all__ = ["Worker"]

T = TypeVar("T")
Handler = Callable[[Message[T]], object]


class _ConnectionLost(Exception):
    """The worker's session ended; every slot it owned is gone with it."""


class _Session:
    """One connected session of the worker: the client over it, and the watch on
    its calls (see CallWatch). Slot steps hold on to the session they started
    on, so a step of an old session never acks on a new one."""

    def __init__(self, client: Client, watch: CallWatch) -> None:
        self.client = client
        self.watch = watch

    @property
    def lost(self) -> bool:
        return self.watch.lost

    @contextlib.contextmanager
    def call(self) -> Iterator[Client]:
        """A call on the session: timed by the watchdog, refused once it is lost."""
        if self.watch.lost:
            raise _ConnectionLost("session gone")
        with self.watch.call():
            yield self.client

    def gone(self) -> bool:
        return self.watch.gone()


class Worker(Service, Generic[T]):
    """Consume a queue as one member of a partitioned consumer group.

    ``handler`` is called with each :class:`~pgque.Message`; the events of one
    slot are handled strictly one after another, and up to ``concurrency``
    slots at the same time. By default the worker also runs a
    :class:`~pgque.Ticker` (pass ``ticker=False`` when something else ticks, or
    a configured Ticker) and listens for tick notifications (``listen``), with
    ``poll_interval`` as the fallback when a notification is lost.

    ``run()`` blocks until :meth:`stop` (or SIGTERM / SIGINT when run in the
    main thread) and raises the error that stopped the worker, if any;
    ``start()`` runs the same loop in a background thread (see ``error``). A
    Worker is also a context manager: start on enter, stop on exit.
    """

    log = logging.getLogger("pgque.worker")

    def __init__(
        self,
        dsn: str,
        *,
        queue: str,
        consumer: str,
        slots: int,
        handler: Handler[T],
        concurrency: int | None = None,
        payload_type: type[T] | None = None,
        max_events: int = 100,
        poll_interval: float = 0.2,
        retry_after: float | timedelta = 5.0,
        rebalance_interval: float = 1.0,
        ticker: bool | Ticker = True,
        listen: bool = True,
        connect_timeout: float = 30.0,
        network_timeout: float = 30.0,
        name: str | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if network_timeout < 2:
            raise ValueError("network_timeout must be at least 2 seconds")
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        if (retry_after.total_seconds() if isinstance(retry_after, timedelta)
                else retry_after) < 0:
            raise ValueError("retry_after must not be negative")
        super().__init__(name or f"pgque-worker-{queue}-{consumer}",
                         connect_timeout=connect_timeout)
        self.dsn = dsn
        self.queue = queue
        self.consumer = consumer
        self.slots = slots
        self.handler = handler
        self.concurrency = concurrency or slots
        self.payload_type = payload_type
        self.max_events = max_events
        self.poll_interval = poll_interval
        self.retry_after = retry_after
        self.rebalance_interval = rebalance_interval
        self.listen = listen
        self.network_timeout = network_timeout

        self._wake = threading.Event()  # a slot step finished, a tick was announced, or stop
        # Tick notifications heard so far (only the listener thread counts). A
        # slot step that comes back empty goes idle only if no tick was heard
        # while it ran: otherwise the tick it missed would wait a whole poll.
        self._ticks_heard = 0
        self._ticks_acted_on = 0
        self._heard_at_start: dict[int, int] = {}
        self.ticker: Ticker | None
        if isinstance(ticker, Ticker):
            self.ticker = ticker
        else:
            self.ticker = Ticker(dsn, name=f"{self.name}-ticker",
                                 connect_timeout=connect_timeout,
                                 network_timeout=network_timeout) if ticker else None
        self._executor: ThreadPoolExecutor | None = None
        self._session: _Session | None = None
        self._owned: set[int] = set()
        self._busy: dict[int, Future[bool]] = {}
        self._idle_until: dict[int, float] = {}
        self._last_started: dict[int, float] = {}  # round robin when slots outnumber threads
        self._lock = threading.Lock()
        self.handled = 0  # events whose handler returned
        self.failed = 0  # events whose handler raised (nacked)

    # -- public control ----------------------------------------------------

    @property
    def owned_slots(self) -> frozenset[int]:
        """The slots this worker owns right now."""
        with self._lock:
            return frozenset(self._owned)

    def request_stop(self) -> None:
        """Ask the worker to finish its current batches, release its slots and exit."""
        super().request_stop()
        self._wake.set()

    # -- the service -----------------------------------------------------------

    def setup(self) -> None:
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix=self.name)
        if self.ticker is not None and not self.ticker.alive:
            self.ticker.start()
        if self.listen:
            threading.Thread(target=self._listen, name=f"{self.name}-listener",
                             daemon=True).start()

    def serve(self) -> None:
        conn = self.connect(self.dsn, **client_keepalives(self.network_timeout))
        # A call unanswered for half the network timeout means a network that
        # no TCP timeout sees (a stalled middlebox or pooler): give up on the
        # session before the server ends it and the slots move.
        session = _Session(Client(conn), self.watch(conn, self.network_timeout / 2))
        try:
            client = session.client
            # The session is never idle for long (it rebalances every
            # rebalance_interval), so a long silence means a frozen or lost
            # client: the server ends the session and the slots move.
            settings = server_timeouts(self.network_timeout,
                                       idle_timeout=max(self.network_timeout * 5 / 6,
                                                        3 * self.rebalance_interval))
            # This session only moves cursors (handlers use their own connections):
            # a cursor move lost in a server crash means events delivered again,
            # which at-least-once allows, so its commits need not wait for a WAL
            # flush. Several times cheaper per batch on a durable server.
            settings["synchronous_commit"] = "off"
            with session.call():
                client.pin_session(settings)
                client.subscribe_slots(self.queue, self.consumer, slots=self.slots)
                client.join_group(self.queue, self.consumer)
            with self._lock:
                self._session = session
                self._owned = set()
            self.log.info("%s: connected (backend pid %s)", self.name, client.pinned_pid)
            self._consume(session)
            self._finish(session)
        finally:
            self._forget(session)
            self.unwatch(session.watch)

    def cleanup(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.ticker is not None:
            self.ticker.stop(timeout=5.0)
        self.log.info("%s: stopped (handled %s events, %s failed)", self.name, self.handled,
                      self.failed)

    # -- the loop ------------------------------------------------------------

    def _consume(self, session: _Session) -> None:
        next_rebalance = 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_rebalance:
                self._rebalance(session)
                next_rebalance = now + self.rebalance_interval
            if self._ticks_heard != self._ticks_acted_on:
                self._ticks_acted_on = self._ticks_heard
                with self._lock:
                    self._idle_until.clear()  # a new tick: every slot may have a batch
            self._dispatch(session)
            self._wait_for_work()

    # -- slots -----------------------------------------------------------------

    def _rebalance(self, session: _Session) -> None:
        """Claim free slots up to the fair share; release the surplus that is idle."""
        with session.call() as client:
            status = client.group_status(self.queue, self.consumer)
            # Not counted as a member: the group's membership key was renewed (a
            # session of a role outside the group sat on it), so join again. The
            # server refuses (ConsumerAccessDenied, which stops the worker) when
            # this session's role may no longer use the group.
            if status.my_rank is None and client.join_group(self.queue, self.consumer):
                status = client.group_status(self.queue, self.consumer)
        members = status.members
        share = status.fair_share()
        with self._lock:
            self._owned = set(status.owned)
            owned = set(self._owned)
            # Only a step still running pins its slot: one that just finished is
            # at a batch boundary, so under a backlog surplus slots still move.
            running = {slot for slot, future in self._busy.items() if not future.done()}
        if len(owned) > share:
            for slot in sorted(owned - running, reverse=True)[: len(owned) - share]:
                with session.call() as client:
                    client.release_slot(self.queue, self.consumer, slot)
                owned.discard(slot)
                self.log.info("%s: released slot %s (share %s of %s workers)", self.name,
                              slot, share, members)
        elif len(owned) < share:
            free = [s.slot for s in status.slots if s.owner_pid is None]
            random.shuffle(free)
            for slot in free:
                if len(owned) >= share:
                    break
                with session.call() as client:
                    claimed = client.claim_slot(self.queue, self.consumer, slot)
                if claimed:
                    owned.add(slot)
                    self._idle_until.pop(slot, None)
                    self.log.info("%s: claimed slot %s", self.name, slot)
        with self._lock:
            self._owned = owned

    def _dispatch(self, session: _Session) -> None:
        assert self._executor is not None
        now = time.monotonic()
        with self._lock:
            for slot, future in list(self._busy.items()):
                if future.done():
                    del self._busy[slot]
                    self._settle(slot, future)
            ready = sorted((s for s in self._owned
                            if s not in self._busy and self._idle_until.get(s, 0.0) <= now),
                           key=lambda s: self._last_started.get(s, 0.0))
            for slot in ready:
                if len(self._busy) >= self.concurrency:
                    break
                self._last_started[slot] = now
                self._heard_at_start[slot] = self._ticks_heard
                future = self._executor.submit(self._work_slot, slot, session)
                future.add_done_callback(lambda _: self._wake.set())
                self._busy[slot] = future

    def _settle(self, slot: int, future: Future[bool]) -> None:
        """Record a finished slot step; re-raise a lost or unusable session. Holds
        self._lock."""
        exc = future.exception()
        if exc is None:
            if not future.result() and self._heard_at_start.get(slot) == self._ticks_heard:
                self._idle_until[slot] = time.monotonic() + self.poll_interval
            return
        if isinstance(exc, SlotNotOwned):
            self.log.warning("%s: slot %s is no longer ours", self.name, slot)
            self._owned.discard(slot)
            return
        if isinstance(exc, SessionUnstable) or is_fatal(exc):
            raise exc
        if isinstance(exc, (psycopg.OperationalError, _ConnectionLost)):
            raise _ConnectionLost(str(exc))
        self.log.error("%s: slot %s step failed: %r", self.name, slot, exc)
        self._idle_until[slot] = time.monotonic() + self.poll_interval

    def _wait_for_work(self) -> None:
        """Sleep until a slot step finishes, a tick is announced, an idle slot's
        poll is due, it is time to rebalance, or a stop is requested."""
        with self._lock:
            idle = [t for s, t in self._idle_until.items()
                    if s in self._owned and s not in self._busy]
            if any(f.done() for f in self._busy.values()):
                return
        now = time.monotonic()
        # Bounded, so a signal (which only sets a flag) is noticed promptly.
        timeout = min([self.rebalance_interval, STOP_LATENCY,
                       *(max(0.0, t - now) for t in idle)])
        self._wake.wait(timeout)
        self._wake.clear()

    def _listen(self) -> None:
        """Turn the queue's tick notifications into wakeups. A notification
        carries no information and may be lost (NOTIFY is at most once, and a
        reconnecting listener misses what was sent meanwhile): the poll stays."""
        backoff = 0.1
        while not self.stopping:
            try:
                with open_connection(self.dsn, timeout=self.connect_timeout, stop=self._stop,
                                     application_name=f"{self.name}-listener"[:63],
                                     **client_keepalives(self.network_timeout)) as conn:
                    # No idle timeout: a listener is idle by design. The rest
                    # ends it on the server when its network goes silent.
                    settings = server_timeouts(self.network_timeout)
                    conn.execute("select " + ", ".join(
                        "set_config(%s, %s, false)" for _ in settings),
                        [v for pair in settings.items() for v in pair])
                    row = conn.execute("select pgque.tick_channel(%s)", (self.queue,)).fetchone()
                    assert row is not None
                    conn.execute(sql.SQL("listen {}").format(sql.Identifier(row[0])))
                    backoff = 0.1
                    while not self.stopping:
                        for _ in conn.notifies(timeout=STOP_LATENCY, stop_after=1):
                            self._ticks_heard += 1
                            self._wake.set()
            except Exception as exc:  # the poll covers for us meanwhile
                self.log.debug("%s: listener: %s", self.name, exc)
                self.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _work_slot(self, slot: int, session: _Session) -> bool:
        """One step of a slot: receive a batch piece, handle its events in order,
        then nack the failures and ack in one transaction. Returns whether a
        batch was there."""
        with session.call() as client:
            batch = client.receive_partitioned(
                self.queue, self.consumer, slot=slot, slots=self.slots,
                max_events=self.max_events, payload_type=self.payload_type)
        if batch is None:
            return False
        failures = self._handle(batch, session)
        if failures is None:
            # The session that received this batch is gone; whoever owns the
            # slot now gets the batch again. Never ack it from here.
            raise _ConnectionLost("session gone during a batch")
        with session.call() as client:
            client.ack(batch, nack=failures, retry_after=self.retry_after)
        return True

    def _handle(self, batch: Batch[T], session: _Session) -> dict[int, str] | None:
        """Run the handler on each event of the batch; returns the failed events'
        reasons by id, or None when the session was seen gone between events."""
        failures: dict[int, str] = {}
        for index, message in enumerate(batch.messages):
            if index and session.gone():
                self.log.warning("%s: session gone; slot %s stops before event %s", self.name,
                                 batch.slot, message.id)
                return None
            try:
                self.handler(message)
            except BaseException as exc:  # also CancelledError & co: the event failed
                # Expected under the skip policy, hence a warning; the traceback
                # is what a developer needs to fix the handler.
                self.log.warning("%s: handler failed for event %s (key %r, slot %s, retry %s): "
                                 "%r", self.name, message.id, message.partition_key, batch.slot,
                                 message.retry_count, exc, exc_info=True)
                failures[message.id] = failure_reason(exc)
                with self._lock:
                    self.failed += 1
            else:
                with self._lock:
                    self.handled += 1
        return failures

    # -- endings ----------------------------------------------------------------

    def _finish(self, session: _Session) -> None:
        """On stop: let the batches in flight finish (they ack), then release every slot."""
        with self._lock:
            busy = list(self._busy.values())
        # Handlers may take a while: keep the session talking meanwhile, or its
        # idle_session_timeout would end it and the acks would be lost.
        while wait(busy, timeout=self.rebalance_interval).not_done:
            try:
                with session.call() as client:
                    client.conn.execute("select 1")
            except Exception as exc:
                self.log.warning("%s: session lost while finishing: %s", self.name, exc)
                break
        wait(busy)
        with self._lock:
            for slot, future in list(self._busy.items()):
                del self._busy[slot]
                try:
                    self._settle(slot, future)
                except Exception as exc:  # stopping anyway: say what went wrong
                    self.log.warning("%s: slot %s: %s", self.name, slot, exc)
        try:
            for slot in sorted(self.owned_slots):
                with session.call() as client:
                    client.release_slot(self.queue, self.consumer, slot)
        except (psycopg.Error, _ConnectionLost) as exc:
            self.log.warning("%s: could not release slots cleanly: %s", self.name, exc)

    def _forget(self, session: _Session) -> None:
        """Forget a session: its locks, and with them the slots, are gone (or were
        released). Waits for in-flight handlers first, so this worker never runs
        two handlers of one slot at once."""
        session.watch.lost = True
        with self._lock:
            if self._session is session:
                self._session = None
            self._owned = set()
            busy = list(self._busy.values())
            self._busy.clear()
            self._idle_until.clear()
        wait(busy)
        with contextlib.suppress(Exception):  # closing a dead connection may fail
            session.client.conn.close()


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
