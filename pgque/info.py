"""What operators look at: the records of the info calls and of group_status.

Each record is one row of a view or function in ``pgque/sql/code/info/info.sql``
and ``slots/groups.sql``; its fields are the columns, by name. ``stalled``
fields are judged against ``stalled_after``: the threshold the call was given,
else the queue's own (twice its ``ticker_idle_period``, at least 10 seconds). They are frozen
msgspec structs: typed, cheap, and encodable as JSON with
``msgspec.json.encode`` (intervals as ISO 8601 durations) or
``msgspec.structs.asdict``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, TypeVar

import msgspec

__all__ = ["ConsumerInfo", "Finding", "GroupInfo", "GroupStatus", "HandlingSummary", "KeyLag",
           "QueueInfo", "SlotOwner", "SlotStatus", "TickerInfo", "Verification", "from_row"]

R = TypeVar("R", bound=msgspec.Struct)


def from_row(record: type[R], row: dict[str, Any]) -> R:
    """The record made from a row's columns. Columns the record does not know are
    left out, so a client keeps working while a newer schema adds columns."""
    return msgspec.convert(row, record)


class QueueInfo(msgspec.Struct, frozen=True):
    """A queue: its settings, its newest tick and how much was sent since, its
    subscriptions (those the caller may use, unless it is an admin), whether
    it is stalled (events wait for a tick that nobody makes), its delayed events
    not in the log yet (how many, and the next one's due time) and how many
    idempotency keys it remembers."""

    queue_name: str
    queue_id: int
    event_tables: int
    current_table: int
    rotation_period: timedelta
    last_rotation: datetime
    ticker_max_count: int
    ticker_max_lag: timedelta
    ticker_idle_period: timedelta
    max_retries: int
    last_tick_id: int | None
    last_tick_time: datetime | None
    last_tick_age: timedelta | None
    event_seq: int
    events_since_last_tick: int
    consumers: int
    stalled_after: timedelta
    stalled: bool
    delayed_events: int
    next_delivery: datetime | None
    idempotency_window: timedelta
    idempotency_keys: int


class ConsumerInfo(msgspec.Struct, frozen=True):
    """A subscription (a plain consumer, or one slot of a group, named
    ``group#slot/slots``): its cursor, its lag and what waits for it."""

    queue_name: str
    consumer_name: str
    sub_id: int
    last_tick_id: int | None
    last_tick_time: datetime | None
    lag: timedelta | None
    ticks_behind: int
    pending_events: int
    open_batch_id: int | None
    last_active: datetime | None
    oldest_unconsumed_age: timedelta | None
    retries_waiting: int
    dead_letters: int


class SlotStatus(msgspec.Struct, frozen=True):
    """One slot of a consumer group: its owner (backend pid, and the application
    name its session set: a Worker's lane is ``<worker name>-lane<n>``), its
    current fencing epoch, its backlog, whether it looks stalled (an event
    waited longer than ``stalled_after`` while nobody owns or moves the slot),
    and its blocked keys under the pause policy with the oldest one's wait.
    ``pending_events`` is None when the slot's backlog could not be counted: a
    ``drop_queue`` in progress holds the queue's tables (the view waits 100 ms
    for them, then says so)."""

    queue_name: str
    consumer_name: str
    slot: int
    slots: int
    owner_pid: int | None
    owner_name: str | None
    epoch: int | None
    pending_events: int | None
    ticks_behind: int
    oldest_unconsumed_age: timedelta | None
    lag: timedelta | None
    open_batch_id: int | None
    last_active: datetime | None
    retries_waiting: int
    dead_letters: int
    stalled_after: timedelta
    stalled: bool
    blocked_keys: int
    oldest_blocked_age: timedelta | None
    #: In a group that owns its slots by lease, the lease owning the slot (whose
    #: name is ``owner_name``; ``owner_pid`` is then None); None otherwise.
    owner_lease: int | None = None

    @property
    def owned(self) -> bool:
        """Whether a session (or, by lease, a live lease) owns the slot."""
        return self.owner_pid is not None or self.owner_lease is not None


class GroupInfo(msgspec.Struct, frozen=True):
    """A consumer group: its slot count, its live members (sessions that joined it:
    one per Worker), how many slots have an owner, and the newest epoch of its
    slots (None before any slot received); its failure policy with the bounds of a
    pause (None: no bound) and its own max_retries (None: the queue's), its
    blocked keys and its dead letters."""

    queue_name: str
    consumer_name: str
    slots: int
    members: int
    owned_slots: int
    newest_epoch: int | None
    failure_policy: str
    max_attempts: int | None
    pause_timeout: timedelta | None
    max_retries: int | None
    blocked_keys: int
    dead_letters: int


class TickerInfo(msgspec.Struct, frozen=True):
    """The database's active ticker: its backend pid and the application name its
    session set (a Worker's is ``<worker name>-ticker``); both None when no
    ticker is active."""

    active_pid: int | None
    active_name: str | None


class GeneratedCode(msgspec.Struct, frozen=True):
    """A piece of the code pgque generates from its tables (the event writer, a
    queue's batch reader, a queue's slot indexes), and whether it is current. One
    that lags is never wrong: what it serves runs the slower dynamic way until
    maintenance (the Ticker) writes it again."""

    kind: str
    queue_name: str | None
    name: str
    current: bool


class SlotOwner(msgspec.Struct, frozen=True):
    """One slot of a consumer group as group_status sees it."""

    slot: int
    owner_pid: int | None
    mine: bool


class GroupStatus(msgspec.Struct, frozen=True):
    """A consumer group now: its live members, this session's rank among them
    (by backend pid, 0-based; None when not a member) and each slot's owner."""

    members: int
    my_rank: int | None
    slots: tuple[SlotOwner, ...]

    @property
    def owned(self) -> list[int]:
        """The slots this session owns."""
        return [s.slot for s in self.slots if s.mine]

    def fair_share(self) -> int:
        """How many slots this session should own: the members' integer share, plus
        one for the first ``len(slots) % members`` ranks (the shares add up)."""
        if self.my_rank is None or self.members == 0:
            return 0
        count = len(self.slots)
        return count // self.members + (1 if self.my_rank < count % self.members else 0)


class HandlingSummary(msgspec.Struct, frozen=True):
    """What a group's record of handler calls holds from ``since`` on (when its
    recording began, unless the verifier was given a time): how many calls, of
    how many events and keys, by how many workers, from the first call's start
    to the last one's end."""

    since: datetime
    calls: int
    events: int
    keys: int
    workers: int
    first_call: datetime | None
    last_call: datetime | None


class Finding(msgspec.Struct, frozen=True):
    """One thing ``verify`` found in a group's record of handler calls.

    ``kind``: ``misrouted`` (a key's event handled in a slot it does not route
    to), ``reorder`` (an event first handled after one of its key with a larger
    id from the same batch or a later one),
    ``paused`` (an event of a key handled while the key was held behind an
    earlier event's failure, pause policy: not a violation by itself, since an
    operator's ``resume_key`` or ``skip_head`` releases a key and the record
    does not hold that), ``overlap`` (two calls of one key at once),
    ``zombie_window`` (the previous owner's call still running when the new
    owner started one of its key: documented, not a violation) or ``lost``
    (an event the slot passed with no call that returned, no dead letter and
    no retry to come). ``ev_id`` is the event found, ``other_ev_id`` the one
    it came after, overlapped or was held behind; ``at`` when it happened."""

    kind: str
    violation: bool
    slot: int
    partition_key: str | None
    ev_id: int
    other_ev_id: int | None
    at: datetime
    detail: str


class Verification(msgspec.Struct, frozen=True):
    """The result of ``verify``: what was checked and what was found."""

    summary: HandlingSummary
    findings: list[Finding]

    @property
    def violations(self) -> list[Finding]:
        """The findings that break a promise (all but zombie windows and calls
        while their key was paused)."""
        return [finding for finding in self.findings if finding.violation]

    @property
    def ok(self) -> bool:
        """True when nothing breaks a promise."""
        return not self.violations


class KeyLag(msgspec.Struct, frozen=True):
    """A key of a consumer group with events waiting: its slot, how many of its
    events the slot has not consumed yet (its open batch included), and when
    the oldest of them was sent. ``partition_key`` None: events sent without
    a key (slot 0)."""

    partition_key: str | None
    slot: int
    pending: int
    oldest: datetime
