"""What the dashboard shows, read from the database: the figures of
``pgque.metrics()`` (one query, the exporter's: cheap at thousands of slots),
sampled by one task for every page, with the last hour of each queue's rates
kept for the charts."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgque.metrics import parse_labels

log = logging.getLogger("pgque.dashboard")

@dataclass
class Slot:
    slot: int
    owner: str | None = None
    pid: int | None = None
    epoch: int | None = None
    behind_events: float | None = None
    lag_seconds: float | None = None
    retries_waiting: float = 0
    dead_letters: float = 0
    blocked_keys: float = 0
    oldest_blocked_age_seconds: float | None = None
    last_active_age_seconds: float | None = None
    stalled: bool = False


@dataclass
class Group:
    queue: str
    name: str
    slots: int = 0
    members: int = 0
    slot_rows: dict[int, Slot] = field(default_factory=dict)
    #: Events consumed per second (its slowest slot's progress) over the last hour.
    rates: list[tuple[float, float]] = field(default_factory=list)
    #: Its backlog (the slot furthest behind, in events) over the last hour.
    backlog: list[tuple[float, float]] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        return self.rates[-1][1] if self.rates else None

    @property
    def owned(self) -> int:
        return sum(1 for s in self.slot_rows.values() if s.owner is not None)

    @property
    def fair_share(self) -> int:
        """Slots each member should own: N over the members, rounded up."""
        return -(-self.slots // self.members) if self.members else 0

    @property
    def stalled(self) -> int:
        return sum(1 for s in self.slot_rows.values() if s.stalled)

    @property
    def max_lag(self) -> float:
        return max((s.lag_seconds or 0 for s in self.slot_rows.values()), default=0.0)

    @property
    def max_behind(self) -> float:
        return max((s.behind_events or 0 for s in self.slot_rows.values()), default=0.0)

    @property
    def dead_letters(self) -> float:
        return sum(s.dead_letters for s in self.slot_rows.values())

    @property
    def retries_waiting(self) -> float:
        return sum(s.retries_waiting for s in self.slot_rows.values())


@dataclass
class Consumer:
    queue: str
    name: str
    figures: dict[str, float] = field(default_factory=dict)


@dataclass
class Queue:
    name: str
    figures: dict[str, float] = field(default_factory=dict)
    table_bytes: float = 0
    groups: dict[str, Group] = field(default_factory=dict)
    consumers: dict[str, Consumer] = field(default_factory=dict)
    #: Events sent per second over the last hour: (time, rate) pairs.
    rates: list[tuple[float, float]] = field(default_factory=list)

    @property
    def max_behind(self) -> float:
        return max((g.max_behind for g in self.groups.values()), default=0.0)

    @property
    def slowest_rate(self) -> float | None:
        """Events consumed per second by its slowest group (None: no group, or
        not two readings yet)."""
        return min((g.rate for g in self.groups.values() if g.rate is not None),
                   default=None)

    @property
    def max_lag(self) -> float:
        return max((g.max_lag for g in self.groups.values()), default=0.0)

    @property
    def rate(self) -> float | None:
        return self.rates[-1][1] if self.rates else None


@dataclass
class Snapshot:
    """One reading of pgque.metrics(), arranged by queue, group and slot."""

    taken_at: float
    queues: dict[str, Queue] = field(default_factory=dict)
    ticker_active: bool = False
    ticker_name: str | None = None
    ticker_pid: int | None = None
    newest_tick_age: float | None = None
    error: str | None = None

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[str, str, float]], taken_at: float) -> Snapshot:
        snapshot = cls(taken_at)
        for metric, label_text, value in rows:
            labels = dict(parse_labels(label_text))
            snapshot._add(metric, labels, value)
        return snapshot

    def _add(self, metric: str, labels: dict[str, str], value: float) -> None:
        if metric == "pgque_active_ticker":
            self.ticker_active = bool(value)
        elif metric == "pgque_active_ticker_info":
            self.ticker_name = labels.get("name")
            self.ticker_pid = int(labels["pid"]) if labels.get("pid") else None
        elif metric == "pgque_newest_tick_age_seconds":
            self.newest_tick_age = value
        if "queue" not in labels:
            return
        queue = self.queues.setdefault(labels["queue"], Queue(labels["queue"]))
        if metric == "pgque_queue_table_size_bytes":
            queue.table_bytes += value
        elif metric.startswith("pgque_queue_"):
            queue.figures[metric.removeprefix("pgque_queue_")] = value
        elif metric.startswith("pgque_group_"):
            group = queue.groups.setdefault(labels["group"], Group(queue.name, labels["group"]))
            setattr(group, metric.removeprefix("pgque_group_"), int(value))
        elif metric.startswith("pgque_slot_"):
            group = queue.groups.setdefault(labels["group"], Group(queue.name, labels["group"]))
            number = int(labels["slot"])
            slot = group.slot_rows.setdefault(number, Slot(number))
            name = metric.removeprefix("pgque_slot_")
            if name == "owner_info":
                slot.owner, slot.pid = labels.get("owner"), int(labels.get("pid") or 0) or None
            elif name == "epoch":
                slot.epoch = int(value)
            elif name == "stalled":
                slot.stalled = bool(value)
            elif name != "owned" and hasattr(slot, name):
                setattr(slot, name, value)
        elif metric.startswith("pgque_consumer_"):
            consumer = queue.consumers.setdefault(labels["consumer"],
                                                  Consumer(queue.name, labels["consumer"]))
            consumer.figures[metric.removeprefix("pgque_consumer_")] = value


def _rates(points: deque[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per second between consecutive (time, counter) points; never below 0."""
    return [(t1, max(0.0, (v1 - v0) / (t1 - t0)))
            for (t0, v0), (t1, v1) in itertools.pairwise(points) if t1 > t0]


class Sampler:
    """Reads pgque.metrics() every ``interval`` seconds on a connection of its
    own (the DSN's role decides what it sees) and keeps the newest snapshot and
    an hour of each queue's send rate. Pages read the snapshot, never the
    database: the dashboard's cost is one query an interval, however many
    pages are open."""

    def __init__(self, connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
                 interval: float = 5.0, history: float = 3600.0) -> None:
        self._connect = connect
        self.interval = interval
        self._sent: dict[str, deque[tuple[float, float]]] = {}
        self._keep = max(2, int(history / interval) + 1)
        self.snapshot = Snapshot(time.time(), error="not read yet")
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def read(self) -> Snapshot:
        """Take a snapshot now; on an error keep the last one, with the error said."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await self._connect()
                # A read that hangs (a network cut) must not leave the pages on
                # figures that look current: it fails, and they say so.
                await self._conn.execute("select set_config('statement_timeout', %s, false)",
                                         (f"{max(10.0, 2 * self.interval):g}s",))
            cur = await self._conn.execute(
                "select metric, labels, value from pgque.metrics()")
            rows = await cur.fetchall()
        except psycopg.Error as exc:
            log.warning("reading pgque.metrics() failed: %s",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            self.snapshot.error = type(exc).__name__ + ": " + (str(exc).strip().splitlines()
                                                                or [""])[0]
            return self.snapshot
        snapshot = Snapshot.of_rows(rows, time.time())
        now = snapshot.taken_at
        for queue in snapshot.queues.values():
            total = queue.figures.get("events_total")
            if total is None:
                continue
            queue.rates = _rates(self._history(queue.name, (now, total)))
            for group in queue.groups.values():
                # The group's slowest position, in the queue's sequence: what it
                # has consumed of the queue (all its slots past it).
                kept = self._history(f"{queue.name}\0{group.name}",
                                     (now, total - group.max_behind))
                group.rates = _rates(kept)
                group.backlog = list(self._history(f"{queue.name}\0{group.name}\0backlog",
                                                   (now, group.max_behind)))
        self.snapshot = snapshot
        return snapshot

    def _history(self, name: str, point: tuple[float, float]) -> deque[tuple[float, float]]:
        kept = self._sent.setdefault(name, deque(maxlen=self._keep))
        kept.append(point)
        return kept

    async def run(self) -> None:
        """Read every interval until cancelled."""
        try:
            while True:
                await self.read()
                await asyncio.sleep(self.interval)
        finally:
            if self._conn is not None:
                await self._conn.close()
