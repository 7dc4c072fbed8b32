"""Suite ``dimensions``: per-event costs as a group's work grows in every other direction.

Issue 32 asks for curves of the per-event cost against slots per group (1 to
256), groups per queue (1 to 100), distinct keys (10 to 1,000,000) and
backlog (up to 10,000,000 events), with no step over 1.5x between the ends
(the queue count has its own suite, ``curves``). Each point is a queue of its
own, filled and drained on one connection:

* ``send_batch``: batches of 1,000 events, a tick after each (the producer's
  side, and the ticks the ticker would make);
* ``drain``: every slot of every group claimed by this session, and the events
  received and acked the way the Worker's set path does (``receive_slots``
  and ``ack_slots``: all slots of a group in one round trip each way), in
  pieces of 100; the cost is per event and group, since every group reads
  every event;
* ``tick`` and ``maint``: one forced tick of the queue and one maintenance
  pass of it, on the filled queue (per call, ms).

For the backlog curve the queue holds that many events, unread, before the
timed part, which sends 10,000 more and drains the first 10,000 (pieces of the
head of the log). Wall time on the
client, medians of ``repeats`` rounds (the backlog points: one round, the
10,000,000 fill alone takes minutes).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import pgque
from bench.measure import BenchError, Measurement
from bench.registry import Suite, SuiteContext, SuiteResult, register

__all__ = ["SUITE"]

BATCH = 1_000  # events per send_batch, and per tick
PIECE = 100  # the Worker's default max_events
EVENTS = 20_000  # per point (the keys curve: 100,000)
KEYS = 10_000  # distinct keys, where the curve is not about keys
SLOTS = 16  # slots of the group, where the curve is not about slots
GROUP_SLOTS = 4  # slots of each group on the groups curve
US = "µs"
MS = "ms"

SLOT_COUNTS = (1, 4, 16, 64, 256)
GROUP_COUNTS = (1, 10, 100)
KEY_COUNTS = (10, 1_000, 100_000, 1_000_000)
BACKLOGS = (10_000, 100_000, 1_000_000, 10_000_000)
QUICK = {"slots": (1, 16, 64), "groups": (1, 10), "keys": (10, 1_000, 100_000),
         "backlog": (10_000, 100_000)}


def _events(count: int, keys: int, start: int = 0) -> list[tuple[str, dict[str, Any], str]]:
    return [("e", {"n": n}, f"k{n % keys}") for n in range(start, start + count)]


def _fill(client: pgque.Client, queue: str, count: int, keys: int, start: int = 0) -> float:
    """Send count events in batches of BATCH, a tick after each; the seconds taken."""
    started = time.perf_counter()
    for first in range(start, start + count, BATCH):
        client.send_batch(queue, _events(min(BATCH, start + count - first), keys, first))
        client.tick(queue)
    return time.perf_counter() - started


def _drain(client: pgque.Client, queue: str, groups: int, slots: int,
           limit: int) -> tuple[float, int]:
    """Receive and ack at least limit events per group (or every one there is),
    every slot of a group in one round trip each way; the seconds taken and the
    events received in all."""
    started = time.perf_counter()
    received = 0
    for group in range(groups):
        mine = 0
        while mine < limit and (batches := client.receive_slots(
                queue, f"g{group}", slots=slots, owned=range(slots), max_events=PIECE)):
            mine += sum(len(batch) for batch in batches)
            client.ack_slots(batches)
        if mine < limit:
            raise BenchError(f"{queue}: group g{group} received {mine} events of {limit}")
        received += mine
    return time.perf_counter() - started, received


def _point(client: pgque.Client, queue: str, *, slots: int, groups: int, keys: int,
           events: int, backlog: int) -> dict[str, float]:
    """One point: a queue of its own with its groups, every slot claimed here,
    the backlog sent first (untimed), then events sent and (from the head of the
    log) as many drained, timed."""
    client.create_queue(queue, ticker_max_count=BATCH)
    for group in range(groups):
        client.subscribe_slots(queue, f"g{group}", slots=slots)
        for slot in range(slots):
            if not client.claim_slot(queue, f"g{group}", slot):
                raise BenchError(f"{queue}: could not claim slot {slot} of g{group}")
    client.maintenance(queue)  # slot indexes and the batch reader, before the fill
    try:
        if backlog:
            _fill(client, queue, backlog, keys)
        sent = _fill(client, queue, events, keys, start=backlog)
        drained, received = _drain(client, queue, groups, slots, events)
        tick = _timed_ms(lambda: client.tick(queue))
        maint = _timed_ms(lambda: client.maintenance(queue))
    finally:
        for group in range(groups):
            for slot in range(slots):
                client.release_slot(queue, f"g{group}", slot)
        client.drop_queue(queue, force=True)
    return {"send_batch": sent / events * 1e6, "drain": drained / received * 1e6,
            "tick": tick, "maint": maint}


def _timed_ms(work: Any) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1e3


CURVES = {
    # name: (label, the varied parameter's values, point arguments for one value)
    "slots": ("slots per group (one group, 10,000 keys)", SLOT_COUNTS,
              lambda n: {"slots": n, "groups": 1, "keys": KEYS, "events": EVENTS, "backlog": 0}),
    "groups": (f"groups per queue ({GROUP_SLOTS} slots each)", GROUP_COUNTS,
               lambda n: {"slots": GROUP_SLOTS, "groups": n, "keys": KEYS, "events": EVENTS,
                          "backlog": 0}),
    "keys": (f"distinct keys (one group of {SLOTS} slots, 100,000 events)", KEY_COUNTS,
             lambda n: {"slots": SLOTS, "groups": 1, "keys": n, "events": 100_000,
                        "backlog": 0}),
    "backlog": (f"backlog before 10,000 events (one group of {SLOTS} slots)", BACKLOGS,
                lambda n: {"slots": SLOTS, "groups": 1, "keys": KEYS, "events": 10_000,
                           "backlog": n}),
}
FIGURES = {"send_batch": ("send_batch of 1,000 and its tick, an event", US),
           "drain": ("receive_slots + ack_slots, an event and group", US),
           "tick": ("a forced tick of the queue", MS),
           "maint": ("a maintenance pass of the queue", MS)}


def run(ctx: SuiteContext) -> SuiteResult:
    measurements: list[Measurement] = []
    steps: dict[str, dict[str, dict[str, float]]] = {}
    with pgque.connect(ctx.dsn, pool_size=0) as client:
        for curve, (label, values, arguments) in CURVES.items():
            values = QUICK[curve] if ctx.quick else values
            medians: dict[str, list[float]] = {name: [] for name in FIGURES}
            for value in values:
                rounds = 1 if curve == "backlog" else ctx.repeats
                points = [_point(client, f"d_{curve}_{value}_{r}", **arguments(value))
                          for r in range(rounds)]
                print(f"  {curve} {value:>10,}: " + ", ".join(
                    f"{name} {statistics.median(p[name] for p in points):.2f}"
                    for name in FIGURES), flush=True)
                for name, (figure, unit) in FIGURES.items():
                    numbers = [round(p[name], 3) for p in points]
                    median = statistics.median(numbers)
                    medians[name].append(median)
                    measurements.append(Measurement(
                        name=f"{curve}.{name}.{value}", label=f"{value:,}", events=0,
                        values=numbers, median=median, unit=unit,
                        group=f"{figure}, against {label}"))
            steps[curve] = {name: _steps(series) for name, series in medians.items()}
    parameters: dict[str, Any] = {
        "curves": {curve: list(QUICK[curve] if ctx.quick else values)
                   for curve, (_, values, _) in CURVES.items()},
        "batch": BATCH, "piece": PIECE, "events": EVENTS, "keys": KEYS, "slots": SLOTS,
        "group_slots": GROUP_SLOTS, "repeats": ctx.repeats, "steps": steps,
    }
    return SuiteResult(parameters=parameters, measurements=measurements)


def _steps(medians: list[float]) -> dict[str, float]:
    """The curve's largest step between neighbours and its end-to-end ratio."""
    steps = [b / a for a, b in itertools.pairwise(medians) if a > 0]
    return {"largest_step": round(max(steps, default=1.0), 2),
            "ends": round(medians[-1] / medians[0], 2) if medians[0] > 0 else 0.0}


SUITE = register(Suite(
    name="dimensions",
    description="per-event cost of send_batch and drain, and a tick and a maintenance pass, "
                "against slots per group, groups per queue, distinct keys and backlog",
    run=run,
    default=False,
))
