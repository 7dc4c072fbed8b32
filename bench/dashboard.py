"""Suite ``dashboard``: what an open dashboard costs a draining group.

The verify suite's drain (a Worker of 16 slots, no-op handler, 100,000 events
of 64 keys, a tick every 1,000; a fifth with --quick), nine rounds by turns:
alone, and with ``pgque dashboard`` serving the group (in this process, on
its own thread) while a reader asks for its slot grid and the queues page
every second, as two open browser pages refresh. The dashboard reads
``pgque.metrics()`` once an interval whatever the pages; the suite runs it at
an interval of 1 s, five times its default. The goal (issue 30): the drain's
rate within noise of the rate without.
"""

from __future__ import annotations

import threading
import urllib.request

import psycopg

from bench.measure import Case, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register
from bench.verify import EVENTS, KEYS, SLOTS, TICK_EVERY, Drain
from pgque.dashboard import DashboardServer

ROUNDS = 9
INTERVAL = 1.0  # the dashboard's read of pgque.metrics(), and the pages' refresh


class _OpenPages:
    """Two pages refreshed every INTERVAL from a thread, as browsers would."""

    def __init__(self, url: str, queue: str) -> None:
        self.paths = [f"/queues/{queue}/groups/g", "/"]
        self.url = url
        self.stop = threading.Event()
        self.loads = 0
        self.thread = threading.Thread(target=self._run, name="bench-pages", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(INTERVAL):
            for path in self.paths:
                with urllib.request.urlopen(self.url + path, timeout=30) as response:
                    response.read()
                self.loads += 1


def run(ctx: SuiteContext) -> SuiteResult:
    events = EVENTS // 5 if ctx.quick else EVENTS
    rounds = max(ctx.repeats, ROUNDS)
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        plain = Drain(ctx.dsn, conn, "plain")
        watched = Drain(ctx.dsn, conn, "watched")
        with DashboardServer(ctx.dsn, interval=INTERVAL) as dashboard:
            pages = _OpenPages(dashboard.url, "watched")
            pages.thread.start()
            try:
                drains = measure([
                    Case("drain", "Worker, 16 slots, no-op handler, no dashboard", events,
                         plain.run, warmup=events // 10, prepare=plain.prepare),
                    Case("drain.dashboard",
                         f"the same with the dashboard open on it (reads every {INTERVAL:g} s, "
                         "two pages refreshed)", events, watched.run, warmup=events // 10,
                         prepare=watched.prepare, baseline="drain"),
                ], rounds)
            finally:
                pages.stop.set()
                pages.thread.join(30)
        for drain in (plain, watched):
            drain.close()
    return SuiteResult(parameters={"events_per_run": events, "slots": SLOTS, "keys": KEYS,
                                   "tick_every": TICK_EVERY, "repeats": rounds,
                                   "dashboard_interval_s": INTERVAL,
                                   "page_loads": pages.loads},
                       measurements=drains)


SUITE = register(Suite(
    name="dashboard",
    description="a Worker's drain with and without the dashboard open on its group",
    run=run,
))
