"""What the demo's producers send, and sending it.

A multi-tenant storage service emits FileCreated / FileOverwritten /
FileDeleted events, keyed by tenant. The whole workload is planned up front
from a seed (:func:`plan_workload`), so every run of the same options sends the
same events; :func:`produce` sends one producer's share, in order, each
transaction committed before the next, as per-key order requires.

Each event carries its fate in the payload for the handler to act on: about 1%
fail their first attempt (the skip policy retries them) and one always fails
(it must end up in dead letters).
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pgque
from pgque.demo.checks import Sent

__all__ = ["KINDS", "Workload", "plan_workload", "produce"]

KINDS = ("FileCreated", "FileOverwritten", "FileDeleted")


@dataclass
class Workload:
    """The events to send, per producer, decided up front from the seed."""

    streams: list[list[pgque.Event]] = field(default_factory=list)
    fates: list[list[str]] = field(default_factory=list)


def plan_workload(events: int, tenants: int, producers: int, flaky: float,
                  seed: int) -> Workload:
    """Split ``events`` over the producers. Tenant sizes follow a mild Zipf law; each
    tenant's files go through create, overwrite and delete. About ``flaky`` of the
    events fail their first attempt; the middle event of producer 0 always fails."""
    rng = random.Random(seed)
    names = [f"tenant-{n:03d}" for n in range(tenants)]
    weights = list(itertools.accumulate(1 / (rank + 1) ** 0.6 for rank in range(tenants)))
    work = Workload()
    for producer in range(producers):
        count = events // producers + (producer < events % producers)
        files: dict[str, list[str]] = defaultdict(list)
        stream: list[pgque.Event] = []
        fates: list[str] = []
        for seq in range(count):
            tenant = rng.choices(names, cum_weights=weights)[0]
            mine = files[tenant]
            kind = "FileCreated" if not mine else rng.choices(KINDS, weights=(4, 4, 2))[0]
            if kind == "FileCreated":
                mine.append(f"/{tenant}/p{producer}/f{seq}.dat")
                path = mine[-1]
            elif kind == "FileOverwritten":
                path = rng.choice(mine)
            else:
                path = mine.pop(rng.randrange(len(mine)))
            fate = ("doomed" if producer == 0 and seq == count // 2
                    else "flaky" if rng.random() < flaky else "ok")
            fail = {"doomed": "always", "flaky": "once"}.get(fate)
            stream.append(pgque.Event(kind, {"path": path, "size": rng.randint(0, 1 << 24),
                                             "producer": producer, "seq": seq, "fail": fail},
                                      tenant))
            fates.append(fate)
        work.streams.append(stream)
        work.fates.append(fates)
    return work


def produce(dsn: str, queue: str, producer: int, work: Workload, chunk: int,
            on_sent: Callable[[int], None], halfway: threading.Barrier | None = None,
            stop: threading.Event | None = None) -> list[Sent]:
    """Send one producer's stream in order, ``chunk`` events per transaction, each
    committed before the next is sent; returns what was sent, in send order.

    With ``halfway``, waits at that barrier (with the other producers and the demo)
    once half the stream is sent, and again before going on. Stops early once
    ``stop`` is set.
    """
    stream, fates = work.streams[producer], work.fates[producer]
    pause = (len(stream) // 2) // chunk * chunk if halfway is not None else -1
    sent: list[Sent] = []
    with pgque.connect(dsn, pool_size=0) as client:
        for start in range(0, len(stream), chunk):
            if stop is not None and stop.is_set():
                break
            if start == pause and halfway is not None:
                halfway.wait()  # everyone is halfway: the demo restarts a worker
                halfway.wait()  # the restart is done
            events = stream[start:start + chunk]
            ids = client.send_batch(queue, events)
            for seq, (event, ev_id) in enumerate(zip(events, ids, strict=True), start):
                assert event.partition_key is not None
                sent.append(Sent(ev_id, producer, seq, event.partition_key, fates[seq],
                                 event.payload["size"]))
            on_sent(len(events))
    return sent
