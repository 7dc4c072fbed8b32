"""The values pgque hands to and from applications: Event, Message, Batch, DeadLetter."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import msgspec

from pgque.codec import decode_payload

__all__ = ["Batch", "DeadLetter", "Event", "Fence", "Lease", "Message", "SentId"]

T = TypeVar("T")


class Event(msgspec.Struct, frozen=True):
    """An event to send: its type, its payload and, optionally, its partition
    key, a delay (``deliver_at`` a time, or ``deliver_after`` seconds or a
    timedelta by the database's clock) and an idempotency key; see
    :meth:`~pgque.Client.send`."""

    type: str
    payload: Any = None
    partition_key: str | None = None
    deliver_at: datetime | None = None
    deliver_after: float | timedelta | None = None
    idempotency_key: str | None = None


class SentId(int):
    """The id a send returns: an ``int``, the event's id in the log (a delayed
    event's too: it enters the log with it), that also says what the send did.

    ``duplicate`` is True when the send's idempotency key had been sent within
    the queue's window: nothing was written, and the id is the first send's.
    ``deliver_at`` is the time a delayed event enters the log, else None.
    """

    duplicate: bool = False
    deliver_at: datetime | None = None

    @classmethod
    def of(cls, event_id: int, duplicate: bool, deliver_at: datetime | None) -> SentId:
        """The id ``event_id`` with what its send did."""
        sent = cls(event_id)
        if duplicate:
            sent.duplicate = True
        if deliver_at is not None:
            sent.deliver_at = deliver_at
        return sent

    def __str__(self) -> str:
        return int.__repr__(self)  # printed and formatted as the int it is

    def __repr__(self) -> str:
        notes = (", duplicate" if self.duplicate else "") + (
            f", deliver_at={self.deliver_at.isoformat()}" if self.deliver_at else "")
        return f"SentId({int(self)}{notes})"


class Fence(msgspec.Struct, frozen=True):
    """The fencing token of a slot's batch: the slot and the epoch its owner
    received it under. ``Client.check_fence(fence)``, in the transaction that
    writes a handler's effects, raises :class:`~pgque.StaleEpoch` once the
    slot has passed to another owner. Epochs only grow, so ``epoch`` also
    serves as a token for systems outside PostgreSQL (reject a write whose
    epoch is lower than the highest one seen for the slot); an epoch carries
    its server's timeline (times 2^40), so after a failover the new primary's
    are above the old one's."""

    queue: str
    consumer: str
    slot: int
    epoch: int


@dataclass(frozen=True)
class Lease:
    """A lease of a consumer group that owns its slots by lease (see
    :meth:`~pgque.Client.take_lease`): its id (what ``group_status`` shows as
    the owner of the slots it claimed), its token, which is the holder's
    identity in every call and kept out of the repr, and the group's lease
    time, after which it expires unless renewed."""

    id: int
    token: str = field(repr=False)
    lease: timedelta


class Message(msgspec.Struct, Generic[T], gc=False, eq=False):
    """One event as a consumer receives it.

    ``payload`` is decoded from JSON on first access (into ``payload_type``
    when the receive call gave one), so an event whose payload does not fit
    the type reaches the handler as a :class:`~pgque.PayloadError` that it
    can nack, instead of failing the whole batch. ``data`` is the raw JSON.
    ``fence`` is the batch's :class:`Fence` for a slot's event, else None.
    ``delayed_id`` is, for an event sent delayed, the id its send returned: it
    entered the log with a new id (``id``) when it fell due; else None.

    Messages are compared by identity. They are not tracked by Python's cycle
    collector: a consumer makes thousands a second, and collecting them took a
    third of the client's time per event. So a payload that refers back to
    its message (a cycle) stays in memory until the process ends.
    """

    id: int
    type: str
    data: str | None
    partition_key: str | None
    retry_count: int
    created_at: datetime
    payload_type: builtins.type[T] | None = None  # `type` is a field's name here
    fence: Fence | None = None
    delayed_id: int | None = None
    _decoded: tuple[T] | None = None

    @property
    def payload(self) -> T:
        """The payload, decoded (and cached) on first access."""
        if self._decoded is None:
            self._decoded = (decode_payload(self.data, self.payload_type),)
        return self._decoded[0]

    def __repr__(self) -> str:
        return (f"Message(id={self.id}, type={self.type!r}, partition_key={self.partition_key!r}, "
                f"retry_count={self.retry_count}, data={self.data!r})")


@dataclass(frozen=True)
class Batch(Generic[T]):
    """A piece of a consumer's open batch: the messages to handle, then ack.

    ``slot``, ``slots`` and ``fence`` are set for batches of a partitioned
    consumer.
    """

    queue: str
    consumer: str
    batch_id: int
    messages: list[Message[T]] = field(default_factory=list)
    slot: int | None = None
    slots: int | None = None
    fence: Fence | None = None

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        # A batch with no messages still has to be acked: never let
        # `while batch := client.receive(...)` stop at an empty one.
        return True

    def __iter__(self) -> Iterator[Message[T]]:
        return iter(self.messages)


class DeadLetter(msgspec.Struct, frozen=True):
    """An event that failed more often than its queue allows, with the reason."""

    id: int
    consumer: str
    failed_at: datetime
    reason: str | None
    event_id: int
    created_at: datetime
    retry_count: int
    type: str
    data: str | None
    partition_key: str | None

    @property
    def payload(self) -> Any:
        """The payload decoded from JSON."""
        return decode_payload(self.data, None)


class FailurePolicy(msgspec.Struct, frozen=True):
    """What a failed event does to its key in a consumer group (see
    docs/concepts.md): ``"skip"`` (it is retried later, the key moves on) or
    ``"pause"`` (the key waits for it), and the bounds of a pause (None: no
    bound): after ``max_attempts`` failures of the key's head, or once it has
    blocked the key for ``pause_timeout``, the head goes to the dead letters;
    ``max_retries``, the group's retries of a failed event under skip (None:
    the queue's)."""

    policy: str
    max_attempts: int | None
    pause_timeout: timedelta | None
    max_retries: int | None = None  # under skip; None: the queue's


class BlockedKey(msgspec.Struct, frozen=True):
    """A key that a failed event blocks in its slot, under the pause policy:
    the head (the event that failed), how it failed, and what waits behind it."""

    slot: int
    key: str
    event_id: int
    created_at: datetime
    type: str | None
    data: str | None
    attempts: int
    first_error: str | None
    last_error: str | None
    blocked_since: datetime
    last_failure: datetime | None
    retry_at: datetime
    held_behind: int

    @property
    def payload(self) -> Any:
        """The head's payload decoded from JSON."""
        return decode_payload(self.data, None)
