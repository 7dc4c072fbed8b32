"""Exceptions raised by pgque.

Every error the engine raises carries a SQLSTATE of class ``PQ``; the client
maps it to one of the classes below by that code, never by message text.
Errors from PostgreSQL that are not pgque's own (a lost connection, a
permission error) propagate as psycopg exceptions.
"""

from __future__ import annotations

from types import TracebackType

import psycopg

__all__ = [
    "AccessDenied",
    "BatchNotActive",
    "ConnectError",
    "ConsumerAccessDenied",
    "ConsumerNotFound",
    "CronUnavailable",
    "DeadLetterNotFound",
    "DependentObjects",
    "EventNotInBatch",
    "HandlerEndedTransaction",
    "HandlerReturnedAwaitable",
    "InvalidArgument",
    "InvalidConfig",
    "InvalidDSN",
    "InvalidGrant",
    "InvalidName",
    "InvalidSlot",
    "InvalidSlotCount",
    "NewerSchema",
    "NotReadCommitted",
    "PartitionKeyTooLong",
    "PayloadError",
    "PgqueError",
    "QueueAccessDenied",
    "QueueExists",
    "QueueInUse",
    "QueueNotFound",
    "SchemaNotOwned",
    "SessionUnstable",
    "SlotCountMismatch",
    "SlotNotOwned",
    "SlotSubscriptionError",
    "StaleEpoch",
]


class PgqueError(Exception):
    """Base class of every pgque error.

    ``sqlstate`` is the SQLSTATE the server raised, or None for errors found
    in the client (a payload that cannot be encoded, a bad DSN).
    """

    sqlstate: str | None = None


class ConnectError(PgqueError):
    """The database could not be reached (a bad DSN, see :class:`InvalidDSN`, or
    a server not up within the timeout). Its text never holds a password.

    ``transient`` tells whether trying again later may help (the server is
    down or starting, or libpq gave no SQLSTATE) or not (a malformed DSN, a
    server error with an SQLSTATE that retrying cannot change). libpq reports
    every failure to connect without an SQLSTATE, a missing database or role
    and bad credentials too, and pgque never matches message text: those are
    transient. Long-running services stop on an error that is not transient;
    on a transient one they retry for ever once they have connected, and stop
    when they have not connected at all within ``connect_timeout`` of starting.
    """

    transient: bool = True


class InvalidDSN(ConnectError, ValueError):
    """libpq (or psycopg) rejected the DSN, or a connection setting, before any
    attempt to connect: no retry can help (``transient`` is False).

    The message is libpq's, with every piece of the DSN that may belong to a
    password shown as ``***``; the psycopg error is not chained, since its text
    can quote the password.
    """

    transient = False


class QueueNotFound(PgqueError):
    """The queue does not exist (PQ001)."""

    sqlstate = "PQ001"


class ConsumerNotFound(PgqueError):
    """The consumer is not subscribed to the queue (PQ002)."""

    sqlstate = "PQ002"


class BatchNotActive(PgqueError):
    """The batch is not the consumer's open batch: already acked, or never opened (PQ003)."""

    sqlstate = "PQ003"


class InvalidName(PgqueError, ValueError):
    """A queue or consumer name is not allowed (PQ004)."""

    sqlstate = "PQ004"


class PayloadError(PgqueError, ValueError):
    """A payload is not JSON, cannot be encoded, or does not fit the requested type (PQ005)."""

    sqlstate = "PQ005"


class QueueExists(PgqueError):
    """A queue of that name already exists (PQ006)."""

    sqlstate = "PQ006"


class InvalidConfig(PgqueError, ValueError):
    """A queue setting is unknown or out of range (PQ007)."""

    sqlstate = "PQ007"


class NotReadCommitted(PgqueError):
    """Ticks must be made in a READ COMMITTED transaction (PQ008)."""

    sqlstate = "PQ008"


class DeadLetterNotFound(PgqueError):
    """No dead letter with that id in the queue (PQ009)."""

    sqlstate = "PQ009"


class EventNotInBatch(PgqueError):
    """A nacked event id is not among the events handed out of the batch (PQ010)."""

    sqlstate = "PQ010"


class QueueInUse(PgqueError):
    """The queue still has consumers; unsubscribe them or drop with force (PQ011)."""

    sqlstate = "PQ011"


class PartitionKeyTooLong(PgqueError, ValueError):
    """A partition key is longer than 512 bytes (PQ012)."""

    sqlstate = "PQ012"


class SchemaNotOwned(PgqueError):
    """The install refused: schema pgque, or an object in it, belongs to another role (PQ013).

    Everything in schema pgque must belong to the role that installs it; an
    object of another role there could replace what the SECURITY DEFINER
    functions call and run as the installer.
    """

    sqlstate = "PQ013"


class DependentObjects(PgqueError):
    """The install refused: objects outside schema pgque depend on its views or
    functions, which every install drops and recreates (PQ017). Drop them, install,
    and create them again."""

    sqlstate = "PQ017"


class NewerSchema(PgqueError):
    """The install refused: a newer pgque has migrated this database (PQ018).

    Migrations go forward only; install with that version or a later one.
    """

    sqlstate = "PQ018"


class AccessDenied(PgqueError):
    """Base of the refusals of pgque's own access rules (consumer ownership, queue grants).

    A role outside pgque's roles gets PostgreSQL's permission error
    (psycopg.errors.InsufficientPrivilege) instead.
    """


class ConsumerAccessDenied(AccessDenied):
    """The consumer belongs to another role, which has not granted it to this one (PQ014)."""

    sqlstate = "PQ014"


class QueueAccessDenied(AccessDenied):
    """The queue's grants leave this role out for sending or consuming (PQ015)."""

    sqlstate = "PQ015"


class InvalidGrant(PgqueError, ValueError):
    """A grant names an unknown role, or a privilege other than 'send' or 'consume' (PQ016)."""

    sqlstate = "PQ016"


class SlotSubscriptionError(PgqueError):
    """A slot subscription was used through the plain receive/ack/nack (PQ021)."""

    sqlstate = "PQ021"


class SlotCountMismatch(PgqueError, ValueError):
    """The consumer group exists with another slot count; N is fixed per group (PQ020)."""

    sqlstate = "PQ020"


class InvalidSlotCount(PgqueError, ValueError):
    """A slot count is outside 1..max_slots (PQ022)."""

    sqlstate = "PQ022"


class InvalidSlot(PgqueError, ValueError):
    """A slot number is outside 0..N-1 (PQ023)."""

    sqlstate = "PQ023"


class SlotNotOwned(PgqueError):
    """This session does not hold the slot's advisory lock (PQ024).

    Raised by receive, ack and nack of a slot: a worker that lost its session
    (and with it the lock) can never act on a batch another worker now owns.
    """

    sqlstate = "PQ024"


class SessionUnstable(PgqueError):
    """The server session behind the connection changed under the client (PQ025).

    Slot ownership and the ticker election are session locks, so they need
    every call of a client to reach one server session. A transaction-mode
    pooler breaks that; so does a backend that another client pinned. Connect
    directly, or through a pooler in session mode. Not retried: it cannot heal.
    """

    sqlstate = "PQ025"


class StaleEpoch(PgqueError):
    """A fencing check failed: the epoch is no longer the slot's (PQ026).

    Raised by :meth:`~pgque.Client.check_fence` when the slot passed to another
    owner, was released, or its owner's session ended since the batch was
    received. The transaction that checked must not commit its effects; it is
    in error, so it rolls back.
    """

    sqlstate = "PQ026"


class CronUnavailable(PgqueError):
    """pg_cron is not installed in this database (PQ030)."""

    sqlstate = "PQ030"


class HandlerEndedTransaction(PgqueError):
    """A transactional handler ended the Worker's transaction (COMMIT or ROLLBACK
    in SQL, or released the Worker's savepoint) instead of leaving it to the
    Worker.

    The promise of a transactional handler, that its writes commit with the ack
    of its event, no longer holds for that batch: the Worker acks nothing and
    stops with this error (:attr:`Worker.error`). Writes the handler committed
    itself may be applied again when the batch is delivered again.
    """


class HandlerReturnedAwaitable(PgqueError, TypeError):
    """A :class:`~pgque.Worker`'s handler returned a coroutine (or another
    awaitable) instead of doing its work: a plain function such as
    ``lambda message: handle(message)`` with ``handle`` an ``async def``.

    The Worker calls its handler without awaiting, so the work would never
    run. It closes the coroutine, acks nothing of the batch (its events come
    again, to a fixed worker) and stops with this error
    (:attr:`Worker.error`): retrying cannot heal it. Run such a handler with
    :class:`~pgque.AsyncWorker`.
    """


class InvalidArgument(PgqueError, ValueError):
    """An argument is out of range, e.g. max_events < 1 (SQLSTATE 22023)."""

    sqlstate = "22023"


_BY_SQLSTATE: dict[str, type[PgqueError]] = {
    cls.sqlstate: cls
    for cls in (
        QueueNotFound, ConsumerNotFound, BatchNotActive, InvalidName, PayloadError,
        QueueExists, InvalidConfig, NotReadCommitted, DeadLetterNotFound, EventNotInBatch,
        QueueInUse, PartitionKeyTooLong, SchemaNotOwned, DependentObjects, NewerSchema,
        ConsumerAccessDenied,
        QueueAccessDenied, InvalidGrant, SlotSubscriptionError, SlotCountMismatch,
        InvalidSlotCount, InvalidSlot, SlotNotOwned, SessionUnstable, StaleEpoch, CronUnavailable,
        InvalidArgument,
    )
    if cls.sqlstate is not None
}


def register(cls: type[PgqueError]) -> type[PgqueError]:
    """Map ``cls.sqlstate`` to ``cls`` (used by modules that add error codes)."""
    assert cls.sqlstate is not None
    _BY_SQLSTATE[cls.sqlstate] = cls
    return cls


def from_psycopg(exc: psycopg.Error) -> PgqueError | None:
    """The pgque exception for a psycopg error, or None if it is not one of ours."""
    cls = _BY_SQLSTATE.get(exc.sqlstate or "")
    if cls is None:
        return None
    message = exc.diag.message_primary or str(exc)
    error = cls(message)
    error.sqlstate = exc.sqlstate
    return error


class translated:  # lower case: used like the function it was, ``with translated():``
    """Re-raise pgque's server errors as their PgqueError classes: a context
    manager for ``with`` and ``async with`` alike (the async client's twin code
    enters it in the same statement as its cursors)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if isinstance(exc, psycopg.Error):
            mapped = from_psycopg(exc)
            if mapped is not None:
                raise mapped from exc

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        self.__exit__(kind, exc, traceback)
