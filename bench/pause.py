"""Suite ``pause``: what blocked keys cost the other keys of their slot.

Under the pause policy a failed event blocks its key: while a slot has blocked
keys, its receive looks up each event's key among them and sets the events of
blocked keys aside. This suite drains the same events of unblocked keys from a
slot with 0, 1, 100 and 10,000 blocked keys (the issue's goal: 10,000 at
>= 0.8x the rate of none), and from a slot with one *hot* blocked key whose
events make a tenth of the stream (1,000 events/s beside 10,000/s of others),
each of which is set aside: its cost is the rest of the slot's. Receive and
ack through SQL (``receive_partitioned``, ``ack_partitioned``), pieces of 100,
a tick every 1,000 events; events/s are those of the unblocked keys.
"""

from __future__ import annotations

import psycopg

from bench.measure import Case, Workload, measure
from bench.registry import Suite, SuiteContext, SuiteResult, register

#: Events of unblocked keys drained per timed run (a fifth with --quick).
EVENTS = 20_000
TICK_EVERY = 1_000
PIECE = 100
#: The hot key's events per TICK_EVERY events of the others.
HOT_PER_TICK = 100
BLOCKED = (0, 1, 100, 10_000)


class _BlockedSlot:
    """A one-slot group under pause whose slot this session owns, with ``blocked``
    keys blocked (their heads due in a day); each run drains fresh events."""

    def __init__(self, conn: psycopg.Connection[object], name: str, blocked: int,
                 hot: bool) -> None:
        self.conn = conn
        self.queue = name
        self.hot = hot
        conn.execute("select pgque.create_queue(%s, %s)",
                     (name, f'{{"ticker_max_count": {TICK_EVERY}}}'))
        conn.execute("select pgque.subscribe_slots(%s, 'g', 1, 'pause')", (name,))
        conn.execute("select pgque.set_failure_policy(%s, 'g', 'pause', null, null)", (name,))
        assert conn.execute("select pgque.claim_slot(%s, 'g', 0)", (name,)).fetchone() == (True,)
        keys = [f"blocked-{i}" for i in range(blocked)] + (["hot"] if hot else [])
        for start in range(0, len(keys), 1_000):
            chunk = keys[start:start + 1_000]
            conn.execute("select pgque.send_batch(%s, %s, %s, %s)",
                         (name, ["e"] * len(chunk), ["{}"] * len(chunk), chunk))
            conn.execute("select pgque.tick(%s)", (name,))
        while rows := self._receive(1_000):
            conn.execute("select pgque.ack_partitioned(%s, 'g', 0, 1, %s, %s, '{fails}',"
                         " '1 day')", (name, rows[0][0], [r[1] for r in rows if r[1]]))
        found = conn.execute("select count(*) from pgque.blocked_keys(%s, 'g')",
                             (name,)).fetchone()
        assert found == (len(keys),), found

    def _receive(self, max_events: int) -> list[tuple[int, int | None]]:
        return self.conn.execute(
            "select batch_id, ev_id from pgque.receive_partitioned(%s, 'g', 0, 1, %s)",
            (self.queue, max_events)).fetchall()  # type: ignore[return-value]

    def prepare(self, count: int) -> None:
        for start in range(0, count, TICK_EVERY):
            n = min(TICK_EVERY, count - start)
            keys = [f"tenant-{(start + i) % 64}" for i in range(n)]
            if self.hot:
                keys += ["hot"] * HOT_PER_TICK
            self.conn.execute("select pgque.send_batch(%s, %s, %s, %s)",
                              (self.queue, ["e"] * len(keys), ['{"n": 1}'] * len(keys), keys))
            self.conn.execute("select pgque.tick(%s)", (self.queue,))

    def drain(self) -> Workload:
        def run(count: int) -> int:
            received = 0
            while rows := self._receive(PIECE):
                received += sum(1 for _batch, ev_id in rows if ev_id is not None)
                self.conn.execute("select pgque.ack_partitioned(%s, 'g', 0, 1, %s)",
                                  (self.queue, rows[0][0]))
            return received
        return run


def run(ctx: SuiteContext) -> SuiteResult:
    """Drain from slots with more and more blocked keys, by turns."""
    events = EVENTS // 5 if ctx.quick else EVENTS
    with psycopg.connect(ctx.dsn, autocommit=True) as conn:
        slots = {f"blocked_{n}": _BlockedSlot(conn, f"blocked_{n}", n, False) for n in BLOCKED}
        slots["hot"] = _BlockedSlot(conn, "hot", 0, True)
        cases = [Case(name, f"{n:,} blocked keys" if name != "hot" else
                      "one hot blocked key, a tenth of the stream",
                      events, slot.drain(), warmup=events // 10, prepare=slot.prepare,
                      baseline=None if name == "blocked_0" else "blocked_0")
                 for name, slot, n in ((name, slot, int(name.split("_")[1]) if "_" in name else 1)
                                       for name, slot in slots.items())]
        measurements = measure(cases, ctx.repeats)
        held = conn.execute("select count(*) from pgque.held_event").fetchone()
    return SuiteResult(parameters={"events_per_run": events, "piece": PIECE,
                                   "tick_every": TICK_EVERY, "blocked": list(BLOCKED),
                                   "hot_per_tick": HOT_PER_TICK, "repeats": ctx.repeats,
                                   "held_events_at_end": held[0] if held else None},
                       measurements=measurements)


SUITE = register(Suite(
    name="pause",
    description="draining a slot's other keys with 0 to 10,000 blocked keys, and a hot one",
    run=run,
))
