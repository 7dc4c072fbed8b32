"""Exceptions raised by pgque: the error catalogue.

From a SQLSTATE to a class
--------------------------
Every error the engine raises on purpose has a SQLSTATE of class ``PQ``
(``raise exception ... using errcode = 'PQ001'`` in ``pgque/sql/``), or
22023 for an argument out of range. A class says which code it stands for
in its class statement, and that is its whole registration::

    class QueueNotFound(PgqueError, sqlstate="PQ001"):

:meth:`PgqueError.__init_subclass__` records it in one table by code (a code
has one class: a second one fails at import). The clients run every call
inside :class:`translated`, which turns a psycopg error whose SQLSTATE is in
the table into a new instance of that class (the server's message as its
text, psycopg's error as its ``__cause__``): by code, never by message text.
Any other psycopg error (a lost connection, a missing privilege, a deadlock)
propagates as it is.

A new error is a ``PQ`` code raised in the SQL, a class here with that
``sqlstate``, its name in ``__all__`` and in ``pgque/__init__.py``, and a row in
docs/api.md's error table; tests/test_errors.py checks that these agree.

The hierarchy
-------------
::

    PgqueError                      every pgque error; ``sqlstate`` is its code, or None
    ├── ConnectError                not connected (no code); ``transient``: may retrying help?
    │   └── InvalidDSN              a malformed DSN, never transient (also a ValueError)
    ├── AccessDenied                pgque's access rules refused (no code of its own)
    │   ├── ConsumerAccessDenied    PQ014
    │   └── QueueAccessDenied       PQ015
    ├── HandlerEndedTransaction     a Worker's handler broke its contract (no code)
    ├── HandlerReturnedAwaitable    the same (also a TypeError)
    └── one class per other code    QueueNotFound (PQ001) ... InvalidArgument (22023)

The classes for bad input (a name, a payload, a setting, a slot, an argument)
are also ``ValueError``s, and the client raises some of them itself, before
asking the server (a payload it cannot encode).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

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
    "HeadInFlight",
    "HeldPieceNack",
    "InvalidArgument",
    "InvalidConfig",
    "InvalidDSN",
    "InvalidDelay",
    "InvalidGrant",
    "InvalidIdempotencyKey",
    "InvalidName",
    "InvalidSlot",
    "InvalidSlotCount",
    "KeyNotBlocked",
    "LeaseExpired",
    "NewerSchema",
    "NotReadCommitted",
    "NotRecorded",
    "OwnershipMismatch",
    "PartitionKeyTooLong",
    "PayloadError",
    "PgqueError",
    "QueueAccessDenied",
    "QueueExists",
    "QueueInUse",
    "QueueNotFound",
    "SchemaNotOwned",
    "ServerReadOnly",
    "SessionUnstable",
    "SlotCountMismatch",
    "SlotNotOwned",
    "SlotSubscriptionError",
    "StaleEpoch",
]


class PgqueError(Exception):
    """Base class of every pgque error.

    ``sqlstate`` is the class's SQLSTATE, the code the server raises it by
    (also when the client raises it itself, as a payload it cannot encode),
    or None for a class that has none (a connection failure, a bad DSN).
    """

    sqlstate: str | None = None

    def __init_subclass__(cls, *, sqlstate: str | None = None, **kwargs: Any) -> None:
        """``class C(PgqueError, sqlstate="PQnnn")``: the server's errors with that
        SQLSTATE are raised as ``C``. A subclass that names no code inherits its
        parent's ``sqlstate`` and is never raised in the parent's place."""
        super().__init_subclass__(**kwargs)
        if sqlstate is None:
            return
        taken = _BY_SQLSTATE.get(sqlstate)
        if taken is not None:
            raise TypeError(f"SQLSTATE {sqlstate} is {taken.__name__}'s already")
        cls.sqlstate = sqlstate
        _BY_SQLSTATE[sqlstate] = cls


# SQLSTATE -> class: filled by the class statements below (PgqueError.__init_subclass__).
_BY_SQLSTATE: dict[str, type[PgqueError]] = {}


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


class QueueNotFound(PgqueError, sqlstate="PQ001"):
    """The queue does not exist (PQ001)."""


class ConsumerNotFound(PgqueError, sqlstate="PQ002"):
    """The consumer is not subscribed to the queue (PQ002)."""


class BatchNotActive(PgqueError, sqlstate="PQ003"):
    """The batch is not the consumer's open batch: already acked, or never opened (PQ003)."""


class InvalidName(PgqueError, ValueError, sqlstate="PQ004"):
    """A queue or consumer name is not allowed (PQ004)."""


class PayloadError(PgqueError, ValueError, sqlstate="PQ005"):
    """A payload is not JSON, cannot be encoded, or does not fit the requested type (PQ005)."""


class QueueExists(PgqueError, sqlstate="PQ006"):
    """A queue of that name already exists (PQ006)."""


class InvalidConfig(PgqueError, ValueError, sqlstate="PQ007"):
    """A queue setting is unknown or out of range (PQ007)."""


class NotReadCommitted(PgqueError, sqlstate="PQ008"):
    """Ticks and maintenance must run in a READ COMMITTED transaction (PQ008)."""


class DeadLetterNotFound(PgqueError, sqlstate="PQ009"):
    """No dead letter with that id in the queue (PQ009)."""


class EventNotInBatch(PgqueError, sqlstate="PQ010"):
    """A nacked event id is not among the events handed out of the batch (PQ010)."""


class QueueInUse(PgqueError, sqlstate="PQ011"):
    """The queue still has consumers; unsubscribe them or drop with force (PQ011)."""


class PartitionKeyTooLong(PgqueError, ValueError, sqlstate="PQ012"):
    """A partition key is longer than 512 bytes (PQ012)."""


class SchemaNotOwned(PgqueError, sqlstate="PQ013"):
    """The install refused: schema pgque, or an object in it, belongs to another role (PQ013).

    Everything in schema pgque must belong to the role that installs it; an
    object of another role there could replace what the SECURITY DEFINER
    functions call and run as the installer.
    """


class DependentObjects(PgqueError, sqlstate="PQ017"):
    """The install refused: objects outside schema pgque depend on its views or
    functions, which every install drops and recreates (PQ017). Drop them, install,
    and create them again."""


class NewerSchema(PgqueError, sqlstate="PQ018"):
    """The install refused: a newer pgque has migrated this database (PQ018).

    Migrations go forward only; install with that version or a later one.
    """


class AccessDenied(PgqueError):
    """Base of the refusals of pgque's own access rules (consumer ownership, queue grants).

    A role outside pgque's roles gets PostgreSQL's permission error
    (psycopg.errors.InsufficientPrivilege) instead.
    """


class ConsumerAccessDenied(AccessDenied, sqlstate="PQ014"):
    """The consumer belongs to another role, which has not granted it to this one (PQ014)."""


class QueueAccessDenied(AccessDenied, sqlstate="PQ015"):
    """The queue's grants leave this role out for sending or consuming (PQ015)."""


class InvalidGrant(PgqueError, ValueError, sqlstate="PQ016"):
    """A grant names an unknown role, or a privilege other than 'send' or 'consume' (PQ016)."""


class SlotSubscriptionError(PgqueError, sqlstate="PQ021"):
    """A slot subscription was used through the plain receive/ack/nack (PQ021)."""


class SlotCountMismatch(PgqueError, ValueError, sqlstate="PQ020"):
    """The consumer group exists with another slot count; N is fixed per group (PQ020)."""


class InvalidSlotCount(PgqueError, ValueError, sqlstate="PQ022"):
    """A slot count is outside 1..max_slots (PQ022)."""


class InvalidSlot(PgqueError, ValueError, sqlstate="PQ023"):
    """A slot number is outside 0..N-1 (PQ023)."""


class SlotNotOwned(PgqueError, sqlstate="PQ024"):
    """This session does not hold the slot's advisory lock (PQ024).

    Raised by receive, ack and nack of a slot: a worker that lost its session
    (and with it the lock) can never act on a batch another worker now owns.
    """


class SessionUnstable(PgqueError, sqlstate="PQ025"):
    """The server session behind the connection changed under the client (PQ025).

    Slot ownership and the ticker election are session locks, so they need
    every call of a client to reach one server session. A transaction-mode
    pooler breaks that; so does a backend that another client pinned. Connect
    directly, or through a pooler in session mode. Not retried: it cannot heal.
    """


class StaleEpoch(PgqueError, sqlstate="PQ026"):
    """A fencing check failed: the epoch is no longer the slot's (PQ026).

    Raised by :meth:`~pgque.Client.check_fence` when the slot passed to another
    owner, was released, or its owner's session ended since the batch was
    received. The transaction that checked must not commit its effects; it is
    in error, so it rolls back.
    """


class KeyNotBlocked(PgqueError, sqlstate="PQ027"):
    """The key is not blocked in that consumer group: no failed event holds it
    (PQ027). Raised by the blocked-key ledger's verbs (retry_head, skip_head,
    resume_key)."""


class HeadInFlight(PgqueError, sqlstate="PQ028"):
    """The blocked key's head is handed out to a worker right now: act on it
    once that piece is acked (PQ028)."""


class HeldPieceNack(PgqueError, sqlstate="PQ029"):
    """A piece of held events (the pause policy) is nacked with its ack, not by
    nack alone (PQ029)."""


class CronUnavailable(PgqueError, sqlstate="PQ030"):
    """pg_cron is not installed in this database (PQ030)."""


class InvalidDelay(PgqueError, ValueError, sqlstate="PQ031"):
    """A delayed send's due time is more than 30 days ahead or not finite, its
    ``deliver_after`` is negative, or its ``deliver_at`` has no time zone (PQ031).
    A due time in the past is no error: the event is sent at once."""


class InvalidIdempotencyKey(PgqueError, ValueError, sqlstate="PQ032"):
    """An idempotency key is empty or longer than 512 bytes (PQ032)."""


class NotRecorded(PgqueError, sqlstate="PQ033"):
    """``verify`` was asked about a consumer group that has no record of
    handler calls: none of its workers ran with ``record=True`` since its
    record was last forgotten (PQ033)."""


class LeaseExpired(PgqueError, sqlstate="PQ034"):
    """The client's lease of a group that owns its slots by lease expired, or
    was never taken (PQ034).

    Raised by every call made with the lease: its slots may have passed to
    other owners, each with a new epoch. A Worker drops the slots of the lease
    and takes a new one; a client of its own takes a new lease
    (:meth:`~pgque.Client.take_lease`) and claims again.
    """


class OwnershipMismatch(PgqueError, sqlstate="PQ035"):
    """A call's way of owning slots is not its group's (PQ035).

    A group owns its slots by session advisory lock (the default) or by lease
    (:meth:`~pgque.Client.set_ownership`), one at a time: a claim or join
    without a lease on a group that owns by lease, or a call with a lease on
    one that owns by advisory lock, is refused; so is changing the mode while
    a slot is owned or a member has joined. Not retried by a Worker.
    """


class ServerReadOnly(PgqueError, sqlstate="25006"):
    """The server accepts no writes (25006): a hot standby, or a primary being
    demoted.

    The reading calls (status, the info views, metrics, key lag, dead letters,
    tail) work on a standby; sending, ticking, claiming, receiving and acking
    need the primary. A Worker, Ticker or producer that gets it reconnects
    (with backoff), so with a multi-host DSN and
    ``target_session_attrs=read-write`` it goes on with whichever server
    accepts writes, and on a standby that is promoted once it is.
    """


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


class InvalidArgument(PgqueError, ValueError, sqlstate="22023"):
    """An argument is out of range, e.g. max_events < 1 (SQLSTATE 22023)."""


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
