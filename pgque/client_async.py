# The source of pgque/client.py, which tools/async_to_sync.py generates  # async-only
# from this file (`make twins`): edit this one, then regenerate. Lines that  # async-only
# end like these are left out of the sync code; "sync-only:" comments become  # async-only
# code there (see tools/async_to_sync.py).  # async-only
"""The pgque client: producers' and consumers' calls, each one round trip.

Each :class:`AsyncClient` wraps a psycopg AsyncConnection. Made with
:func:`connect_async`, it owns an autocommit connection (every call is its own
transaction) and, for ``send`` from many callers at once, a small pool opened
on first use. Made as ``AsyncClient(conn)`` over the caller's connection, it runs
every call in whatever transaction that connection is in: the caller commits.

All correctness lives in the SQL functions; this module encodes arguments,
decodes rows (with :mod:`pgque._shared`) and maps the engine's SQLSTATEs to
:mod:`pgque.errors`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar, overload

import msgspec
import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row, namedtuple_row, tuple_row
from psycopg_pool import AsyncConnectionPool

from pgque import _install_async
from pgque._acompat import acaller, apause
from pgque._dsn import TRANSIENT_STATES, check_dsn, connect_error, redact
from pgque._shared import (
    PREPARED_STATEMENT_ERRORS,
    EventLike,
    RetryAfter,
    batch_from_rows,
    blocked_keys_from_rows,
    check_connection,
    check_deliver_at,
    config_json,
    dead_letters_from_rows,
    delay,
    event_columns,
    failure_delays,
    group_status_from_row,
    message_ids,
    nacked,
    raw_timestamps,
    seconds,
    send_options,
    sends_here,
    session_changed,
)
from pgque.codec import encode_payload
from pgque.errors import ConnectError, InvalidArgument, translated
from pgque.info import (
    ConsumerInfo,
    Finding,
    GeneratedCode,
    GroupInfo,
    GroupStatus,
    HandlingSummary,
    KeyLag,
    QueueInfo,
    SlotStatus,
    TickerInfo,
    Verification,
    from_row,
)
from pgque.metrics import ProducerMetrics
from pgque.types import (
    Batch,
    BlockedKey,
    DeadLetter,
    FailurePolicy,
    Fence,
    Lease,
    Message,
    SentId,
)

__all__ = ["AsyncClient", "connect_async", "open_connection_async", "redact"]

T = TypeVar("T")
R = TypeVar("R", bound=msgspec.Struct)
AsyncConn = AsyncConnection[Any]
#: A span of time: seconds, a timedelta, or an interval literal for the server to read.
Duration = float | timedelta | str

# An optional interval argument, from (text, seconds): either or neither is given.
_STALLED_AFTER = "coalesce(%s::interval, make_interval(secs => %s::float8))"
#: The record of handler calls goes to the server as JSON (see _record_calls).
_JSON = msgspec.json.Encoder()


def _interval_params(value: Duration | None) -> tuple[str | None, float | None]:
    """The parameters of an interval argument written as ``_STALLED_AFTER``."""
    if value is None or isinstance(value, str):
        return value, None
    return None, seconds(value)


async def open_connection_async(dsn: str, *, timeout: float = 30.0,
                                stop: asyncio.Event | None = None, **kwargs: Any) -> AsyncConn:
    """Open an autocommit psycopg connection, retrying while the server starts.

    Retries with capped exponential backoff for up to ``timeout`` seconds when
    the server refuses connections, says it is starting, or the connection
    fails without an SQLSTATE; fails at once, with InvalidDSN, on a DSN that
    libpq cannot parse or whose host or port cannot be one. libpq reports
    every failure to connect without an SQLSTATE, a missing database or role
    and bad credentials too, and pgque maps errors by SQLSTATE, never by
    message text: so those are retried until ``timeout`` like a server that is
    down (a long-running service stops on them, see :class:`~pgque.Worker`). A
    set ``stop`` event ends the retries early. Raises ConnectError
    (``transient`` tells which kind). Each attempt is bounded (libpq
    ``connect_timeout``, from ``timeout`` unless given), so a server that drops
    packets cannot hold it for minutes. No error names a password: what may
    be one is masked, and psycopg's error is not chained (its text can quote
    the DSN).
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    kwargs.setdefault("autocommit", True)
    check_dsn(dsn, kwargs)
    if "connect_timeout" not in conninfo_to_dict(dsn):  # the DSN's own wins (multi-host)
        kwargs.setdefault("connect_timeout", max(2, min(int(timeout), 10)))
    while True:
        error: ConnectError | None = None
        left = 0.0
        try:
            return await AsyncConnection.connect(dsn, **kwargs)
        except psycopg.ProgrammingError as exc:  # a setting psycopg rejects
            error = connect_error(exc, dsn, kwargs)
        except psycopg.OperationalError as exc:
            left = deadline - time.monotonic()
            if exc.sqlstate not in TRANSIENT_STATES or left <= 0:
                error = connect_error(exc, dsn, kwargs)
        if error is not None:
            # Raised here, not in the except: psycopg's error, whose text can
            # quote the DSN, password and all, is then not even its __context__.
            raise error
        if await apause(min(delay, left), stop):  # a last attempt at the deadline
            raise ConnectError("stopped while connecting")
        delay = min(delay * 2, 1.0)


async def connect_async(dsn: str, *, timeout: float = 30.0, pool_size: int = 4,
                        **kwargs: Any) -> AsyncClient:
    """Connect to the database at ``dsn`` and return the :class:`AsyncClient` that
    owns the connection.

    Waits up to ``timeout`` seconds for a server that is starting. ``pool_size``
    bounds the producer pool through which other threads (under asyncio, other
    tasks) than the one that made the client ``send``/``send_batch`` (0: they
    too send on the client's own connection). Extra keyword arguments go to
    psycopg's ``connect``, for the pool's connections too.
    """
    conn = await open_connection_async(dsn, timeout=timeout, **kwargs)
    return AsyncClient(conn, dsn=dsn, pool_size=pool_size, owns_connection=True,
                       connect_kwargs=kwargs)


class AsyncClient:
    """pgque's calls over one psycopg connection. See the module docstring."""

    def __init__(
        self,
        conn: AsyncConn,
        *,
        dsn: str | None = None,
        pool_size: int = 0,
        owns_connection: bool = False,
        connect_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_connection(conn, AsyncConnection, "AsyncClient")
        if dsn is not None and pool_size > 0:
            # Now, not when the pool opens: the pool would log psycopg's error,
            # which can quote the DSN's password, on every attempt.
            check_dsn(dsn, connect_kwargs)
        self.conn = conn
        self._dsn = dsn
        self._connect_kwargs = {**(connect_kwargs or {}), "autocommit": True}
        self._pool_size = pool_size if dsn is not None else 0
        self._pool: AsyncConnectionPool[AsyncConn] | None = None
        self._pool_lock = asyncio.Lock()
        self._owns_connection = owns_connection
        # (backend pid, token) once pin_session() ran: slot and ticker calls
        # then check that they still reach that server session.
        self._pinned: tuple[int, str] | None = None
        # The lease this client's owner calls carry (take_lease, the lease property):
        # for a group that owns its slots by lease (see pgque/sql/code/slots/lease.sql).
        self._lease: Lease | None = None
        # The database has no pgque.ack_receive_slots (older than 0.8): found once.
        self._without_ack_receive_slots = False
        # Which pgque.ticker_some the database has, looked up once: 0 none (before
        # 0.9), 9 (in chunks), 10 (by id too, and says which queues it ticked).
        self._ticker_some: int | None = None
        #: How many queues one statement of ticker() and tick_overdue() looks at:
        #: a look keeps a lock on one of the queue's event tables until the
        #: statement's transaction ends, and thousands of them outgrow the
        #: server's lock table.
        self.tick_chunk = 500
        # The thread (under asyncio, the task) that made the client: see _producer.
        self._owner = acaller()

    # -- lifecycle -------------------------------------------------------

    async def close(self) -> None:
        """Close the pool and, if this client opened it, the connection."""
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._owns_connection:
            await self.conn.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _rows(self, sql: str, params: Sequence[Any] = (), conn: AsyncConn | None = None,
                    *, by_name: bool = False, binary: bool = False) -> list[Any]:
        """The rows of one statement: tuples, or with by_name named tuples whose
        fields are the result's column names (records read by name, not position).
        ``binary`` asks for the result in binary, its timestamps as
        microseconds since 2000-01-01 (a Message's form of created_at): the
        receives use it, since their rows load faster that way than from text."""
        row_factory: Any = namedtuple_row if by_name else tuple_row
        async with translated(), (conn or self.conn).cursor(row_factory=row_factory,
                                                            binary=binary) as cur:
            if binary:
                raw_timestamps(cur)
            try:
                await cur.execute(sql.encode(), params)
            except PREPARED_STATEMENT_ERRORS as exc:
                if self._pinned is None:
                    raise
                # A statement prepared on this connection is missing from (or
                # already on) the server session: the session changed under us.
                raise session_changed(exc) from exc
            return await cur.fetchall()

    async def _value(self, sql: str, params: Sequence[Any] = (),
                     conn: AsyncConn | None = None) -> Any:
        rows = await self._rows(sql, params, conn)
        return rows[0][0]

    @asynccontextmanager
    async def _producer(self, conn: AsyncConn | None) -> AsyncIterator[AsyncConn]:
        if conn is not None:
            yield conn
        elif acaller() == self._owner and sends_here(self.conn):
            # The thread (task) that made the client sends on the client's own
            # connection: in a transaction it opened there (the outbox
            # pattern) the event commits or rolls back with it; on an idle
            # autocommit connection it commits on its own, as through the pool,
            # without a checkout (the pool cost 40 to 70 µs a send). Another
            # thread's (task's) send goes through the pool, so that it never
            # lands in the owner's transaction; so does the owner's while the
            # connection is busy, held (a notifies() loop), in a pipeline or
            # broken (see sends_here).
            yield self.conn
        elif self._pool_size > 0:
            pool = self._pool or await self._open_pool()
            async with pool.connection() as pooled:
                yield pooled
        else:
            yield self.conn

    async def _open_pool(self) -> AsyncConnectionPool[AsyncConn]:
        """The producer pool, opened once (whoever asks first)."""
        async with self._pool_lock:
            if self._pool is None:
                assert self._dsn is not None
                # The same connection settings as the client's own connection.
                pool = AsyncConnectionPool(
                    self._dsn, min_size=1, max_size=self._pool_size,
                    kwargs=self._connect_kwargs, open=False, name="pgque-producers")
                await pool.open()
                self._pool = pool
            return self._pool

    # -- schema and queues -----------------------------------------------

    async def install(self) -> str:
        """Install or upgrade the engine (idempotent); returns the installed version.

        Raises SchemaNotOwned when schema pgque, or an object in it, belongs to
        another role than the connected one.
        """
        async with translated():
            await _install_async.install(self.conn)
        return str(await self._value("select pgque.version()"))

    async def uninstall(self) -> None:
        """Drop the engine with every queue in it."""
        await _install_async.uninstall(self.conn)

    async def create_queue(self, name: str, *, exist_ok: bool = False,
                           **config: float | timedelta | str) -> int:
        """Create a queue and return its id.

        Settings: ``ticker_max_count``, ``ticker_max_lag``, ``ticker_idle_period``,
        ``rotation_period``, ``max_retries``, ``event_tables``; durations as
        seconds or timedeltas. Raises QueueExists unless ``exist_ok``.
        """
        return int(await self._value("select pgque.create_queue(%s, %s::jsonb, %s)",
                                     (name, config_json(config), exist_ok)))

    async def set_queue_config(self, name: str,
                               **config: float | timedelta | str) -> dict[str, Any]:
        """Change settings of a queue; returns its whole configuration."""
        result: dict[str, Any] = await self._value(
            "select pgque.set_queue_config(%s, %s::jsonb)", (name, config_json(config)))
        return result

    async def queue_config(self, name: str) -> dict[str, Any]:
        """The queue's settings (durations in seconds)."""
        result: dict[str, Any] = await self._value("select pgque.queue_config(%s)", (name,))
        return result

    async def drop_queue(self, name: str, *, force: bool = False) -> None:
        """Drop a queue with all its events. Raises QueueInUse while it has consumers,
        unless ``force``."""
        await self._rows("select pgque.drop_queue(%s, %s)", (name, force))

    async def subscribe(self, queue: str, consumer: str) -> bool:
        """Subscribe a consumer; it receives events committed from now on.

        Returns False if it was already subscribed.
        """
        return bool(await self._value("select pgque.subscribe(%s, %s)", (queue, consumer)))

    async def unsubscribe(self, queue: str, consumer: str) -> bool:
        """Remove a subscription (its cursor, open batch and pending retries)."""
        return bool(await self._value("select pgque.unsubscribe(%s, %s)", (queue, consumer)))

    # -- access ----------------------------------------------------------

    async def grant_queue(self, queue: str, role: str, privilege: str) -> bool:
        """Restrict ``privilege`` ('send' or 'consume') on ``queue`` to the roles granted
        it, adding ``role``; True when it was new. Admins only. Without grants of a
        kind, a queue is open to every pgque_writer ('send') or pgque_reader
        ('consume')."""
        return bool(await self._value("select pgque.grant_queue(%s, %s, %s)",
                                      (queue, role, privilege)))

    async def revoke_queue(self, queue: str, role: str, privilege: str) -> bool:
        """Take ``privilege`` on ``queue`` back from ``role``; True when it had it.
        Revoking the last grant of a kind opens the queue again. Admins only."""
        return bool(await self._value("select pgque.revoke_queue(%s, %s, %s)",
                                      (queue, role, privilege)))

    async def queue_grants(self, queue: str) -> list[tuple[str, str]]:
        """The (privilege, role) grants of ``queue``; empty when it is unrestricted."""
        rows = await self._rows("select * from pgque.queue_grants(%s)", (queue,))
        return [(p, r) for p, r in rows]

    async def grant_consumer(self, queue: str, consumer: str, role: str) -> bool:
        """Let ``role`` use ``consumer`` (a plain consumer or a consumer group) as its
        owner does; True when it was new. Its owner or an admin only."""
        return bool(await self._value("select pgque.grant_consumer(%s, %s, %s)",
                                      (queue, consumer, role)))

    async def revoke_consumer(self, queue: str, consumer: str, role: str) -> bool:
        """Take ``role``'s access to ``consumer`` back; True when it had it."""
        return bool(await self._value("select pgque.revoke_consumer(%s, %s, %s)",
                                      (queue, consumer, role)))

    # -- producing -------------------------------------------------------

    async def send(self, queue: str, type: str, payload: Any = None,
                   partition_key: str | None = None, *, deliver_at: datetime | None = None,
                   deliver_after: float | timedelta | None = None,
                   idempotency_key: str | None = None,
                   conn: AsyncConn | None = None) -> SentId:
        """Append one event and return its id (a :class:`~pgque.SentId`, an int).

        ``deliver_at`` (an aware datetime) or ``deliver_after`` (seconds or a
        timedelta, by the database's clock) delays the event: it is stored now,
        durable once the transaction commits, and enters the log, in its key's
        order, when it falls due, as if sent then; it is never handed out
        before. A due time not in the future sends at once; more than 30 days
        ahead raises :class:`~pgque.InvalidDelay`.

        With ``idempotency_key`` (1 to 512 bytes), a key already sent to this
        queue within its ``idempotency_window`` (24 hours unless configured)
        writes nothing: the id returned is the first send's, with
        ``duplicate`` True. Concurrent sends of one key make one event; a
        rolled-back send leaves no key behind.

        With ``conn``, the event is written in that connection's current
        transaction and exists only if it commits. Without it, when called from
        the thread (under asyncio, the task) that made the client, it goes on
        the client's own connection: into the transaction open there
        (``async with client.conn.transaction():``) the same way, else in a
        transaction of its own. From any other thread (task) it commits on its
        own, through the producer pool when there is one.
        """
        data = encode_payload(payload)
        began = time.perf_counter()
        if deliver_at is None and deliver_after is None and idempotency_key is None:
            async with self._producer(conn) as target:
                sent = SentId(await self._value("select pgque.send(%s, %s, %s::text, %s)",
                                                (queue, type, data, partition_key), target))
        else:
            check_deliver_at(deliver_at)
            async with self._producer(conn) as target:
                rows = await self._rows(
                    "select event_id, duplicate, deliver_at from pgque.send_with("
                    "%s, %s, %s::text, %s, %s, %s, %s)",
                    (queue, type, data, partition_key, deliver_at, delay(deliver_after),
                     idempotency_key), target)
            sent = SentId.of(*rows[0])
        metrics = ProducerMetrics.get()
        if metrics is not None:
            metrics.sent(queue, "send", 1, began)
        return sent

    async def send_batch(self, queue: str, events: Iterable[EventLike], *,
                         deliver_at: datetime | None = None,
                         deliver_after: float | timedelta | None = None,
                         conn: AsyncConn | None = None) -> list[SentId]:
        """Append several events in one round trip; returns their ids in order.

        Each event is a :class:`~pgque.Event` or a ``(type, payload[, partition_key])``
        tuple. An Event may carry its own delay and idempotency key;
        ``deliver_at``/``deliver_after`` here delay the events that have no
        delay of their own. A batch may repeat an idempotency key: its first
        event is sent, the later ones are duplicates of it (see :meth:`send`).
        Nothing is written if any of them is invalid. Transactions as for
        :meth:`send`.
        """
        events = list(events)
        types, payloads, keys, own_options = event_columns(events)
        if not types:
            return []
        # The options' columns only when there are any: the plain batch is the hot path.
        options = (send_options(events, deliver_at, deliver_after)
                   if own_options or deliver_at is not None or deliver_after is not None
                   else None)
        began = time.perf_counter()
        async with self._producer(conn) as target:
            if options is None or options == (None, None, None):
                # Binary (%b) arrays: psycopg encodes them several times faster than text.
                ids = await self._value(
                    "select pgque.send_batch(%s, %b::text[], %b::text[], %b::text[])",
                    (queue, types, payloads, keys), target)
                sent = list(map(SentId, ids))
            else:
                rows = await self._rows(
                    "select event_id, duplicate, deliver_at from pgque.send_batch_with("
                    "%s, %b::text[], %b::text[], %b::text[], %s::timestamptz[],"
                    " %s::interval[], %s::text[])",
                    (queue, types, payloads, keys, *options), target)
                sent = [SentId.of(*row) for row in rows]
        metrics = ProducerMetrics.get()
        if metrics is not None:
            metrics.sent(queue, "send_batch", len(sent), began)
        return sent

    # -- ticks and maintenance -------------------------------------------

    async def tick(self, queue: str) -> int:
        """Force a tick of one queue now; returns the tick id."""
        return int(await self._value("select pgque.tick(%s)", (queue,)))

    async def ticker(self, queue: str | None = None) -> int:
        """Tick every queue (or one) whose thresholds ask for it; returns how many ticked."""
        if queue is not None:
            return int(await self._value("select pgque.ticker(%s) is not null", (queue,)))
        if not await self._ticks_in_chunks():
            check, params = self._checked(None)
            return int(await self._value(f"select pgque.ticker() from (select {check}) s",
                                         params))
        return len(await self._tick_chunks(None))

    async def ticker_ids(self, queue_ids: Collection[int] | None = None) -> list[int]:
        """Tick every queue (or those of ``queue_ids``) whose thresholds ask for it,
        as :meth:`ticker` does; returns the ids of the queues it ticked. The Ticker
        polls the queues that were busy lately this way. Needs pgque 0.10 in the
        database (UndefinedFunction before)."""
        return await self._tick_chunks(None, None if queue_ids is None else sorted(queue_ids))

    async def tick_overdue(self, after: float | timedelta) -> int:
        """Tick every queue whose pending events have waited ``after`` since its last
        tick, whatever its thresholds (a standby ticker's safety net); returns how
        many ticked."""
        if not await self._ticks_in_chunks():
            check, params = self._checked(None)
            return int(await self._value(
                f"select pgque.tick_overdue(make_interval(secs => %s)) from (select {check}) s",
                (seconds(after), *params)))
        return len(await self._tick_chunks(seconds(after)))

    async def _ticker_some_version(self) -> int:
        """Which pgque.ticker_some the database has (see __init__); looked up once."""
        if self._ticker_some is None:
            self._ticker_some = int(await self._value(
                "select case when to_regprocedure('pgque.ticker_some(integer,integer,interval,"
                "integer[])') is not null then 10 when to_regprocedure('pgque.ticker_some("
                "integer,integer,interval)') is not null then 9 else 0 end"))
        return self._ticker_some

    async def _ticks_in_chunks(self) -> bool:
        """Whether the database has pgque.ticker_some (0.9)."""
        return await self._ticker_some_version() >= 9

    async def _can_tick_by_id(self) -> bool:
        """Whether the database's pgque ticks queues by id and lets them sleep one
        by one (0.10): what the Ticker's hot queues need."""
        return await self._ticker_some_version() >= 10

    async def _tick_chunks(self, overdue: float | None,
                           queue_ids: list[int] | None = None) -> list[int]:
        """ticker() (overdue None) or tick_overdue(overdue), of every queue or of
        those of queue_ids, tick_chunk queues a statement; returns the ids of the
        queues ticked (before 0.10: a 0 for each tick)."""
        by_id = await self._can_tick_by_id()
        if queue_ids is not None and not by_id:
            raise psycopg.errors.UndefinedFunction(
                "this database's pgque (before 0.10) cannot tick queues by id")
        check, params = self._checked(None)
        ticked: list[int] = []
        if queue_ids is not None:
            # A slice of the ids a statement (the whole list in each would be
            # matched against every row of every chunk).
            for first in range(0, len(queue_ids), self.tick_chunk):
                rows = await self._rows(
                    f"select t.ticked from (select {check}) s,"
                    " pgque.ticker_some(null, %s, make_interval(secs => %s), %s::integer[]) t",
                    (*params, self.tick_chunk, overdue,
                     queue_ids[first:first + self.tick_chunk]))
                ticked += rows[0][0]
            return ticked
        after: int | None = None
        while True:
            rows = await self._rows(
                f"select t.ticks, t.last_queue{', t.ticked' if by_id else ''}"
                f" from (select {check}) s,"
                " pgque.ticker_some(%s, %s, make_interval(secs => %s)) t",
                (*params, after, self.tick_chunk, overdue))
            ticked += rows[0][2] if by_id else [0] * int(rows[0][0])
            after = rows[0][1]
            if after is None:
                return ticked

    async def claim_ticker(self) -> bool:
        """Try, without waiting, to become the database's active ticker (a session
        advisory lock on the install's random election key); True when this session
        holds it. Checks a pinned session first."""
        check, params = self._checked(None)
        return bool(await self._value(f"select pgque.claim_ticker() from (select {check}) s",
                                      params))

    async def release_ticker(self) -> bool:
        """Give up the ticker election if this session holds it."""
        return bool(await self._value("select pgque.release_ticker()"))

    async def claim_ticker_lease(self, token: str, name: str, lease: float | timedelta) -> bool:
        """The ticker election by lease, for a ticker behind a transaction pooler:
        True when the ticker of ``token`` (32 to 64 characters of its own) is the
        active one for ``lease`` seconds from now (taken, or renewed: claim again
        well within it); False while another ticker is active."""
        return bool(await self._value(
            "select pgque.claim_ticker_lease(%s, %s, make_interval(secs => %s))",
            (token, name, seconds(lease))))

    async def release_ticker_lease(self, token: str) -> bool:
        """Give up the election by lease if ``token`` holds it."""
        return bool(await self._value("select pgque.release_ticker_lease(%s)", (token,)))

    async def ticker_sleep(self, except_ids: Collection[int] | None = None) -> int | None:
        """As the active ticker, say that it sleeps for every queue but those of
        ``except_ids``: sends into them notify :meth:`ticker_channel` from now on,
        the queue's id as the payload (see the Ticker). Listen on that channel
        first, and look for due ticks in those queues once more after. Returns how
        many queues were marked, or None where the ticker must not sleep (the
        server allows prepared transactions); SQLSTATE 55000 unless this session
        holds the election."""
        check, params = self._checked(None)
        if except_ids is None:  # the call of 0.9, which a database of 0.9 has
            marked = await self._value(f"select pgque.ticker_sleep() from (select {check}) s",
                                       params)
        else:
            marked = await self._value(
                f"select pgque.ticker_sleep(%s::integer[]) from (select {check}) s",
                (sorted(except_ids), *params))
        return None if marked is None else int(marked)

    async def ticker_wake(self, queue_ids: Collection[int] | None = None) -> int:
        """As the active ticker, say that it is awake for the queues of
        ``queue_ids`` (None: every queue): sends into them stop notifying. Returns
        how many queues were marked; SQLSTATE 55000 unless this session holds the
        election."""
        check, params = self._checked(None)
        if queue_ids is None:
            return int(await self._value(f"select pgque.ticker_wake() from (select {check}) s",
                                         params))
        return int(await self._value(
            f"select pgque.ticker_wake(%s::integer[]) from (select {check}) s",
            (sorted(queue_ids), *params)))

    async def ticker_channel(self) -> str:
        """The channel a sleeping ticker listens on for sends."""
        return str(await self._value("select pgque.ticker_channel()"))

    async def active_ticker(self) -> int | None:
        """The backend pid of the database's active ticker, or None."""
        pid = await self._value("select pgque.active_ticker()")
        return None if pid is None else int(pid)

    async def start_cron(self) -> int:
        """Tick from inside the database with pg_cron (job 'pgque-ticker'); returns the
        job id. Raises CronUnavailable when pg_cron is not installed here."""
        return int(await self._value("select pgque.start_cron()"))

    async def stop_cron(self) -> bool:
        """Remove the pg_cron ticking job; False when there was none."""
        return bool(await self._value("select pgque.stop_cron()"))

    async def maintenance(self, queue: str | None = None) -> list[tuple[str, str, int]]:
        """Run rotation, retry re-insertion and tick cleanup; returns what was done
        as (queue, step, amount) rows."""
        check, params = self._checked(queue)
        rows = await self._rows(f"select * from pgque.maint({check})", params)
        return [(q, s, int(n)) for q, s, n in rows]

    # -- consuming -------------------------------------------------------

    @overload
    async def receive(self, queue: str, consumer: str, *, max_events: int | None = None,
                      payload_type: None = None) -> Batch[Any] | None: ...

    @overload
    async def receive(self, queue: str, consumer: str, *, max_events: int | None = None,
                      payload_type: type[T]) -> Batch[T] | None: ...

    async def receive(self, queue: str, consumer: str, *, max_events: int | None = None,
                      payload_type: type[T] | None = None) -> Batch[Any] | None:
        """The consumer's open batch (or its next one), or None when none is ready.

        With ``max_events`` the batch comes in pieces: each ``ack`` acks the
        piece handed out, and the next ``receive`` continues the same batch.
        A batch may have no messages (a tick with no events); ack it all the same.
        """
        rows = await self._rows("select * from pgque.receive(%s, %s, %s)",
                                (queue, consumer, max_events), binary=True)
        return batch_from_rows(queue, consumer, rows, payload_type, zone=self.conn.info.timezone)

    async def ack(self, batch: Batch[Any], *,
                  nack: Mapping[int, str | None] | Iterable[Message[Any] | int] = (),
                  retry_after: RetryAfter = 0.0,
                  dead: Iterable[Message[Any] | int] = ()) -> bool:
        """Ack the batch piece; True when that finished the whole batch.

        ``nack`` names events of the piece that failed: ids or messages, or a
        mapping of event id to reason. They go to retry (or dead letters) in the
        same transaction as the ack, so a crash cannot leave them nacked but the
        batch unacked. ``retry_after`` is one delay for all, or a mapping of
        event id to its own delay; ``dead`` names nacked events not to retry:
        they go to the dead letters now (under the pause policy, the key moves
        on). A slot's batch is acked through the partition layer, which checks
        that this session still owns the slot (SlotNotOwned).
        """
        ids, reasons = nacked(nack)
        delay, delays = failure_delays(ids, retry_after)
        dead_ids = message_ids(dead)
        if delays is not None or dead_ids:
            return await self._ack_each(batch, ids, reasons, delay, delays, dead_ids)
        if batch.slot is not None:
            check, params = self._checked(batch.queue)
            if not ids:
                return bool(await self._value(
                    f"select pgque.ack_partitioned({check}, %s, %s, %s, %s)",
                    (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id)))
            return bool(await self._value(
                f"select pgque.ack_partitioned({check}, %s, %s, %s, %s, %s::bigint[], "
                "%s::text[], make_interval(secs => %s))",
                (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id, ids,
                 reasons, delay)))
        if not ids:
            return bool(await self._value("select pgque.ack(%s, %s, %s)",
                                          (batch.queue, batch.consumer, batch.batch_id)))
        return bool(await self._value(
            "select pgque.ack(%s, %s, %s, %s::bigint[], %s::text[], make_interval(secs => %s))",
            (batch.queue, batch.consumer, batch.batch_id, ids, reasons, delay)))

    async def _ack_each(self, batch: Batch[Any], ids: list[int], reasons: list[str | None],
                        delay: float, delays: list[timedelta | None] | None,
                        dead_ids: list[int]) -> bool:
        """:meth:`ack` with a delay per failed event or events not to retry (the
        calls of 0.6 that take them, kept apart so the others work on 0.5)."""
        if batch.slot is not None:
            check, params = self._checked(batch.queue)
            return bool(await self._value(
                f"select pgque.ack_partitioned({check}, %s, %s, %s, %s, %s::bigint[], "
                "%s::text[], make_interval(secs => %s), %s::interval[], %s::bigint[])",
                (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id, ids,
                 reasons, delay, delays, dead_ids)))
        return bool(await self._value(
            "select pgque.ack(%s, %s, %s, %s::bigint[], %s::text[], make_interval(secs => %s),"
            " %s::interval[], %s::bigint[])",
            (batch.queue, batch.consumer, batch.batch_id, ids, reasons, delay, delays,
             dead_ids)))

    @overload
    async def ack_and_receive(self, batch: Batch[Any], *,
                              nack: Mapping[int, str | None] | Iterable[Message[Any] | int] = (),
                              retry_after: RetryAfter = 0.0,
                              dead: Iterable[Message[Any] | int] = (),
                              max_events: int | None = None,
                              payload_type: None = None) -> Batch[Any] | None: ...

    @overload
    async def ack_and_receive(self, batch: Batch[Any], *,
                              nack: Mapping[int, str | None] | Iterable[Message[Any] | int] = (),
                              retry_after: RetryAfter = 0.0,
                              dead: Iterable[Message[Any] | int] = (),
                              max_events: int | None = None,
                              payload_type: type[T]) -> Batch[T] | None: ...

    async def ack_and_receive(self, batch: Batch[Any], *,
                              nack: Mapping[int, str | None] | Iterable[Message[Any] | int] = (),
                              retry_after: RetryAfter = 0.0,
                              dead: Iterable[Message[Any] | int] = (),
                              max_events: int | None = None,
                              payload_type: type[T] | None = None) -> Batch[Any] | None:
        """:meth:`ack` of a slot's batch piece (with its ``nack``), then
        :meth:`receive_partitioned` of the same slot, in one round trip and one
        transaction: what a loop over one slot costs per piece halves. Returns
        the slot's next piece, or None (also when this session released and
        claimed the slot again since the piece: receive_partitioned then takes
        the new epoch). An error undoes both, the ack included (SlotNotOwned,
        BatchNotActive...). Slot batches only (ValueError)."""
        if batch.slot is None:
            raise ValueError("ack_and_receive takes a slot's batch (receive_partitioned); "
                             "ack a plain batch with ack, then receive")
        ids, reasons = nacked(nack)
        delay, delays = failure_delays(ids, retry_after)
        dead_ids = message_ids(dead)
        check, params = self._checked(batch.queue)
        if delays is None and not dead_ids:
            rows = await self._rows(
                f"select * from pgque.ack_receive_partitioned({check}, %s, %s, %s, %s, "
                "%s::bigint[], %s::text[], make_interval(secs => %s), %s)",
                (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id, ids,
                 reasons, delay, max_events), binary=True)
        else:
            rows = await self._rows(
                f"select * from pgque.ack_receive_partitioned({check}, %s, %s, %s, %s, "
                "%s::bigint[], %s::text[], make_interval(secs => %s), %s::interval[], "
                "%s::bigint[], %s::integer)",
                (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id, ids,
                 reasons, delay, delays, dead_ids, max_events), binary=True)
        return batch_from_rows(batch.queue, batch.consumer, rows, payload_type, batch.slot,
                               batch.slots, zone=self.conn.info.timezone)

    async def nack(self, batch: Batch[Any],
                   messages: Message[Any] | int | Iterable[Message[Any] | int], *,
                   retry_after: float | timedelta = 0.0, reason: str | None = None) -> int:
        """Send messages of the batch to retry after ``retry_after`` (or to dead
        letters once retried max_retries times), in one round trip.

        Returns how many went to dead letters. Ack the batch afterwards as usual.
        """
        ids = message_ids(messages)
        if batch.slot is not None:
            check, params = self._checked(batch.queue)
            return int(await self._value(
                f"select pgque.nack_partitioned({check}, %s, %s, %s, %s, %s::bigint[], "
                "make_interval(secs => %s), %s)",
                (*params, batch.consumer, batch.slot, batch.slots, batch.batch_id, ids,
                 seconds(retry_after), reason)))
        return int(await self._value(
            "select pgque.nack(%s, %s, %s, %s::bigint[], make_interval(secs => %s), %s)",
            (batch.queue, batch.consumer, batch.batch_id, ids, seconds(retry_after), reason)))

    # -- partitioned consumption -----------------------------------------

    async def subscribe_slots(self, queue: str, consumer: str, *, slots: int,
                              policy: str | None = None) -> int:
        """Subscribe consumer group ``consumer`` with ``slots`` slots (N is then fixed).

        Idempotent for the same N; returns how many slot subscriptions were new.
        With ``policy`` (``"skip"`` or ``"pause"``), the group gets that failure
        policy with the default bounds of :meth:`set_failure_policy`, unless it
        has it already. Raises SlotCountMismatch if the group exists with another N.
        """
        if policy is None:  # also on a database from before the policies (0.5)
            return int(await self._value("select pgque.subscribe_slots(%s, %s, %s)",
                                         (queue, consumer, slots)))
        return int(await self._value("select pgque.subscribe_slots(%s, %s, %s, %s)",
                                     (queue, consumer, slots, policy)))

    async def set_failure_policy(self, queue: str, consumer: str, policy: str, *,
                                 max_attempts: int | None = 10,
                                 pause_timeout: float | timedelta | None = timedelta(hours=1),
                                 max_retries: int | None = None) -> None:
        """Set what a failed event does to its key in consumer group ``consumer``:
        ``"skip"`` (the default of a new group: it is retried later, the key
        moves on) or ``"pause"`` (no later event of the key is handed out until
        it is handled or dead-lettered). A pause ends with the head in the dead
        letters after ``max_attempts`` failures, or once it blocked its key for
        ``pause_timeout`` (None: no bound). Under skip a failed event is retried
        ``max_retries`` times before it is dead-lettered: the group's own, or
        (None) the queue's. Going to ``"skip"`` releases every blocked key.
        Workers read the policy when they start.
        """
        await self._value(
            "select pgque.set_failure_policy(%s, %s, %s, %s, make_interval(secs => %s), %s)",
            (queue, consumer, policy, max_attempts,
             None if pause_timeout is None else seconds(pause_timeout), max_retries))

    async def failure_policy(self, queue: str, consumer: str) -> FailurePolicy:
        """Consumer group ``consumer``'s failure policy and the bounds of a pause."""
        rows = await self._rows("select * from pgque.failure_policy(%s, %s)",
                                (queue, consumer), by_name=True)
        row = rows[0]
        return FailurePolicy(policy=row.policy, max_attempts=row.max_attempts,
                             pause_timeout=row.pause_timeout, max_retries=row.max_retries)

    async def retry_head(self, queue: str, consumer: str, key: str) -> None:
        """Hand the head of blocked key ``key`` (the event that failed) out again
        now, without waiting for its retry time. Raises KeyNotBlocked, or
        HeadInFlight while a worker has it."""
        await self._value("select pgque.retry_head(%s, %s, %s)", (queue, consumer, key))

    async def skip_head(self, queue: str, consumer: str, key: str,
                        reason: str | None = None) -> int:
        """Send the head of blocked key ``key`` to the dead letters (with ``reason``,
        else its last error) and let the key go on with its held events; returns
        the head's event id. Errors as :meth:`retry_head`."""
        return int(await self._value("select pgque.skip_head(%s, %s, %s, %s)",
                                     (queue, consumer, key, reason)))

    async def resume_key(self, queue: str, consumer: str, key: str) -> int:
        """Let blocked key ``key`` go on without its head, which goes to the retry
        queue as under the skip policy (it comes back after the key's held
        events); returns the head's event id. Errors as :meth:`retry_head`."""
        return int(await self._value("select pgque.resume_key(%s, %s, %s)",
                                     (queue, consumer, key)))

    async def blocked_keys(self, queue: str, consumer: str) -> list[BlockedKey]:
        """The keys that failed events block in consumer group ``consumer`` (the
        pause policy), by slot and key, each with its head event and what
        waits behind it."""
        rows = await self._rows("select * from pgque.blocked_keys(%s, %s)",
                                (queue, consumer), by_name=True)
        return blocked_keys_from_rows(rows)

    async def unsubscribe_slots(self, queue: str, consumer: str) -> int:
        """Remove a consumer group with all its slots; returns how many were removed."""
        return int(await self._value("select pgque.unsubscribe_slots(%s, %s)",
                                     (queue, consumer)))

    async def slot_lock_key(self, queue: str, consumer: str, slot: int) -> int:
        """The bigint session advisory-lock key that owns a slot (see docs/design-notes.md)."""
        return int(await self._value("select pgque.slot_lock_key(%s, %s, %s)",
                                     (queue, consumer, slot)))

    async def pin_session(self, settings: Mapping[str, str] | None = None) -> int:
        """Pin the server session behind this client's connection; returns its pid.

        Slot ownership and the ticker election are session locks. Once pinned,
        every slot call (claim, receive, ack, nack, release, group) and every
        ticker call checks, in the same statement, that it still runs on that
        session, and raises SessionUnstable when it does not (a transaction-mode
        pooler, or another client pinning the same backend). claim_slot pins
        on first use. The pin is a session setting, so the rollback of the
        transaction it ran in (or a RESET ALL) takes it off the session: the
        next check on the same backend puts it back rather than failing. The
        pin is kept for the client's lifetime. ``settings`` (session settings,
        name to value) are set in the same statement, so they are on the
        pinned session whatever lies in between (and, like the pin, undone by
        a rollback of that statement's transaction).
        """
        token = secrets.token_hex(8)
        pairs = list((settings or {}).items())
        extra = "".join(", set_config(%s, %s, false)" for _ in pairs)
        pid = int(await self._value(f"select pgque.pin_session(%s){extra}",
                                    (token, *(v for pair in pairs for v in pair))))
        self._pinned = (pid, token)
        return pid

    @property
    def pinned_pid(self) -> int | None:
        """The backend pid pinned by pin_session(), or None."""
        return None if self._pinned is None else self._pinned[0]

    def _checked(self, value: str | None) -> tuple[str, tuple[Any, ...]]:
        """SQL and parameters for a text argument that, on a pinned session, passes
        through pgque.session_checked, and with a lease through pgque.leased:
        arguments are evaluated before the call, so a call on the wrong session
        fails before it takes effect, and the lease is set for the call's
        transaction (one server session, even behind a transaction pooler)."""
        check: str = "%s"
        params: tuple[Any, ...] = (value,)
        if self._pinned is not None:
            check, params = "pgque.session_checked(%s, %s, %s)", (value, *self._pinned)
        if self._lease is not None:
            check, params = f"pgque.leased({check}, %s)", (*params, self._lease.token)
        return check, params

    # -- ownership by lease (for clients behind a transaction pooler) ----------

    async def set_ownership(self, queue: str, consumer: str, mode: str, *,
                            lease: float | timedelta = 15.0) -> bool:
        """How the group's slots are owned: ``"advisory"`` (session advisory
        locks, the default) or ``"lease"`` (leases of ``lease`` seconds, 1 to
        3600, that their holders renew: for clients behind a transaction-mode
        pooler). The same mode again only sets the lease time. Another mode
        raises OwnershipMismatch while a slot is owned or a member has joined
        in the current one. True when the mode changed."""
        return bool(await self._value(
            "select pgque.set_ownership(%s, %s, %s, make_interval(secs => %s))",
            (queue, consumer, mode, seconds(lease))))

    async def take_lease(self, queue: str, consumer: str, *, name: str,
                         member: bool = False) -> Lease:
        """Take a new lease of a group that owns its slots by lease, and make it
        this client's: its owner calls (claim, receive, ack, nack, release,
        join, group status) carry it from now on, on whichever server session
        they land. ``name`` says who holds it; a ``member`` lease counts in the
        group's fair share (join_group). Renew it (:meth:`renew_lease`) well
        within :attr:`Lease.lease`: an expired lease is dead, every call with it
        raises LeaseExpired and its slots go to whoever claims them."""
        (row,) = await self._rows("select * from pgque.take_lease(%s, %s, %s, %s)",
                                  (queue, consumer, name, member), by_name=True)
        self._lease = Lease(id=row.lease_id, token=row.token, lease=row.lease)
        return self._lease

    @property
    def lease(self) -> Lease | None:
        """The lease this client's owner calls carry, or None. Set it to carry
        another (one taken by another client, say), or None for none."""
        return self._lease

    @lease.setter
    def lease(self, lease: Lease | None) -> None:
        self._lease = lease

    async def renew_lease(self, lease: Lease | None = None) -> timedelta:
        """Extend ``lease`` (this client's by default) by its group's lease time from
        now, which it returns; LeaseExpired when it expired already."""
        lease = lease or self._lease
        if lease is None:
            raise InvalidArgument("this client holds no lease")
        value: timedelta = await self._value("select pgque.renew_lease(%s)", (lease.token,))
        return value

    async def renew_leases(self, leases: Collection[Lease]) -> set[int]:
        """Extend each of ``leases`` that has not expired, in one statement; the ids
        of those extended (an expired one is dead for good)."""
        by_token = {lease.token: lease.id for lease in leases}
        renewed: list[str] = await self._value("select pgque.renew_leases(%s::text[])",
                                               (list(by_token),))
        return {by_token[token] for token in renewed}

    async def end_lease(self, lease: Lease | None = None) -> int:
        """End ``lease`` (this client's by default, which it then no longer carries):
        its slots are released and their epochs end. Returns how many it owned."""
        lease = lease or self._lease
        if lease is None:
            return 0
        owned = int(await self._value("select pgque.end_lease(%s)", (lease.token,)))
        if lease is self._lease:
            self._lease = None
        return owned

    async def claim_slot(self, queue: str, consumer: str, slot: int) -> bool:
        """Try to own a slot: a non-blocking session advisory lock on this client's
        connection. False at once when another session holds it. Pins the
        session first (see pin_session). With a lease (:meth:`take_lease`): a
        claim of the slot for the lease, with a new epoch when the slot moves."""
        if self._pinned is None and self._lease is None:
            await self.pin_session()
        check, params = self._checked(queue)
        return bool(await self._value(f"select pgque.claim_slot({check}, %s, %s)",
                                      (*params, consumer, slot)))

    async def release_slot(self, queue: str, consumer: str, slot: int) -> bool:
        """Give up a slot this session owns; False if it did not own it."""
        check, params = self._checked(queue)
        return bool(await self._value(f"select pgque.release_slot({check}, %s, %s)",
                                      (*params, consumer, slot)))

    async def check_fence(self, fence: Fence) -> None:
        """Raise StaleEpoch unless ``fence.epoch`` is still the slot's epoch and the
        session that received under it still owns the slot.

        Call it on the connection, and inside the transaction, that writes a
        handler's effects (``await AsyncClient(conn).check_fence(message.fence)``):
        the epoch then holds until that transaction ends, and a new owner's first
        receive waits for it, so no effect checked under an old epoch commits
        after the slot moved.
        """
        await self._rows("select pgque.check_fence(%s, %s, %s, %s)",
                         (fence.queue, fence.consumer, fence.slot, fence.epoch))

    async def join_group(self, queue: str, consumer: str) -> bool:
        """Register this session as a live member of the group (see group_status)."""
        check, params = self._checked(queue)
        return bool(await self._value(f"select pgque.join_group({check}, %s)",
                                      (*params, consumer)))

    async def group_status(self, queue: str, consumer: str) -> GroupStatus:
        """The group now: its live members, this session's rank among them and
        who owns each slot (see GroupStatus.fair_share)."""
        check, params = self._checked(queue)
        (row,) = await self._rows(f"select * from pgque.group_status({check}, %s)",
                                  (*params, consumer), by_name=True)
        return group_status_from_row(row)

    async def pending_slots(self, queue: str, consumer: str) -> frozenset[int]:
        """The slots of the group whose receive may return a batch now (an open
        batch, or events since their last tick): a hint for waking slot owners,
        one read-only round trip. A slot left out is found by its next poll."""
        check, params = self._checked(queue)
        slots: list[int] = await self._value(f"select pgque.pending_slots({check}, %s)",
                                             (*params, consumer))
        return frozenset(slots)

    @overload
    async def receive_partitioned(self, queue: str, consumer: str, *, slot: int, slots: int,
                                  max_events: int | None = None,
                                  payload_type: None = None) -> Batch[Any] | None: ...

    @overload
    async def receive_partitioned(self, queue: str, consumer: str, *, slot: int, slots: int,
                                  max_events: int | None = None,
                                  payload_type: type[T]) -> Batch[T] | None: ...

    async def receive_partitioned(self, queue: str, consumer: str, *, slot: int, slots: int,
                                  max_events: int | None = None,
                                  payload_type: type[T] | None = None) -> Batch[Any] | None:
        """The open (or next) batch of one slot, holding only the events whose
        partition key routes to it. The session must own the slot (SlotNotOwned)."""
        check, params = self._checked(queue)
        rows = await self._rows(
            f"select * from pgque.receive_partitioned({check}, %s, %s, %s, %s)",
            (*params, consumer, slot, slots, max_events), binary=True)
        return batch_from_rows(queue, consumer, rows, payload_type, slot, slots,
                               zone=self.conn.info.timezone)

    @overload
    async def receive_slots(self, queue: str, consumer: str, *, slots: int, owned: Iterable[int],
                            max_events: int | None = None,
                            payload_type: None = None) -> list[Batch[Any]]: ...

    @overload
    async def receive_slots(self, queue: str, consumer: str, *, slots: int, owned: Iterable[int],
                            max_events: int | None = None,
                            payload_type: type[T]) -> list[Batch[T]]: ...

    async def receive_slots(self, queue: str, consumer: str, *, slots: int, owned: Iterable[int],
                            max_events: int | None = None,
                            payload_type: type[T] | None = None) -> list[Batch[Any]]:
        """What :meth:`receive_partitioned` returns for each of the ``owned`` slots of
        the group (of ``slots`` slots), in one round trip: the batches that have
        something, ascending by slot. ``max_events`` bounds each piece. The
        session must own every slot (SlotNotOwned, and nothing is received)."""
        batches, _ = await self._receive_slot_pieces(queue, consumer, slots, owned, max_events,
                                                     payload_type)
        return batches

    async def _receive_slot_pieces(self, queue: str, consumer: str, slots: int,
                                   owned: Iterable[int], max_events: int | None,
                                   payload_type: type[T] | None, *,
                                   acked: Sequence[Batch[Any]] = ()
                                   ) -> tuple[list[Batch[Any]], set[int]]:
        """:meth:`receive_slots`, and the slots whose batch ends before the queue's
        newest tick (the Worker receives them again at once once acked). With
        ``acked``, those pieces (of slots of the group, without failures) are
        acked first, in the same transaction: one round trip for both."""
        check, params = self._checked(queue)
        wanted = list(owned)
        # The slot, then pgque.batch_event's columns but the slot, as far as the
        # database has them (delayed_id since 0.7, ahead since 0.8): read where they are.
        receive = f"select * from pgque.receive_slots({check}, %s, %s, %s::integer[], %s)"
        receive_params = (*params, consumer, slots, wanted, max_events)
        rows: list[Any] | None = None
        if acked and not self._without_ack_receive_slots:
            try:
                rows = await self._rows(
                    f"select * from pgque.ack_receive_slots({check}, %s, %s, %s::integer[],"
                    " %s::bigint[], %s::integer[], %s)",
                    (*params, consumer, slots, [b.slot for b in acked],
                     [b.batch_id for b in acked], wanted, max_events), binary=True)
            except psycopg.errors.UndefinedFunction:
                self._without_ack_receive_slots = True  # a database older than 0.8
        if acked and rows is None:
            # The ack, then the receive, in one transaction all the same.
            async with self.conn.transaction():
                await self.ack_slots(acked)
                rows = await self._rows(receive, receive_params, binary=True) if wanted else []
        elif rows is None:
            rows = await self._rows(receive, receive_params, binary=True)
        by_slot: dict[int, list[Any]] = {}
        for row in rows:
            by_slot.setdefault(row[0], []).append(row)
        batches = []
        ahead = set()
        zone = self.conn.info.timezone
        for slot, slot_rows in by_slot.items():
            batch = batch_from_rows(queue, consumer, slot_rows, payload_type, slot, slots,
                                    slot_first=True, zone=zone)
            if batch is not None:
                batches.append(batch)
            # A database older than 0.8 does not say: then every batch may have more.
            if len(slot_rows[0]) <= 10 or slot_rows[0][10]:
                ahead.add(slot)
        return batches, ahead

    async def ack_slots(self, batches: Sequence[Batch[Any]], *,
                        nack: Mapping[int, str | None] | Iterable[Message[Any] | int] = (),
                        retry_after: float | timedelta = 0.0) -> list[bool]:
        """Ack several slots' batch pieces of one group (as :meth:`receive_slots`
        returns them) in one transaction; for each, whether that finished its
        batch. ``nack`` names failed events of any of the pieces, as for
        :meth:`ack`: each goes to retry with its own piece's ack. All or nothing:
        an ack that fails (SlotNotOwned, a batch no longer open) acks none."""
        if not batches:
            return []
        first = batches[0]
        if any(b.slot is None or (b.queue, b.consumer, b.slots)
               != (first.queue, first.consumer, first.slots) for b in batches):
            raise ValueError("ack_slots takes slot batches of one consumer group")
        ids, reasons = nacked(nack)
        if len(reasons) != len(ids):  # one reason (None) for all
            reasons = reasons[:1] * len(ids)
        reason_of = dict(zip(ids, reasons, strict=True))
        failed: list[dict[int, str | None]] = [
            {m.id: reason_of[m.id] for m in b.messages if m.id in reason_of} for b in batches]
        unknown = set(reason_of) - {i for piece in failed for i in piece}
        if unknown:
            raise ValueError(f"events {sorted(unknown)} are in none of these batches")
        check, params = self._checked(first.queue)
        plain = [b for b, piece in zip(batches, failed, strict=True) if not piece]
        statement = f"select pgque.ack_slots({check}, %s, %s, %s::integer[], %s::bigint[])"
        if len(plain) == len(batches):
            done: list[bool] = await self._value(
                statement, (*params, first.consumer, first.slots, [b.slot for b in batches],
                            [b.batch_id for b in batches]))
            return done
        # With nacks, slot by slot in one transaction, ascending by slot: the
        # lock order of every call that locks several slots of a group.
        finished: dict[int, bool] = {}
        async with self.conn.transaction():
            for batch, piece in sorted(zip(batches, failed, strict=True),
                                       key=lambda pair: pair[0].slot or 0):
                finished[id(batch)] = await self.ack(batch, nack=piece,
                                                     retry_after=retry_after)
        return [finished[id(b)] for b in batches]

    async def partition_slot_status(self, queue: str | None = None, *,
                                    stalled_after: Duration | None = None) -> list[SlotStatus]:
        """Every slot of every consumer group (of one queue): owner (pid and
        application name), epoch, pending events, oldest unconsumed age, and
        whether it looks stalled by ``stalled_after`` (seconds, a timedelta or an
        interval literal such as ``"5 minutes"``; None: each queue's own)."""
        return await self._records(
            SlotStatus, f"select * from pgque.get_partition_slot_status({_STALLED_AFTER}) "
            "where %s::text is null or queue_name = %s "
            "order by queue_name, consumer_name, slot",
            (*_interval_params(stalled_after), queue, queue))

    async def group_info(self, queue: str | None = None) -> list[GroupInfo]:
        """Every consumer group (of one queue): slot count, live members, owned
        slots, newest epoch."""
        return await self._records(
            GroupInfo, "select * from pgque.group_info where %s::text is null "
            "or queue_name = %s order by queue_name, consumer_name", (queue, queue))

    # -- the record of handler calls (pgque verify) ------------------------

    async def start_recording(self, queue: str, consumer: str, slots: int) -> datetime:
        """Mark the group's handler calls as recorded from now on, unless they
        already are (the earlier start stays); returns that start. A Worker with
        ``record=True`` calls it; :meth:`verify` checks the events sent since."""
        start: datetime = await self._value("select pgque.start_recording(%s, %s, %s)",
                                            (queue, consumer, slots))
        return start

    async def forget_handling(self, queue: str, consumer: str, slots: int) -> int:
        """Delete the group's record of handler calls and its start; returns
        how many calls it held."""
        return int(await self._value("select pgque.forget_handling(%s, %s, %s)",
                                     (queue, consumer, slots)))

    async def _record_calls(self, worker: str,
                            calls: Sequence[tuple[Batch[Any], Message[Any], float, float, str]],
                            ) -> int:
        """Append handler calls (the batch, the message, start and end by
        ``time.time()``, outcome) of one group to its record, in one statement
        (their JSON: see pgque.record_handling)."""
        batch = calls[0][0]
        assert batch.slots is not None and all(
            (b.queue, b.consumer, b.slots) == (batch.queue, batch.consumer, batch.slots)
            for b, *_ in calls)
        rows = [(b.slot, m.id, b.batch_id, m.retry_count, m.partition_key,
                 None if b.fence is None else b.fence.epoch, started, ended, outcome)
                for b, m, started, ended, outcome in calls]
        return int(await self._value("select pgque.record_handling(%s, %s, %s, %s, %s::jsonb)",
                                     (batch.queue, batch.consumer, batch.slots, worker,
                                      _JSON.encode(rows).decode())))

    async def verify(self, queue: str, consumer: str, *, since: datetime | None = None,
                     clock_skew: float | timedelta = 0.0) -> Verification:
        """Check the group's record of handler calls (its workers ran with
        ``record=True``) against pgque's promises: routing, per-key order (and
        the pause policy's hold), one handler per key at a time, and no event
        its slots passed left without a call that returned, a dead letter or a
        retry to come. ``since``, when later than the recording start (the
        default), bounds the calls and events looked at; ``clock_skew`` is how
        far the clocks of the group's workers may differ (overlaps shorter than
        that, and first calls of a key closer than that, are not judged).
        Raises NotRecorded for a group that has no record."""
        skew = clock_skew if isinstance(clock_skew, timedelta) else timedelta(seconds=clock_skew)
        async with translated(), self.conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(b"select * from pgque.handling_summary(%s, %s, %s)",
                              (queue, consumer, since))
            row = await cur.fetchone()
            assert row is not None
            summary = from_row(HandlingSummary, row)
            await cur.execute(b"select * from pgque.verify_handling(%s, %s, %s, %s)",
                              (queue, consumer, summary.since, skew))
            findings = [from_row(Finding, found) for found in await cur.fetchall()]
        return Verification(summary, findings)

    async def key_lag(self, queue: str, consumer: str, *, top: int = 10) -> list[KeyLag]:
        """The ``top`` keys of group ``consumer`` with the most events waiting
        (not consumed by their slot yet), most first, then oldest first: the hot
        keys, and how long their oldest event has waited. One read of the
        queue's pending events (not of the whole log)."""
        return await self._records(KeyLag, "select * from pgque.key_lag(%s, %s, %s)",
                                   (queue, consumer, top))

    # -- dead letters ----------------------------------------------------

    async def dead_letters(self, queue: str, consumer: str | None = None, *, limit: int = 100,
                           after_id: int = 0) -> list[DeadLetter]:
        """Dead letters of a queue (of one consumer), oldest first. A role that
        is not an admin gets those of the consumers it may use only."""
        rows = await self._rows("select * from pgque.dead_letters(%s, %s, %s, %s)",
                                (queue, consumer, limit, after_id), by_name=True)
        return dead_letters_from_rows(rows)

    async def replay_dead_letter(self, queue: str, dead_letter_id: int, *,
                                 as_next: bool = False) -> int:
        """Put a dead letter back into the log for its consumer; returns the event id.

        With ``as_next`` (a consumer group's dead letter with a partition key),
        it comes back as the next event of its key in its slot, before the
        key's events the slot has not handed out yet, instead of after
        everything sent since (see docs/concepts.md, failure policies).
        Admins may replay any; another role those of the consumers it owns or
        was granted, while they are subscribed (ConsumerAccessDenied otherwise).
        """
        if not as_next:  # also on a database from before as_next (0.5)
            return int(await self._value("select pgque.replay_dead_letter(%s, %s)",
                                         (queue, dead_letter_id)))
        return int(await self._value("select pgque.replay_dead_letter(%s, %s, true)",
                                     (queue, dead_letter_id)))

    async def replay_dead_letters(self, queue: str, consumer: str | None = None, *,
                                  type: str | None = None, key: str | None = None,
                                  older_than: float | timedelta | None = None,
                                  reason: str | None = None, as_next: bool = False,
                                  dry_run: bool = False) -> int:
        """Replay every dead letter of ``queue`` that matches the filters given (of
        a consumer or group, of an event type, of a partition key, dead-lettered
        more than ``older_than`` ago, whose reason contains ``reason``), as
        :meth:`replay_dead_letter` does, all or none; returns how many. With
        ``dry_run``, only counts them. A role that is not an admin replays
        those of the consumers it may use."""
        return int(await self._value(
            "select pgque.replay_dead_letters(%s, %s, %s, %s, make_interval(secs => %s), %s,"
            " %s, %s)",
            (queue, consumer, type, key, None if older_than is None else seconds(older_than),
             reason, as_next, dry_run)))

    async def purge_dead_letters_where(self, queue: str, consumer: str | None = None, *,
                                       type: str | None = None, key: str | None = None,
                                       older_than: float | timedelta | None = None,
                                       reason: str | None = None, dry_run: bool = False) -> int:
        """Delete every dead letter of ``queue`` that matches the filters (as for
        :meth:`replay_dead_letters`); returns how many. With ``dry_run``, only
        counts them."""
        return int(await self._value(
            "select pgque.purge_dead_letters_where(%s, %s, %s, %s, make_interval(secs => %s),"
            " %s, %s)",
            (queue, consumer, type, key, None if older_than is None else seconds(older_than),
             reason, dry_run)))

    async def purge_dead_letters(self, queue: str, consumer: str | None = None,
                                 ids: Sequence[int] | None = None) -> int:
        """Delete dead letters (the given ids, or all of the queue or consumer).

        A role that is not an admin purges those of the consumers it may use;
        naming another consumer, or an id of its dead letters, is refused
        (ConsumerAccessDenied) and purges nothing.
        """
        return int(await self._value("select pgque.purge_dead_letters(%s, %s, %s::bigint[])",
                                     (queue, consumer, None if ids is None else list(ids))))

    # -- information -----------------------------------------------------

    async def queue_info(self, queue: str | None = None, *,
                         stalled_after: Duration | None = None) -> list[QueueInfo]:
        """Every queue (or the one named): settings, newest tick, events since that
        tick, subscriptions, and whether nobody ticks it, by ``stalled_after`` (as
        for :meth:`partition_slot_status`)."""
        return await self._records(
            QueueInfo, f"select * from pgque.get_queue_info({_STALLED_AFTER}) "
            "where %s::text is null or queue_name = %s order by queue_name",
            (*_interval_params(stalled_after), queue, queue))

    async def ticker_info(self) -> TickerInfo:
        """The database's active ticker (pid and application name), or a record of
        Nones when no ticker is active. Unlike :meth:`active_ticker`, readers may ask."""
        (record,) = await self._records(TickerInfo, "select * from pgque.ticker_info")
        return record

    async def generated_code(self) -> list[GeneratedCode]:
        """The code pgque generates (event writer, batch readers, slot indexes) of
        the queues the caller may see, and whether each is current."""
        return await self._records(GeneratedCode, "select * from pgque.generated_code")

    async def consumer_info(self, queue: str | None = None) -> list[ConsumerInfo]:
        """Every subscription (of one queue): cursor, lag, open batch, oldest
        unconsumed age. A group's slots are listed as ``group#slot/slots``."""
        return await self._records(
            ConsumerInfo, "select * from pgque.consumer_info where %s::text is null "
            "or queue_name = %s order by queue_name, consumer_name", (queue, queue))

    async def _records(self, record: type[R], sql: str, params: Sequence[Any] = ()) -> list[R]:
        async with translated(), self.conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql.encode(), params)
            return [from_row(record, row) for row in await cur.fetchall()]
