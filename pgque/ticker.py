"""The Ticker: keeps every queue of a database ticking, with low latency.

A log cut into batches by ticks delivers nothing without ticks. Any number of
Tickers may run against one database (every Worker starts one); exactly one
is *active*: the one holding a session advisory lock. The others stand by and
try the lock every ``standby_interval``, so when the active one's session ends
another takes over within that time.

The active ticker polls ``pgque.ticker()`` (which only reads when nothing is
due, so an idle database pays no WAL and no transaction ids) and ticks every
queue with pending events, never more often than ``min_interval``. After
``idle_after`` seconds without a tick it backs off to ``idle_interval`` and
speeds up again at the next tick. Each tick sends a NOTIFY that wakes the
queue's workers. It also runs ``pgque.maint()`` every
``maintenance_interval``, so retries come back and old tables are reclaimed
without anyone scheduling anything.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import psycopg

from pgque.client import Client, open_connection
from pgque.errors import ConnectError

__all__ = ["TICKER_LOCK_KEY", "Ticker"]

#: The session advisory lock (bigint key, high word 'pgqk') that elects the
#: active ticker of a database.
TICKER_LOCK_KEY = 0x7067716B << 32

log = logging.getLogger("pgque.ticker")


class Ticker:
    """Keep every queue of the database at ``dsn`` ticking; see the module docstring."""

    def __init__(
        self,
        dsn: str,
        *,
        min_interval: float = 0.005,
        idle_interval: float = 0.05,
        idle_after: float = 2.0,
        standby_interval: float = 0.25,
        maintenance_interval: float = 1.0,
        connect_timeout: float = 30.0,
        name: str = "pgque-ticker",
    ) -> None:
        self.dsn = dsn
        self.min_interval = min_interval
        self.idle_interval = idle_interval
        self.idle_after = idle_after
        self.standby_interval = standby_interval
        self.maintenance_interval = maintenance_interval
        self.connect_timeout = connect_timeout
        self.name = name
        self.ticks = 0  # ticks this ticker made
        self.backend_pid: int | None = None  # of its current session
        self._active = threading.Event()
        self._stopping = threading.Event()
        self._signalled = False  # set by SIGTERM/SIGINT when run() owns them
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether this ticker is the database's active one right now."""
        return self._active.is_set()

    @property
    def alive(self) -> bool:
        """Whether the background thread started by start() is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait_active(self, timeout: float | None = None) -> bool:
        """Block until this ticker is the active one; False on timeout."""
        return self._active.wait(timeout)

    def start(self) -> None:
        """Run in a background (daemon) thread."""
        if self._thread is not None:
            raise RuntimeError("ticker already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop ticking and give up the lock (by closing the session); waits up to
        timeout seconds for the background thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def request_stop(self) -> None:
        """Ask the ticker to stop soon, without waiting for it."""
        self._stopping.set()

    def __enter__(self) -> Ticker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def run(self) -> None:
        """Tick (or stand by) until stop(), or SIGTERM/SIGINT when run in the main
        thread; reconnects with backoff when the database goes away."""
        restore = self._install_signal_handlers()
        try:
            self._run()
        finally:
            for signum, previous in restore.items():
                signal.signal(signum, previous)

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._signalled = True  # a plain assignment: no lock in a signal handler

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _stop_requested(self) -> bool:
        if self._signalled:
            self._stopping.set()
        return self._stopping.is_set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop_requested():
            try:
                with open_connection(self.dsn, timeout=self.connect_timeout,
                                     application_name=self.name[:63]) as conn:
                    backoff = 0.1
                    self.backend_pid = conn.info.backend_pid
                    self._serve(Client(conn))
            except psycopg.errors.InsufficientPrivilege as exc:
                # Retrying cannot help: say so once and stop (a reader-role worker
                # leaves ticking to an admin-role process).
                log.error("%s: this role may not tick (%s); the ticker stops. Run the "
                          "worker with ticker=False, or tick with a pgque_admin role.",
                          self.name, str(exc).strip())
                self._stopping.set()
                break
            except (psycopg.OperationalError, ConnectError) as exc:
                log.warning("%s: connection lost (%s); retrying in %.1fs", self.name,
                            str(exc).strip() or type(exc).__name__, backoff)
            except Exception:
                log.exception("%s: unexpected error; retrying in %.1fs", self.name, backoff)
            finally:
                self._active.clear()
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _serve(self, client: Client) -> None:
        while not self._stop_requested():
            if self._try_lock(client):
                log.info("%s: active (backend pid %s)", self.name, client.conn.info.backend_pid)
                self._active.set()
                self._tick_loop(client)
                return
            self._stopping.wait(self.standby_interval)

    @staticmethod
    def _try_lock(client: Client) -> bool:
        row = client.conn.execute("select pg_try_advisory_lock(%s)", (TICKER_LOCK_KEY,)).fetchone()
        return bool(row and row[0])

    def _tick_loop(self, client: Client) -> None:
        last_tick = time.monotonic()
        next_maintenance = 0.0
        while not self._stop_requested():
            now = time.monotonic()
            if now >= next_maintenance:
                client.maintenance()
                next_maintenance = now + self.maintenance_interval
            made = client.ticker()
            if made:
                self.ticks += made
                last_tick = now
            idle = now - last_tick > self.idle_after
            self._stopping.wait(self.idle_interval if idle else self.min_interval)
