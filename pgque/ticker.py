"""The Ticker: keeps every queue of a database ticking, with low latency.

A log cut into batches by ticks delivers nothing without ticks. Any number of
Tickers may run against one database (every Worker starts one); exactly one
is *active*: the one holding a session advisory lock on the install's random
election key (``pgque.claim_ticker``). The others stand by and try the lock
every ``standby_interval``, so when the active one's session ends another takes
over within that time.

The active ticker polls ``pgque.ticker()`` (which only reads when nothing is
due, so an idle database pays no WAL and no transaction ids) and ticks every
queue with pending events, never more often than ``min_interval``. Each tick
sends a NOTIFY that wakes the queue's workers. It also runs ``pgque.maint()``
every ``maintenance_interval``, so retries come back and old tables are
reclaimed without anyone scheduling anything.

Polling every queue every few milliseconds would cost a core a few percent
all day for nothing, and in a database of thousands of queues a core for the
few that are busy. So the ticker polls every ``min_interval`` only its *hot*
queues, those it ticked in the last ``idle_after`` seconds, and lets the others
sleep: it marks them (``pgque.ticker_sleep``), and a send into a marked queue
notifies the ticker's channel at its commit, with the queue's id. The ticker
looks at that queue at once; when the look ticks something the queue is hot
again (``pgque.ticker_wake``), so the first event after a quiet spell is no
later than one in a busy stream. (A notification that ticks nothing, for a
queue whose ``ticker_max_lag`` holds the tick back or anyone's NOTIFY, leaves
the queue asleep: no write for it, and no look at it again for 50 ms however
often it is notified.) With no hot queue the whole
ticker sleeps. Every ``idle_interval`` it looks at every queue, and it runs
maintenance, for what becomes due without a send (delayed events, retries, the
idle period's ticks) and for a send that read its queue's mark just before it
was set.

An active ticker can stop working while keeping its lock: its process frozen
(SIGSTOP, a debugger, a swap storm) or its network cut without a FIN. So the
standbys also tick, through ``pgque.tick_overdue``, every queue whose pending
events have waited ``overdue_after`` seconds, and run maintenance while they
have to: delivery and retries go on, a little slower, until the active
ticker's session ends. Ticks of one queue are serialized in the database, so
the two never collide.

Ticking needs ``pgque_admin``. A Ticker refused for its role stops with the
privilege error, unless it is not ``required``: then it says so once (at
INFO) and ends without an error. A Worker's own Ticker is made so, so that a
worker of a role that may not tick runs without ticking while another process
ticks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from pgque._acompat import notified_payloads
from pgque.client import Client
from pgque.lifecycle import (
    STOP_LATENCY,
    CallWatch,
    Service,
    client_keepalives,
    server_timeouts,
)
from pgque.metrics import Metrics, TickerMetrics

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

__all__ = ["Ticker"]


class Ticker(Service):
    """Keep every queue of the database at ``dsn`` ticking; see the module docstring.

    ``network_timeout`` bounds how long a ticker whose network went silent
    keeps the election (see :class:`~pgque.Worker`). With ``required=False``, a
    role that may not tick ends the ticker quietly (said once at INFO, no
    :attr:`error`) instead of with the privilege error.
    """

    log = logging.getLogger("pgque.ticker")

    def __init__(
        self,
        dsn: str,
        *,
        min_interval: float = 0.005,
        idle_interval: float = 1.0,
        idle_after: float = 2.0,
        standby_interval: float = 0.25,
        overdue_after: float = 1.0,
        maintenance_interval: float = 1.0,
        connect_timeout: float = 30.0,
        network_timeout: float = 30.0,
        name: str = "pgque-ticker",
        required: bool = True,
        meter_provider: MeterProvider | None = None,
        ownership: str = "advisory",
        lease: float = 15.0,
    ) -> None:
        if ownership not in ("advisory", "lease"):
            raise ValueError("ownership must be 'advisory' or 'lease'")
        if not 1 <= lease <= 3600:
            raise ValueError("lease must be 1 to 3600 seconds")
        super().__init__(name, connect_timeout=connect_timeout)
        #: Whether a role that may not tick is an error (True) or ends the ticker
        #: quietly (False: a Worker's own, where another process may tick).
        self.required = required
        self.dsn = dsn
        self.min_interval = min_interval
        self.idle_interval = idle_interval
        self.idle_after = idle_after
        self.standby_interval = standby_interval
        self.overdue_after = overdue_after
        self.maintenance_interval = maintenance_interval
        self.network_timeout = network_timeout
        #: How the election is held: "advisory" (a session lock) or "lease" (a
        #: lease of ``lease`` seconds, renewed every third of it: behind a
        #: transaction pooler).
        self.ownership = ownership
        self.lease = float(lease)
        # By lease: this ticker's identity in the election, for its lifetime.
        self._lease_token = secrets.token_hex(16) if ownership == "lease" else None
        self.ticks = 0  # ticks this ticker made
        self.looks = 0  # its looks for ticks due (ticker_some rounds, every queue or some)
        self.backend_pid: int | None = None  # of its current session
        self._active = threading.Event()
        metrics = Metrics.of(meter_provider)
        #: Its instruments (pgque.metrics): None without OpenTelemetry.
        self.metrics = None if metrics is None else TickerMetrics(metrics, name)

    @property
    def active(self) -> bool:
        """Whether this ticker is the database's active one right now."""
        return self._active.is_set()

    def wait_active(self, timeout: float | None = None) -> bool:
        """Block until this ticker is the active one; False on timeout."""
        return self._active.wait(timeout)

    def serve(self) -> None:
        options: dict[str, Any] = dict(client_keepalives(self.network_timeout))
        if self._lease_token is not None:
            options["prepare_threshold"] = None  # see Worker.connect_options
        conn = self.connect(self.dsn, writable=True, **options)
        watch = self.watch(conn, self.network_timeout / 2)  # see Worker.serve
        try:
            # Never idle for long (standby_interval, idle_interval), so a long
            # silence means a frozen ticker: the server ends its session and
            # the election.
            settings = server_timeouts(self.network_timeout,
                                       idle_timeout=max(self.network_timeout * 5 / 6,
                                                        3 * self.standby_interval,
                                                        3 * self.idle_interval))
            # Ticks and maintenance need READ COMMITTED (PQ008 otherwise), whatever
            # the database's or the role's default.
            settings["default_transaction_isolation"] = "read committed"
            client = Client(conn)
            if self._lease_token is None:
                with watch.call():
                    self.backend_pid = client.pin_session(settings)
            self._elect(client, watch)
            if self._lease_token is not None:
                with watch.call():
                    client.release_ticker_lease(self._lease_token)
        except psycopg.errors.InsufficientPrivilege as exc:
            if not self.required:
                # Not this process's job, then: retrying cannot change the role,
                # so end (as a stop would) rather than fail whoever runs it.
                self.log.info("%s: this role may not tick (%s); not ticking. Another "
                              "process must tick this database: a Ticker or Worker of a "
                              "pgque_admin role, `pgque ticker`, or pg_cron.", self.name,
                              str(exc).strip())
                self.request_stop()
                return
            self.log.error("%s: this role may not tick (%s). Tick with a pgque_admin role.",
                           self.name, str(exc).strip())
            raise
        finally:
            self._active.clear()
            self.unwatch(watch)
            conn.close()

    def _elect(self, client: Client, watch: CallWatch) -> None:
        next_maintenance = 0.0
        while not self.stopping:
            with watch.call():
                elected = (client.claim_ticker() if self._lease_token is None
                           else client.claim_ticker_lease(self._lease_token, self.name,
                                                          self.lease))
            if elected:
                if self._lease_token is None:
                    self.log.info("%s: active (backend pid %s)", self.name, self.backend_pid)
                else:
                    self.log.info("%s: active (by lease)", self.name)
                self._active.set()
                if self.metrics is not None:
                    self.metrics.active(True)
                try:
                    if self._lease_token is None:
                        self._tick_loop(client, watch)
                    else:
                        self._poll_loop(client, watch)  # until its lease is lost
                finally:
                    self._active.clear()
                    if self.metrics is not None:
                        self.metrics.active(False)
                if self._lease_token is None or self.stopping:
                    return
                self.log.warning("%s: lost the election (its lease was not renewed in time)",
                                 self.name)
                continue
            # Standing by: cover for an active ticker that holds the lock but
            # does not tick (frozen, or cut off without its session ending).
            with watch.call():
                overdue = client.tick_overdue(self.overdue_after)
            self.ticks += overdue
            if self.metrics is not None:
                self.metrics.ticked(overdue)
            now = time.monotonic()
            if overdue and now >= next_maintenance:
                # The active ticker is not doing its job: its maintenance (retries
                # coming back, rotation) is not being done either.
                with watch.call():
                    client.maintenance()
                next_maintenance = now + self.maintenance_interval
            self.sleep(self.standby_interval)

    def _tick_loop(self, client: Client, watch: CallWatch) -> None:
        with watch.call():
            sleeps = self._prepare_sleep(client)
        if not sleeps:
            self._poll_loop(client, watch)
            return
        hot: dict[int, float] = {}  # the queues busy lately: id -> when last ticked
        # Queues whose last look for a notification ticked nothing: id -> (no
        # look before then, notified since).
        later: dict[int, tuple[float, bool]] = {}
        next_maintenance = next_look = 0.0
        elected = True
        try:
            while not self.stopping:
                now = time.monotonic()
                if now >= next_maintenance:
                    with watch.call():
                        client.maintenance()
                    next_maintenance = now + self.maintenance_interval
                if now >= next_look:
                    # Every queue but the hot ones asleep: those made or skipped
                    # since, too (no write when there are none); then a look at
                    # every queue: the idle period's ticks, retries and delayed
                    # events due, a send that read its queue's flag just before
                    # it was set. Its ticks heat no queue (each wake costs two
                    # writes), but those of the first look after the election:
                    # the queues busy then.
                    with watch.call():
                        marked = client.ticker_sleep(hot)
                    if marked is None:
                        self.log.info("%s: this server allows prepared transactions, whose "
                                      "sends cannot notify; polling every %ss while idle",
                                      self.name, _UNSLEEPING_INTERVAL)
                        with watch.call():
                            client.conn.execute("unlisten *")
                        self._poll_loop(client, watch)
                        return
                    ticked = self._look(client, watch, None)
                    if elected:
                        self._heat(client, watch, hot, ticked, now)
                        elected = False
                    next_look = now + self.idle_interval
                elif hot:
                    ticked = self._look(client, watch, hot)
                    for queue_id in ticked:
                        hot[queue_id] = now
                quiet = [queue_id for queue_id, last in hot.items()
                         if now - last > self.idle_after]
                if quiet:
                    for queue_id in quiet:
                        del hot[queue_id]
                    with watch.call():
                        client.ticker_sleep(hot)
                    # A send may have read its queue's flag before it was set.
                    ticked = self._look(client, watch, quiet)
                    self._heat(client, watch, hot, ticked, now)
                # A queue whose look for a notification ticked nothing (its
                # ticker_max_lag holds the tick back, or anyone's NOTIFY) is
                # looked at again for the notifications that come meanwhile no
                # sooner than _UNSLEEPING_INTERVAL after, however many they are.
                due = [queue_id for queue_id, (at, again) in later.items()
                       if at <= now and again]
                for queue_id in [q for q, (at, _) in later.items() if at <= now]:
                    del later[queue_id]
                waiting = [at for at, again in later.values() if again]
                deadline = min(now + self.min_interval if hot
                               else min(next_look, next_maintenance),
                               min(waiting, default=math.inf))
                if not due:
                    for queue_id in self._wait_for_sends(client, watch, deadline):
                        if queue_id in later:
                            later[queue_id] = (later[queue_id][0], True)
                        else:
                            due.append(queue_id)
                if due:
                    now = time.monotonic()
                    ticked = self._look(client, watch, due)
                    self._heat(client, watch, hot, ticked, now)
                    for queue_id in set(due) - set(ticked):
                        later[queue_id] = (now + _UNSLEEPING_INTERVAL, False)
        finally:
            if not watch.lost:
                # Sends would go on notifying nobody until the next election.
                with contextlib.suppress(psycopg.Error), watch.call():
                    client.ticker_wake()

    def _look(self, client: Client, watch: CallWatch,
              queue_ids: Collection[int] | None) -> list[int]:
        """Tick the queues of ``queue_ids`` (None: every queue) whose thresholds
        ask for it; returns the ids of those it ticked."""
        began = time.monotonic()
        with watch.call():
            ticked = client.ticker_ids(queue_ids)
        self.looks += 1
        self.ticks += len(ticked)
        if self.metrics is not None:
            self.metrics.looked(len(ticked), time.monotonic() - began)
        return ticked

    def _heat(self, client: Client, watch: CallWatch, hot: dict[int, float],
              ticked: list[int], now: float) -> None:
        """Make the queues just ticked hot: awake (sends into them stop notifying),
        and polled every ``min_interval`` until quiet for ``idle_after``."""
        waking = {queue_id for queue_id in ticked if queue_id not in hot}
        if waking:
            with watch.call():
                client.ticker_wake(waking)
        for queue_id in ticked:
            hot[queue_id] = now

    def _poll_loop(self, client: Client, watch: CallWatch) -> None:
        """The ticker that cannot sleep (a server that allows prepared transactions,
        a database before 0.10, a ticker by lease, which has no session to listen
        on): every queue every ``min_interval`` while ticks come, every 0.05 s
        once idle. By lease it renews the lease every third of it, and returns
        when a renewal finds it lost."""
        last_tick = time.monotonic()
        next_maintenance = next_renewal = 0.0
        while not self.stopping:
            now = time.monotonic()
            if self._lease_token is not None and now >= next_renewal:
                with watch.call():
                    if not client.claim_ticker_lease(self._lease_token, self.name, self.lease):
                        return
                next_renewal = now + self.lease / 3
            if now >= next_maintenance:
                with watch.call():
                    client.maintenance()
                next_maintenance = now + self.maintenance_interval
            began = time.monotonic()
            with watch.call():
                made = client.ticker()
            self.looks += 1
            self.ticks += made
            if self.metrics is not None:
                self.metrics.looked(made, time.monotonic() - began)
            if made:
                last_tick = now
            self.sleep(self.min_interval if now - last_tick <= self.idle_after
                       else min(self.idle_interval, _UNSLEEPING_INTERVAL))

    def _prepare_sleep(self, client: Client) -> bool:
        """Listen on the ticker channel and mark every queue awake (a ticker
        before this one may have gone away asleep). False where it cannot
        sleep: the server allows prepared transactions, or the database's pgque
        predates the queues' own sleep (0.10)."""
        if not client._can_tick_by_id():
            self.log.info("%s: this database's pgque predates the sleeping queues (0.10); "
                          "polling every %ss while idle", self.name, _UNSLEEPING_INTERVAL)
            # A 0.9 ticker may have gone away asleep: its marks would make every
            # send notify nobody (0.9 has ticker_wake; before it, no marks).
            with contextlib.suppress(psycopg.errors.UndefinedFunction):
                client.ticker_wake()
            return False
        client.ticker_wake()
        client.conn.execute(sql.SQL("listen {}").format(
            sql.Identifier(client.ticker_channel())))
        return True

    def _wait_for_sends(self, client: Client, watch: CallWatch, deadline: float) -> list[int]:
        """Wait for notifications on the ticker channel until ``deadline`` (or a
        stop); the ids of the queues they name (none on timeout). Reads those
        that came meanwhile even when the deadline has passed: a pass slower
        than ``min_interval`` must not leave the sleeping queues unheard."""
        while True:
            left = max(0.0, deadline - time.monotonic())
            with watch.call() as conn:
                payloads = notified_payloads(conn, min(left, STOP_LATENCY))
            # A payload that is no queue id (anyone may NOTIFY this channel)
            # names nothing to look at: waited through. ASCII digits only:
            # str.isdigit() takes '²', which int() refuses.
            queue_ids = sorted({int(p) for p in payloads
                                if p.isascii() and p.isdecimal() and len(p) < 10})
            if queue_ids or self.stopping or time.monotonic() >= deadline:
                return queue_ids


# A ticker that cannot sleep (a database before 0.10, a server that allows
# prepared transactions) polls this often once idle, as every ticker did before
# 0.9; and a queue whose look for a notification ticked nothing is not looked
# at again for its notifications sooner than this.
_UNSLEEPING_INTERVAL = 0.05
