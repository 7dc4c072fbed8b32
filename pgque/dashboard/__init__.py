"""``pgque dashboard``: queues, groups, slots, lag and dead letters in a browser.

The page acts as the database role of its DSN, so pgque's own access rules
decide what it shows and what it may do: a reader sees its queues and no
action button; a team's role replays and purges the dead letters of its own
groups; nothing else is checked here. Every figure comes from one query an
interval, ``pgque.metrics()`` (the Prometheus exporter's), read by one task
for every open page, so the dashboard costs the database the same whether one
page is open or ten. Dead letters are read when their page is asked for.

Actions (replay, purge) are POSTs with a CSRF token (a cookie the page's form
must repeat), ask for a confirmation that states how many they touch, and are
refused with ``--read-only``. Templates escape every value (Jinja2's
autoescape): payloads, reasons, keys and application names are shown as text.
Charts are SVG drawn on the server. It needs the ``dashboard`` extra
(``pip install 'pgque[dashboard]'``): Starlette, uvicorn and Jinja2.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from pgque.dashboard.app import Dashboard, create_app

__all__ = ["Dashboard", "DashboardServer", "create_app", "serve"]

#: Seconds a stop waits for the requests in flight: a live tail's stream never
#: ends by itself, and a browser may keep one open after leaving its page.
GRACE = 2


class DashboardServer:
    """The dashboard served by uvicorn on a thread of its own, from ``start()``
    (or ``with``) to ``stop()``; port 0 takes a free one (:attr:`url`)."""

    def __init__(self, dsn: str, *, host: str = "127.0.0.1", port: int = 0,
                 read_only: bool = False, interval: float = 5.0,
                 hosts: Sequence[str] = ()) -> None:
        import uvicorn

        #: The app's state: its sampler's snapshot, its mode.
        self.dashboard = Dashboard(dsn, read_only=read_only, interval=interval,
                                   hosts=_hosts(host, hosts))
        config = uvicorn.Config(self.dashboard.app,
                                host=host, port=port, log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=GRACE)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="pgque-dashboard",
                                        daemon=True)

    @property
    def url(self) -> str:
        """The address it serves, once started: http://host:port."""
        socket = self._server.servers[0].sockets[0]
        host, port = socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not start (see its log)")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def _hosts(host: str, hosts: Sequence[str]) -> list[str]:
    """The names to answer to: those given, and the address listened on unless
    it is every interface's (then only the names given, or the loopback's)."""
    return [*hosts, *([] if host in ("0.0.0.0", "::", "") else [host])]


def serve(dsn: str, *, host: str = "127.0.0.1", port: int = 8765, read_only: bool = False,
          interval: float = 5.0, hosts: Sequence[str] = ()) -> None:
    """Serve the dashboard until SIGTERM or Ctrl-C, then return (as pgque's other
    services do: a stop asked for is a clean exit, not the signal's)."""
    import uvicorn

    config = uvicorn.Config(create_app(dsn, read_only=read_only, interval=interval,
                                       hosts=_hosts(host, hosts)), host=host,
                            port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=GRACE)
    # uvicorn stops on SIGTERM and SIGINT, then raises the signal again under
    # the handlers it found, to end the process by it: handlers that do
    # nothing make that a return, and the command exits 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    uvicorn.Server(config).run()
