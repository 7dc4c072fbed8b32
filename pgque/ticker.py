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

Polling every few milliseconds all day would cost a core a few percent for
nothing, so after ``idle_after`` seconds without a tick the ticker falls
asleep: it marks every queue (``pgque.ticker_sleep``), and a send into a
marked queue notifies the ticker's channel at its commit. The ticker looks at
once on that notification; when the look ticks something it unmarks the
queues and stays awake, so the first event after a quiet spell is no later
than one in a busy stream. (A notification that ticks nothing, anyone's
NOTIFY, leaves it asleep: no write for it.) Asleep, it still
polls every ``idle_interval`` and runs maintenance, for what becomes due
without a send (delayed events, retries, the idle period's ticks) and for a
send that read its queue's mark just before it was set.

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
import threading
import time

import psycopg
from psycopg import sql

from pgque._acompat import notified
from pgque.client import Client
from pgque.lifecycle import (
    STOP_LATENCY,
    CallWatch,
    Service,
    client_keepalives,
    server_timeouts,
)

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
    ) -> None:
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
        self.ticks = 0  # ticks this ticker made
        self.backend_pid: int | None = None  # of its current session
        self._active = threading.Event()

    @property
    def active(self) -> bool:
        """Whether this ticker is the database's active one right now."""
        return self._active.is_set()

    def wait_active(self, timeout: float | None = None) -> bool:
        """Block until this ticker is the active one; False on timeout."""
        return self._active.wait(timeout)

    def serve(self) -> None:
        conn = self.connect(self.dsn, **client_keepalives(self.network_timeout))
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
            with watch.call():
                self.backend_pid = client.pin_session(settings)
            self._elect(client, watch)
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
                elected = client.claim_ticker()
            if elected:
                self.log.info("%s: active (backend pid %s)", self.name, self.backend_pid)
                self._active.set()
                self._tick_loop(client, watch)
                return
            # Standing by: cover for an active ticker that holds the lock but
            # does not tick (frozen, or cut off without its session ending).
            with watch.call():
                overdue = client.tick_overdue(self.overdue_after)
            self.ticks += overdue
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
        last_tick = time.monotonic()
        next_maintenance = 0.0
        asleep = heard = False
        ticked_asleep = 0  # ticks made while asleep, before the notification heard
        try:
            while not self.stopping:
                now = time.monotonic()
                if now >= next_maintenance:
                    with watch.call():
                        client.maintenance()
                    next_maintenance = now + self.maintenance_interval
                if asleep:
                    # Queues created since it fell asleep, or skipped then (busy):
                    # marked now. No write when there are none.
                    with watch.call():
                        client.ticker_sleep()
                with watch.call():
                    made = client.ticker()
                self.ticks += made
                if asleep:
                    ticked_asleep += made
                    if heard and ticked_asleep:
                        # A send's events (ticked by this look, or by a poll
                        # just before its notification came): awake until quiet
                        # again. Polls' ticks alone (the idle period's) wake
                        # nothing: each wake costs two writes.
                        with watch.call():
                            client.ticker_wake()
                        asleep = heard = False
                        ticked_asleep = 0
                        last_tick = now
                        continue
                    if heard:
                        # A notification that ticked nothing (a delayed send's,
                        # or anyone's NOTIFY): the next look no sooner than an
                        # idle poll of before 0.9, whoever notifies how often.
                        self.sleep(_UNSLEEPING_INTERVAL)
                    deadline = min(now + self.idle_interval, next_maintenance)
                    heard = self._wait_for_wake(client, watch, deadline)
                    continue
                if made:
                    last_tick = now
                if now - last_tick <= self.idle_after:
                    self.sleep(self.min_interval)
                elif sleeps:
                    # Stale notifications out first: from here on, one means a send.
                    notified(client.conn, 0)
                    with watch.call():
                        asleep = client.ticker_sleep() is not None
                    ticked_asleep = 0
                    if not asleep:
                        sleeps = False
                        self.log.info("%s: this server allows prepared transactions, whose "
                                      "sends cannot notify; polling every %ss while idle",
                                      self.name, _UNSLEEPING_INTERVAL)
                    # and the loop looks for due ticks once more
                else:
                    self.sleep(min(self.idle_interval, _UNSLEEPING_INTERVAL))
        finally:
            if asleep and not watch.lost:
                # Sends would go on notifying nobody until the next election.
                with contextlib.suppress(psycopg.Error), watch.call():
                    client.ticker_wake()

    def _prepare_sleep(self, client: Client) -> bool:
        """Listen on the ticker channel and mark every queue awake (a ticker
        before this one may have gone away asleep). False when the database's
        pgque predates the sleeping ticker (0.9): then it polls as before."""
        try:
            client.ticker_wake()
        except psycopg.errors.UndefinedFunction:
            self.log.info("%s: this database's pgque has no sleeping ticker (before 0.9); "
                          "polling every %ss while idle", self.name, _UNSLEEPING_INTERVAL)
            return False
        client.conn.execute(sql.SQL("listen {}").format(
            sql.Identifier(client.ticker_channel())))
        return True

    def _wait_for_wake(self, client: Client, watch: CallWatch, deadline: float) -> bool:
        """Wait for a notification on the ticker channel until ``deadline`` (or a
        stop); True when one came."""
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with watch.call() as conn:
                if notified(conn, min(left, STOP_LATENCY)):
                    return True
        return False


# A ticker that cannot sleep (a database before 0.9, a server that allows
# prepared transactions) polls this often once idle, as every ticker did before.
_UNSLEEPING_INTERVAL = 0.05
