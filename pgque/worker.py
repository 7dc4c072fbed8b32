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
to the slot's retry queue, the rest of the batch proceeds, the batch is acked.
Delivery is at least once; handlers must be idempotent. When the connection
goes away every slot is lost with it: in-flight batches are dropped unacked
(they will be delivered again), the worker reconnects with backoff, rejoins
and claims again.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import sql

from pgque.client import Client, open_connection
from pgque.errors import ConnectError, SlotNotOwned
from pgque.ticker import Ticker
from pgque.types import Batch, Message

__all__ = ["Worker"]

T = TypeVar("T")
Handler = Callable[[Message[T]], object]

log = logging.getLogger("pgque.worker")


class _ConnectionLost(Exception):
    """The worker's session ended; every slot it owned is gone with it."""


class Worker(Generic[T]):
    """Consume a queue as one member of a partitioned consumer group.

    ``handler`` is called with each :class:`~pgque.Message`; the events of one
    slot are handled strictly one after another, and up to ``concurrency``
    slots at the same time. By default the worker also runs a
    :class:`~pgque.Ticker` (pass ``ticker=False`` when something else ticks, or
    a configured Ticker) and listens for tick notifications (``listen``), with
    ``poll_interval`` as the fallback when a notification is lost.

    ``run()`` blocks until :meth:`stop` (or SIGTERM / SIGINT when run in the
    main thread); ``start()`` runs the same loop in a background thread. A
    Worker is also a context manager: start on enter, stop on exit.
    """

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
        name: str | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
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
        self.connect_timeout = connect_timeout
        self.name = name or f"pgque-worker-{queue}-{consumer}"

        self._stopping = threading.Event()
        self._signalled: int | None = None  # set by SIGTERM/SIGINT when run() owns them
        self._stopped = threading.Event()
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
            self.ticker = Ticker(dsn, name=f"{self.name}-ticker") if ticker else None
        self._thread: threading.Thread | None = None
        self._client: Client | None = None
        self._generation = 0  # bumped on every (re)connect; stale tasks never ack
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

    def run(self) -> None:
        """Consume until stop() (or SIGTERM/SIGINT in the main thread); then release
        every slot at a batch boundary and return."""
        restore = self._install_signal_handlers()
        try:
            self._run()
        finally:
            for signum, previous in restore.items():
                signal.signal(signum, previous)

    def start(self) -> None:
        """Run the worker in a background thread."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Ask the worker to finish its current batches, release its slots and exit;
        waits up to timeout seconds for that when it runs in a thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the worker has exited; False on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> Worker[T]:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- the loop ------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Only a plain assignment: taking a lock here (Event.set) could
            # deadlock with the very code the signal interrupted. The loop
            # notices within one wait.
            self._signalled = signum

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _run(self) -> None:
        executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix=self.name)
        backoff = 0.1
        if self.ticker is not None:
            self.ticker.start()
        if self.listen:
            threading.Thread(target=self._listen, name=f"{self.name}-listener",
                             daemon=True).start()
        try:
            while not self._stopping.is_set():
                try:
                    self._connect()
                    backoff = 0.1
                    self._consume(executor)
                except (_ConnectionLost, psycopg.OperationalError, ConnectError) as exc:
                    log.warning("%s: connection lost (%s); reconnecting in %.1fs",
                                self.name, str(exc).strip() or type(exc).__name__, backoff)
                except Exception:
                    # Anything else is a bug or a misconfiguration: say so loudly,
                    # then start over on a fresh session rather than die silently.
                    log.exception("%s: unexpected error; starting over in %.1fs", self.name,
                                  backoff)
                else:
                    continue
                self._drop_connection()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        finally:
            self._shutdown(executor)
            if self.ticker is not None:
                self.ticker.stop()
            self._stopped.set()

    def _connect(self) -> None:
        if self._client is not None:
            return
        conn = open_connection(self.dsn, timeout=self.connect_timeout,
                               application_name=self.name[:63])
        # This session only moves cursors (handlers use their own connections):
        # a cursor move lost in a server crash means events delivered again,
        # which at-least-once allows, so its commits need not wait for a WAL
        # flush. Several times cheaper per batch on a durable server.
        conn.execute("set synchronous_commit = off")
        client = Client(conn)
        client.subscribe_slots(self.queue, self.consumer, slots=self.slots)
        client.join_group(self.queue, self.consumer)
        with self._lock:
            self._generation += 1
            self._client = client
            self._owned = set()
        log.info("%s: connected (backend pid %s)", self.name, conn.info.backend_pid)

    def _consume(self, executor: ThreadPoolExecutor) -> None:
        next_rebalance = 0.0
        while not self._stopping.is_set():
            if self._signalled is not None:
                log.info("%s: signal %s, stopping at the next batch boundary", self.name,
                         self._signalled)
                self._stopping.set()
                break
            now = time.monotonic()
            if now >= next_rebalance:
                self._rebalance()
                next_rebalance = now + self.rebalance_interval
            if self._ticks_heard != self._ticks_acted_on:
                self._ticks_acted_on = self._ticks_heard
                with self._lock:
                    self._idle_until.clear()  # a new tick: every slot may have a batch
            self._dispatch(executor)
            self._wait_for_work()

    # -- slots -----------------------------------------------------------------

    def _rebalance(self) -> None:
        """Claim free slots up to the fair share; release the surplus that is idle."""
        client = self._client
        if client is None:
            raise _ConnectionLost("no connection")
        status = client.group_status(self.queue, self.consumer)
        members = status[0].members
        share = status[0].fair_share(self.slots)
        with self._lock:
            self._owned = {s.slot for s in status if s.mine}
            owned = set(self._owned)
            # Only a step still running pins its slot: one that just finished is
            # at a batch boundary, so under a backlog surplus slots still move.
            running = {slot for slot, future in self._busy.items() if not future.done()}
        if len(owned) > share:
            for slot in sorted(owned - running, reverse=True)[: len(owned) - share]:
                client.release_slot(self.queue, self.consumer, slot)
                owned.discard(slot)
                log.info("%s: released slot %s (share %s of %s workers)", self.name, slot,
                         share, members)
        elif len(owned) < share:
            free = [s.slot for s in status if s.owner_pid is None]
            random.shuffle(free)
            for slot in free:
                if len(owned) >= share:
                    break
                if client.claim_slot(self.queue, self.consumer, slot):
                    owned.add(slot)
                    self._idle_until.pop(slot, None)
                    log.info("%s: claimed slot %s", self.name, slot)
        with self._lock:
            self._owned = owned

    def _dispatch(self, executor: ThreadPoolExecutor) -> None:
        now = time.monotonic()
        with self._lock:
            for slot, future in list(self._busy.items()):
                if future.done():
                    del self._busy[slot]
                    self._settle(slot, future)
            ready = sorted((s for s in self._owned
                            if s not in self._busy and self._idle_until.get(s, 0.0) <= now),
                           key=lambda s: self._last_started.get(s, 0.0))
            generation = self._generation
            for slot in ready:
                if len(self._busy) >= self.concurrency:
                    break
                self._last_started[slot] = now
                self._heard_at_start[slot] = self._ticks_heard
                future = executor.submit(self._work_slot, slot, generation)
                future.add_done_callback(lambda _: self._wake.set())
                self._busy[slot] = future

    def _settle(self, slot: int, future: Future[bool]) -> None:
        """Record a finished slot step; re-raise a lost connection. Holds self._lock."""
        exc = future.exception()
        if exc is None:
            if not future.result() and self._heard_at_start.get(slot) == self._ticks_heard:
                self._idle_until[slot] = time.monotonic() + self.poll_interval
            return
        if isinstance(exc, SlotNotOwned):
            log.warning("%s: slot %s is no longer ours", self.name, slot)
            self._owned.discard(slot)
            return
        if isinstance(exc, (psycopg.OperationalError, _ConnectionLost)):
            raise _ConnectionLost(str(exc))
        log.error("%s: slot %s step failed: %r", self.name, slot, exc)
        self._idle_until[slot] = time.monotonic() + self.poll_interval

    def _wait_for_work(self) -> None:
        """Sleep until a slot step finishes, a tick is announced, an idle slot's
        poll is due, or it is time to rebalance."""
        with self._lock:
            idle = [t for s, t in self._idle_until.items()
                    if s in self._owned and s not in self._busy]
            if any(f.done() for f in self._busy.values()):
                return
        now = time.monotonic()
        # Bounded, so a signal (which only sets a flag) is noticed promptly.
        timeout = min([self.rebalance_interval, 0.5, *(max(0.0, t - now) for t in idle)])
        self._wake.wait(timeout)
        self._wake.clear()

    def _listen(self) -> None:
        """Turn the queue's tick notifications into wakeups. A notification
        carries no information and may be lost (NOTIFY is at most once, and a
        reconnecting listener misses what was sent meanwhile): the poll stays."""
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                with open_connection(self.dsn, timeout=self.connect_timeout,
                                     application_name=f"{self.name}-listener"[:63]) as conn:
                    row = conn.execute("select pgque.tick_channel(%s)", (self.queue,)).fetchone()
                    assert row is not None
                    conn.execute(sql.SQL("listen {}").format(sql.Identifier(row[0])))
                    backoff = 0.1
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._ticks_heard += 1
                            self._wake.set()
            except Exception as exc:  # the poll covers for us meanwhile
                log.debug("%s: listener: %s", self.name, exc)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _work_slot(self, slot: int, generation: int) -> bool:
        """One step of a slot: receive a batch piece, handle its events in order,
        nack the failures, ack. Returns whether a batch was there."""
        client = self._client
        if client is None:
            raise _ConnectionLost("no connection")
        batch = client.receive_partitioned(
            self.queue, self.consumer, slot=slot, slots=self.slots,
            max_events=self.max_events, payload_type=self.payload_type)
        if batch is None:
            return False
        failures = self._handle(batch)
        if generation != self._generation:
            # The session that received this batch is gone; whoever owns the
            # slot now will get the batch again. Never ack it from here.
            return True
        for reason, failed in failures.items():
            client.nack(batch, failed, retry_after=self.retry_after, reason=reason)
        client.ack(batch)
        return True

    def _handle(self, batch: Batch[T]) -> dict[str, list[Message[T]]]:
        failures: dict[str, list[Message[T]]] = {}
        for message in batch.messages:
            try:
                self.handler(message)
            except Exception as exc:
                # Expected under the skip policy, hence a warning; the traceback
                # is what a developer needs to fix the handler.
                log.warning("%s: handler failed for event %s (key %r, slot %s, retry %s): %r",
                            self.name, message.id, message.partition_key, batch.slot,
                            message.retry_count, exc, exc_info=True)
                failures.setdefault(f"{type(exc).__name__}: {exc}"[:1000], []).append(message)
                with self._lock:
                    self.failed += 1
            else:
                with self._lock:
                    self.handled += 1
        return failures

    # -- endings ----------------------------------------------------------------

    def _drop_connection(self) -> None:
        """Forget the dead session: its locks, and with them the slots, are gone."""
        with self._lock:
            client, self._client = self._client, None
            self._owned = set()
            self._generation += 1
            busy = list(self._busy.values())
            self._busy.clear()
            self._idle_until.clear()
        # Let in-flight handlers finish before claiming anything again, so this
        # worker never runs two handlers of one slot at once.
        wait(busy)
        if client is not None:
            try:
                client.close()
                client.conn.close()
            except Exception:  # closing a dead connection may fail; nothing to keep
                pass

    def _shutdown(self, executor: ThreadPoolExecutor) -> None:
        """Finish the batches in flight (they ack), then release every slot."""
        with self._lock:
            busy = list(self._busy.values())
        wait(busy)
        executor.shutdown(wait=True)
        client = self._client
        if client is not None and not client.conn.closed:
            try:
                for slot in sorted(self.owned_slots):
                    client.release_slot(self.queue, self.consumer, slot)
            except psycopg.Error as exc:
                log.warning("%s: could not release slots cleanly: %s", self.name, exc)
            finally:
                client.conn.close()
        with self._lock:
            self._client = None
            self._owned = set()
        log.info("%s: stopped (handled %s events, %s failed)", self.name, self.handled,
                 self.failed)
