"""The Ticker: keeps every queue of a database ticking, with low latency.

A log cut into batches by ticks delivers nothing without ticks. Any number of
Tickers may run against one database (every Worker starts one); exactly one
is *active*: the one holding a session advisory lock on the install's random
election key (``pgque.claim_ticker``). The others stand by and try the lock
every ``standby_interval``, so when the active one's session ends another takes
over within that time.

The active ticker polls ``pgque.ticker()`` (which only reads when nothing is
due, so an idle database pays no WAL and no transaction ids) and ticks every
queue with pending events, never more often than ``min_interval``. After
``idle_after`` seconds without a tick it backs off to ``idle_interval`` and
speeds up again at the next tick. Each tick sends a NOTIFY that wakes the
queue's workers. It also runs ``pgque.maint()`` every
``maintenance_interval``, so retries come back and old tables are reclaimed
without anyone scheduling anything.

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

import logging
import threading
import time

import psycopg

from pgque.client import Client
from pgque.lifecycle import CallWatch, Service, client_keepalives, server_timeouts

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
        idle_interval: float = 0.05,
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
        last_tick = time.monotonic()
        next_maintenance = 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_maintenance:
                with watch.call():
                    client.maintenance()
                next_maintenance = now + self.maintenance_interval
            with watch.call():
                made = client.ticker()
            if made:
                self.ticks += made
                last_tick = now
            idle = now - last_tick > self.idle_after
            self.sleep(self.idle_interval if idle else self.min_interval)
