"""Suite ``ownership``: what the ownership check of a receive, ack or nack costs.

Every call of a slot asks whether its session still holds the slot's advisory
lock (``pgque._holds_key``): it gives one hold of the key back and takes it
again. pgque 0.2 held each key once, so that release reached the server's lock
table (and granted the key to any session queued on it); since 0.3 every key is
held twice and both steps stay in the session's own memory. This suite times
the same check both ways, in a server-side loop (no round trips), on one slot
key of a session of a group: checks/s, one hold (0.2) against two (now).
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from bench.measure import Case, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register

#: Checks per timed run (and a tenth with --quick).
CHECKS = 200_000


def _checks(conn: psycopg.Connection[object], key: int) -> Callable[[int], int]:
    def run(count: int) -> int:
        # One statement, so that the figure is the check's, not a round trip's.
        conn.execute(f"do $$ begin for i in 1 .. {int(count)} loop"
                     f" perform pgque._holds_key({int(key)}); end loop; end $$")
        return count
    return run


def run(ctx: SuiteContext) -> SuiteResult:
    """Time the check on a key held once and on a key held twice, by turns."""
    count = CHECKS // 10 if ctx.quick else CHECKS
    with psycopg.connect(ctx.dsn, autocommit=True) as once, \
            psycopg.connect(ctx.dsn, autocommit=True) as twice:
        keys = {}
        for conn, holds in ((once, 1), (twice, 2)):
            key = int(conn.execute("select pgque._random_key()").fetchone()[0])  # type: ignore[index]
            for _ in range(holds):
                conn.execute("select pg_advisory_lock(%s)", (key,))
            keys[holds] = key
        cases = [
            Case("check.one_hold", "_holds_key, key held once (0.2)", count,
                 _checks(once, keys[1]), warmup=count // 20),
            Case("check.two_holds", "_holds_key, key held twice (now)", count,
                 _checks(twice, keys[2]), warmup=count // 20, baseline="check.one_hold"),
        ]
        measurements = measure(cases, ctx.repeats)
        held = [int(conn.execute("select count(*) from pg_locks where locktype = 'advisory'"
                                 " and pid = pg_backend_pid() and granted").fetchone()[0])  # type: ignore[index]
                for conn in (once, twice)]
    if held != [1, 1]:
        raise RuntimeError(f"a check lost its key: held {held}")
    return SuiteResult(parameters={"checks_per_run": count, "repeats": ctx.repeats,
                                   "unit_note": "events/s here are checks/s"},
                       measurements=measurements)


SUITE = register(Suite(
    name="ownership",
    description="the ownership check of every receive and ack, key held once (0.2) or twice",
    run=run,
))
