"""What the sync and the async client share: everything that does no I/O.

:mod:`pgque.client_async` (the source) and :mod:`pgque.client` (generated from
it) both import these, so they exist once: encoding arguments, decoding rows
into records, the connection-type check (DSN redaction is :mod:`pgque._dsn`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, TypeVar

import msgspec
import psycopg
from psycopg.types.numeric import Int8BinaryLoader

from pgque.codec import encode_payloads
from pgque.errors import InvalidArgument, InvalidDelay, SessionUnstable
from pgque.info import GroupStatus, SlotOwner
from pgque.types import Batch, BlockedKey, DeadLetter, Event, Fence, Message

# The time a binary timestamptz counts microseconds from.
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)

T = TypeVar("T")
EventLike = Event | tuple[str, Any] | tuple[str, Any, "str | None"]

# A connection in one of these states is inside a transaction the caller opened.
IN_TRANSACTION = (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.INERROR)

# Statement errors that, on a pinned session, mean the server session changed.
PREPARED_STATEMENT_ERRORS = (psycopg.errors.InvalidSqlStatementName,
                             psycopg.errors.DuplicatePreparedStatement)

# Each client class and the psycopg connection class it runs on.
_CONNECTION_OF = {"Client": "Connection", "AsyncClient": "AsyncConnection"}


def check_connection(conn: object, expected: type, client: str) -> None:
    """Raise TypeError unless ``conn`` is an ``expected`` (the psycopg connection
    class that the class named ``client`` runs on), naming the class to use."""
    if isinstance(conn, expected):
        return
    kind = type(conn)
    if isinstance(conn, psycopg.Connection | psycopg.AsyncConnection):
        other = next(c for c, k in _CONNECTION_OF.items()
                     if isinstance(conn, getattr(psycopg, k)))
        raise TypeError(f"pgque.{client} needs a psycopg.{expected.__name__}, not a "
                        f"psycopg.{kind.__name__}: use pgque.{other} for that one")
    raise TypeError(f"pgque.{client} needs a psycopg.{expected.__name__}, "
                    f"not {kind.__module__}.{kind.__qualname__}")


def sends_here(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether a send of the caller that made the client goes on the client's own
    connection (Client._producer): into a transaction open there, or on its own
    when the connection is idle in autocommit: not busy with a statement, not
    broken, not in pipeline mode (where statements share an implicit
    transaction until the next sync, which a later error there rolls back),
    and its lock free (psycopg holds it across the yields of ``notifies()``
    and ``stream()``: the send would wait for the loop to end, for ever when
    the loop is the caller's own). A check, not a claim: another thread's
    call (under asyncio, a task's already waiting for the lock) can still get
    the connection first, and the send then runs after it, in the transaction
    that call opens if it opens one (as when it is open at the send)."""
    status = conn.info.transaction_status
    if status in IN_TRANSACTION:
        return True
    return (status == psycopg.pq.TransactionStatus.IDLE and conn.autocommit
            and conn.info.pipeline_status == psycopg.pq.PipelineStatus.OFF
            and not conn.lock.locked())


def session_changed(exc: psycopg.Error) -> SessionUnstable:
    """The error for a prepared statement missing from (or already on) the pinned
    server session: the session changed under the client."""
    return SessionUnstable(
        f"the server session behind this connection changed ({exc}): is a "
        "transaction-mode pooler in between? Connect directly, or through "
        "a pooler in session mode.")


def seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def config_json(config: dict[str, float | timedelta | str]) -> str:
    return msgspec.json.encode(
        {k: v.total_seconds() if isinstance(v, timedelta) else v for k, v in config.items()}
    ).decode()


def event_columns(events: Sequence[EventLike],
                  ) -> tuple[list[str], list[str], list[str | None], bool]:
    """The types, encoded payloads and partition keys of ``send_batch``'s events,
    and whether any of them is an Event with a delay or an idempotency key."""
    if all(type(event) is tuple for event in events):
        # The common form, (type, payload, key) tuples: one transposition in C.
        # Tuples only, which the loop below can read again: a shorter one
        # leaves fewer than three columns.
        try:
            types, payloads, keys = (list(column) for column in zip(*events, strict=False))
        except ValueError:
            pass
        else:
            return types, encode_payloads(payloads), keys, False
    types = []
    payloads = []
    keys = []
    options = False
    for event in events:
        if isinstance(event, Event):
            etype, payload, key = event.type, event.payload, event.partition_key
            options = options or (event.deliver_at is not None
                                  or event.deliver_after is not None
                                  or event.idempotency_key is not None)
        else:
            etype, payload, key = (*event, None)[:3]
        types.append(etype)
        payloads.append(payload)
        keys.append(key)
    return types, encode_payloads(payloads), keys, options


def check_deliver_at(deliver_at: datetime | None) -> datetime | None:
    """``deliver_at`` as given, once it is known to be timezone-aware: a naive
    datetime would be read in the server session's time zone."""
    if deliver_at is not None and deliver_at.utcoffset() is None:
        raise InvalidDelay(f"deliver_at {deliver_at.isoformat()} has no time zone; "
                           "give an aware datetime (e.g. datetime.now(timezone.utc))")
    return deliver_at


def delay(deliver_after: float | timedelta | None) -> timedelta | None:
    """``deliver_after`` as a timedelta (seconds may be given as a number);
    InvalidDelay for a number no timedelta holds (NaN, infinite, too large)."""
    if deliver_after is None or isinstance(deliver_after, timedelta):
        return deliver_after
    try:
        return timedelta(seconds=deliver_after)
    except (ValueError, OverflowError) as exc:
        raise InvalidDelay(f"deliver_after {deliver_after!r} is not a delay from 0 to "
                           "30 days") from exc


SendOptions = tuple[list[datetime | None] | None, list[timedelta | None] | None,
                    list[str | None] | None]


def send_options(events: Sequence[EventLike], deliver_at: datetime | None,
                 deliver_after: float | timedelta | None) -> SendOptions:
    """The deliver_at, deliver_after and idempotency key columns of ``send_batch``'s
    events (an event's own delay, else the call's), each None when it holds nothing."""
    call_at, call_after = check_deliver_at(deliver_at), delay(deliver_after)
    if call_at is not None and call_after is not None:
        raise InvalidArgument("send_batch takes deliver_at or deliver_after, not both")
    ats: list[datetime | None] = []
    afters: list[timedelta | None] = []
    keys: list[str | None] = []
    for event in events:
        if isinstance(event, Event):
            keys.append(event.idempotency_key)
            if event.deliver_at is not None or event.deliver_after is not None:
                ats.append(check_deliver_at(event.deliver_at))
                afters.append(delay(event.deliver_after))
                continue
        else:
            keys.append(None)
        ats.append(call_at)
        afters.append(call_after)
    return (ats if any(a is not None for a in ats) else None,
            afters if any(a is not None for a in afters) else None,
            keys if any(k is not None for k in keys) else None)


def message_ids(messages: Message[Any] | int | Iterable[Message[Any] | int]) -> list[int]:
    if isinstance(messages, (Message, int)):
        messages = [messages]
    return [m.id if isinstance(m, Message) else int(m) for m in messages]


def nacked(nack: Mapping[int, str | None] | Iterable[Message[Any] | int],
           ) -> tuple[list[int], list[str | None]]:
    """``ack``'s ``nack`` argument as event ids and their reasons (one None for all
    when no reasons are given)."""
    if isinstance(nack, Mapping):
        return list(nack), list(nack.values())
    return message_ids(nack), [None]


#: When failed events come back: one delay for all, or a delay per event id
#: (those not named: none).
RetryAfter = float | timedelta | Mapping[int, float | timedelta]


def failure_delays(ids: Sequence[int], retry_after: RetryAfter
                   ) -> tuple[float, list[timedelta | None] | None]:
    """``ack``'s ``retry_after`` as the delay for all (seconds) and, when given per
    event, one delay per id of ``ids`` (None: the delay for all). Negative ones
    are the server's to refuse."""
    if not isinstance(retry_after, Mapping):
        return seconds(retry_after), None
    if not retry_after:
        return 0.0, None  # no event has a delay of its own
    unknown = set(retry_after) - set(ids)
    if unknown:
        raise ValueError(f"retry_after names events {sorted(unknown)} that are not nacked")
    per_id = [None if i not in retry_after else timedelta(seconds=seconds(retry_after[i]))
              for i in ids]
    return 0.0, per_id


def raw_timestamps(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
    """Make the cursor load binary timestamptz values as PostgreSQL stores them,
    microseconds since 2000-01-01 UTC: the same eight bytes as a bigint, read
    by psycopg's C loader for bigints. For the receives: the events of a send
    share its time, so batch_from_rows makes a datetime once per time."""
    cursor.adapters.register_loader("timestamptz", Int8BinaryLoader)


def batch_from_rows(queue: str, consumer: str, rows: Sequence[Sequence[Any]],
                    payload_type: type[T] | None, slot: int | None = None,
                    slots: int | None = None, *, slot_first: bool = False,
                    zone: tzinfo | None = None) -> Batch[Any] | None:
    """Build a Batch from pgque.batch_event rows, as plain tuples in the type's
    column order (batch_id, ev_id, ev_time, ev_retry, ev_type, ev_data,
    ev_extra1, epoch, slot, delayed_id), or with ``slot_first`` in
    receive_slots' (slot, batch_id, ..., epoch, delayed_id); None when there
    are no rows. ev_time as raw_timestamps loads it; the messages show it in
    ``zone`` (the session's, as psycopg would). Tuples, positional arguments
    and constant indexes, not named rows and keywords: this runs once per
    event received, and the names cost about a third of the client's time per
    event."""
    if not rows:
        return None
    first = rows[0]
    c = 1 if slot_first else 0  # where batch_id is; delayed_id is column 9 in both
    # Only a slot's batch has an epoch; a schema older than 0.2 has no column for it.
    epoch = first[c + 7] if len(first) > c + 7 else None
    fence = None if slot is None or epoch is None else Fence(queue, consumer, slot, epoch)
    # One datetime per time (a row with no event has none).
    times = {us: pg_time(us, zone) for us in {r[c + 2] for r in rows} if us is not None}
    if len(first) <= 9:  # a schema older than 0.7 has no delayed_id
        messages = [Message(r[c + 1], r[c + 4], r[c + 5], r[c + 6], r[c + 3], times[r[c + 2]],
                            payload_type, fence)
                    for r in rows if r[c + 1] is not None]
    elif slot_first:
        messages = [Message(r[2], r[5], r[6], r[7], r[4], times[r[3]], payload_type, fence, r[9])
                    for r in rows if r[2] is not None]
    else:
        messages = [Message(r[1], r[4], r[5], r[6], r[3], times[r[2]], payload_type, fence, r[9])
                    for r in rows if r[1] is not None]
    return Batch(queue=queue, consumer=consumer, batch_id=first[c], messages=messages,
                 slot=slot, slots=slots, fence=fence)


def pg_time(microseconds: int, zone: tzinfo | None) -> datetime:
    """A timestamptz as raw_timestamps loads it, as the aware datetime psycopg
    would have made of it in the session's time zone ``zone`` (None: UTC)."""
    time = _PG_EPOCH + timedelta(microseconds=microseconds)
    return time if zone is None else time.astimezone(zone)


def group_status_from_row(row: Any) -> GroupStatus:
    """A GroupStatus from pgque.group_status's row, read by name."""
    return GroupStatus(
        members=row.members, my_rank=row.my_rank,
        slots=tuple(SlotOwner(slot=n, owner_pid=pid, mine=pid == row.my_pid)
                    for n, pid in enumerate(row.owner_pids)))


def dead_letters_from_rows(rows: list[Any]) -> list[DeadLetter]:
    """DeadLetters from pgque.dead_letters rows, read by name."""
    return [DeadLetter(id=r.dl_id, consumer=r.consumer, failed_at=r.dl_time, reason=r.reason,
                       event_id=r.ev_id, created_at=r.ev_time, retry_count=r.ev_retry,
                       type=r.ev_type, data=r.ev_data, partition_key=r.ev_extra1)
            for r in rows]


def blocked_keys_from_rows(rows: list[Any]) -> list[BlockedKey]:
    """BlockedKeys from pgque.blocked_keys rows, read by name."""
    return [BlockedKey(slot=r.slot, key=r.key, event_id=r.ev_id, created_at=r.ev_time,
                       type=r.ev_type, data=r.ev_data, attempts=r.attempts,
                       first_error=r.first_error, last_error=r.last_error,
                       blocked_since=r.blocked_since, last_failure=r.last_failure,
                       retry_at=r.retry_at, held_behind=r.held_behind)
            for r in rows]
