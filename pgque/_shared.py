"""What the sync and the async client share: everything that does no I/O.

:mod:`pgque.client_async` (the source) and :mod:`pgque.client` (generated from
it) both import these, so they exist once: encoding arguments, decoding rows
into records, DSN redaction, the connection-type check.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import msgspec
import psycopg

from pgque.codec import encode_payload
from pgque.errors import ConnectError, InvalidDSN, SessionUnstable
from pgque.info import GroupStatus, SlotOwner
from pgque.types import Batch, DeadLetter, Event, Fence, Message

T = TypeVar("T")
EventLike = Event | tuple[str, Any] | tuple[str, Any, "str | None"]

# SQLSTATEs worth waiting for while a server starts: cannot connect now,
# the database system is starting up / shutting down, too many connections.
TRANSIENT_STATES = {None, "57P03", "57P01", "53300", "08001", "08006"}

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


# -- passwords in DSNs ------------------------------------------------------------------
#
# libpq quotes pieces of a DSN it rejects in its errors, and where the DSN is
# malformed it cannot say which piece is the password: a password with an
# unquoted space ends at the space, and libpq then quotes the rest as a
# keyword; one with an unencoded '@' or '/' in a URI spills into the host or
# port. So the text that may be a password is taken generously (the "secret
# spans" of the DSN below), and every quoted piece of a message that overlaps
# it is masked.

# A password in a key=value DSN (quoted or not) or in a URI's query string...
_KEY_VALUE_PASSWORD = re.compile(r"""(?i)\b(password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&'"]+)""")
# ...and in a URI's user info: scheme://user:password@host.
_URI_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/:@]*:)[^\s@]*@")
# A known password shorter than this is not hunted for in free text (it would
# garble every message); the patterns above still hide it where it is a password.
_MIN_QUOTED_PASSWORD = 3
# The keyword and '=' of a secret setting (sslpassword: the client key's).
_SECRET_KEY = re.compile(r"(?i)(?<![\w-])(?:ssl)?password\s*=\s*")
# A key=value DSN starts with a keyword and '='; anything else is read as a URI
# here, even one libpq reads as key=value for a missing slash.
_KEY_VALUE_DSN = re.compile(r"\s*[\w.-]*\s*=")
_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*:")
# Where a value may end: before the next known keyword and '=' (in a URI's
# query, after '&').
_NEXT_KEY_VALUE = re.compile(r"\s+(\w+)\s*=")
_NEXT_QUERY = re.compile(r"&(\w+)=")
# A piece of a message in quotes: libpq's "...", psycopg's '...' (repr).
_QUOTED = (re.compile(r'"((?:[^"\\]|\\.)*)"'), re.compile(r"'((?:[^'\\]|\\.)*)'"))
_MASK = "***"


@functools.cache
def _keywords() -> frozenset[str]:
    """libpq's connection keywords."""
    return frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())


def _value_end(dsn: str, start: int, pattern: re.Pattern[str]) -> int:
    """Where a value starting at ``start`` may end: at the next known keyword
    (what follows a space or '&' in a password is part of it until then)."""
    for match in pattern.finditer(dsn, start):
        if match[1] in _keywords():
            return match.start()
    return len(dsn)


def _quoted_end(dsn: str, start: int) -> int:
    """The end of the quoted value at ``start`` (past its closing quote), or of
    the DSN when the quote is never closed."""
    index = start + 1
    while index < len(dsn):
        if dsn[index] == "\\":
            index += 2
        elif dsn[index] == "'":
            return index + 1
        else:
            index += 1
    return len(dsn)


def secret_spans(dsn: str) -> list[tuple[int, int]]:
    """Where in ``dsn`` a password may be, as (start, end) offsets, taken
    generously: the values of ``password`` and ``sslpassword`` up to the next
    known keyword, and in a URI everything between the user name's ':' and
    the last '@'."""
    spans: list[tuple[int, int]] = []
    is_uri = not _KEY_VALUE_DSN.match(dsn)
    if is_uri:
        at = dsn.rfind("@")
        scheme = _SCHEME.match(dsn)
        colon = dsn.find(":", scheme.end() if scheme else 0, max(at, 0))
        if colon >= 0:
            spans.append((colon + 1, at))
    for match in _SECRET_KEY.finditer(dsn):
        start = match.end()
        if is_uri:
            end = _value_end(dsn, start, _NEXT_QUERY)
        elif dsn.startswith("'", start):
            end = _quoted_end(dsn, start)
        else:
            end = _value_end(dsn, start, _NEXT_KEY_VALUE)
        spans.append((start, end))
    return spans


def _secrets_of(dsn: str, spans: list[tuple[int, int]], given: Iterable[str]) -> list[str]:
    """The texts to hide wherever they appear, longest first: the spans as
    written, unquoted and percent-decoded, and their words; the password libpq
    parses; the ``given`` ones."""
    found = [*given]
    for start, end in spans:
        text = dsn[start:end].strip()
        found += [text, text.strip("'"), urllib.parse.unquote(text)]
        found += re.split(r"[\s@/&=']+", text)
    try:
        password = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        password = None
    if isinstance(password, str):
        found.append(password)
    return sorted({s for s in found if len(s) >= _MIN_QUOTED_PASSWORD}, key=len, reverse=True)


def _masked_slice(dsn: str, start: int, end: int, spans: list[tuple[int, int]]) -> str:
    """``dsn[start:end]`` with what overlaps a span shown as ***."""
    parts: list[str] = []
    position = start
    for span_start, span_end in sorted(spans):
        span_start, span_end = max(span_start, position), min(span_end, end)
        if span_start < span_end:
            parts += [dsn[position:span_start], _MASK]
            position = span_end
    parts.append(dsn[position:end])
    return "".join(parts)


def _masked_piece(piece: str, dsn: str, spans: list[tuple[int, int]],
                  secrets_found: list[str]) -> str:
    """A piece of a message that libpq or psycopg quoted, with what may be a
    password masked: where the piece is text of the DSN that overlaps a span,
    that part; a piece not from the DSN (decoded, joined) that holds a secret,
    or is part of one, whole."""
    overlapping: tuple[int, int] | None = None
    outside = False
    start = dsn.find(piece)
    while start >= 0:
        end = start + len(piece)
        if any(s < end and start < e for s, e in spans):
            overlapping = overlapping or (start, end)
        else:
            outside = True
        start = dsn.find(piece, start + 1)
    if overlapping is not None:
        # A piece too short to tell anything, found outside the password too
        # (a user "u" of a password with a "u"), is that other text.
        if outside and len(piece) < _MIN_QUOTED_PASSWORD:
            return piece
        return _masked_slice(dsn, *overlapping, spans)
    if outside:
        return piece
    if any(s in piece or (len(piece) >= _MIN_QUOTED_PASSWORD and piece in s)
           for s in secrets_found):
        return _MASK
    return piece


def redact(text: str, dsn: str | None = None, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password hidden (``***``): in key=value and URI DSNs
    it holds; when the ``dsn`` it came from is given, every quoted piece of
    that DSN that may belong to its password (libpq quotes pieces of a DSN it
    rejects), and its password wherever it appears; and ``secrets`` (passwords
    given apart from the DSN) wherever they appear."""
    spans = secret_spans(dsn) if dsn else []
    secrets_found = _secrets_of(dsn or "", spans, secrets)
    if dsn:
        def mask(match: re.Match[str]) -> str:
            quote = match[0][0]
            piece = _masked_piece(match[1], dsn, spans, secrets_found) if match[1] else ""
            return f"{quote}{piece}{quote}"

        for pattern in _QUOTED:
            text = pattern.sub(mask, text)
    text = _URI_PASSWORD.sub(rf"\1{_MASK}@", text)
    text = _KEY_VALUE_PASSWORD.sub(rf"\1{_MASK}", text)
    for secret in secrets_found:
        text = text.replace(secret, _MASK)
    return text


def _given_secrets(settings: Mapping[str, Any] | None) -> list[str]:
    """The secrets among psycopg.connect's keyword arguments."""
    return [value for key, value in (settings or {}).items()
            if key in ("password", "sslpassword") and isinstance(value, str)]


def _invalid_dsn(problem: str, dsn: str, secrets_given: list[str], advice: str) -> InvalidDSN:
    """InvalidDSN saying ``problem`` masked; when something was masked, it says
    so, with ``advice``."""
    text = redact(problem, dsn, secrets_given)
    if _MASK in text:
        text += f" ({_MASK} hides what may be part of a password{advice})"
    return InvalidDSN(f"invalid DSN: {text}")


def _rejected(exc: psycopg.ProgrammingError, dsn: str, secrets_given: list[str]) -> InvalidDSN:
    """InvalidDSN for a DSN (or setting) that psycopg rejected with ``exc``."""
    advice = "; quote one with blanks: password='...'" if _KEY_VALUE_DSN.match(dsn) else ""
    return _invalid_dsn(str(exc).strip(), dsn, secrets_given, advice)


def connect_error(exc: psycopg.Error, dsn: str,
                  settings: Mapping[str, Any] | None = None) -> ConnectError:
    """The pgque error for psycopg's failure to connect with ``dsn`` (and the
    keyword arguments ``settings``), every password in its text masked:
    InvalidDSN when psycopg rejected the DSN or a setting (ProgrammingError),
    else ConnectError, ``transient`` by the SQLSTATE. Raise it outside the
    ``except`` that caught ``exc``, so that ``exc``, whose text can quote the
    DSN, is not even its ``__context__``."""
    secrets_given = _given_secrets(settings)
    if isinstance(exc, psycopg.ProgrammingError):
        return _rejected(exc, dsn, secrets_given)
    error = ConnectError(redact(f"cannot connect to PostgreSQL: {str(exc).strip()}", dsn,
                                secrets_given))
    error.transient = exc.sqlstate in TRANSIENT_STATES
    return error


# A port libpq may accept (strtol's sign and blanks); an empty one is the default.
_PORT = re.compile(r"\s*(?:[+-]?\d+\s*)?")


def _misplaced_piece(params: Mapping[str, Any]) -> str | None:
    """What is wrong with a host or port that cannot be one, or None.

    A URI's password holding an unencoded '/' or '@' spills into the port or
    host, and psycopg would look that host up (a DNS query) and log it with
    the port (at DEBUG) before libpq refuses it. A host holding '@' (not
    first: an abstract socket) or a blank, or a port that is not a number,
    libpq would refuse anyway."""
    if not params.get("hostaddr"):
        for host in str(params.get("host") or "").split(","):
            absolute = host.startswith(("/", "@")) or host[1:2] == ":"  # C:\... too
            if not absolute and re.search(r"[@\s]", host):
                return f'host "{host}" is not a host name'
    for port in str(params.get("port") or "").split(","):
        if not _PORT.fullmatch(port):
            return f'port "{port}" is not a number'
    return None


def check_dsn(dsn: str, settings: Mapping[str, Any] | None = None) -> None:
    """Raise InvalidDSN, its text masking every password, unless libpq parses
    ``dsn`` and its hosts and ports (``settings`` override them) can be hosts
    and ports. Checked before psycopg connects: psycopg would look up and log
    a host that holds part of a password."""
    error: InvalidDSN | None = None
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        error = _rejected(exc, dsn, _given_secrets(settings))
    else:
        params.update({k: v for k, v in (settings or {}).items()
                       if k in ("host", "hostaddr", "port") and v is not None})
        problem = _misplaced_piece(params)
        if problem is not None:
            advice = ("" if _KEY_VALUE_DSN.match(dsn) else
                      "; write '@' and '/' in a URI's password as %40 and %2F")
            error = _invalid_dsn(problem, dsn, _given_secrets(settings), advice)
    if error is not None:
        raise error  # here, not in the except: psycopg's error quotes the DSN


def config_json(config: dict[str, float | timedelta | str]) -> str:
    return msgspec.json.encode(
        {k: v.total_seconds() if isinstance(v, timedelta) else v for k, v in config.items()}
    ).decode()


def event_columns(events: Iterable[EventLike]) -> tuple[list[str], list[str], list[str | None]]:
    """The types, encoded payloads and partition keys of ``send_batch``'s events."""
    types: list[str] = []
    payloads: list[str] = []
    keys: list[str | None] = []
    for event in events:
        if isinstance(event, Event):
            etype, payload, key = event.type, event.payload, event.partition_key
        else:
            etype, payload, key = (*event, None)[:3]
        types.append(etype)
        payloads.append(encode_payload(payload))
        keys.append(key)
    return types, payloads, keys


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


def batch_from_rows(queue: str, consumer: str, rows: Sequence[Sequence[Any]],
                    payload_type: type[T] | None, slot: int | None = None,
                    slots: int | None = None, *, at: int = 0) -> Batch[Any] | None:
    """Build a Batch from pgque.batch_event rows, as plain tuples in the type's
    column order (batch_id, ev_id, ev_time, ev_retry, ev_type, ev_data,
    ev_extra1, epoch) from column ``at`` on (1 for receive_slots' rows, led by
    the slot); None when there are no rows. Tuples and positional arguments,
    not named rows and keywords: this runs once per event received, and the
    names cost about a third of the client's time per event."""
    if not rows:
        return None
    first = rows[0]
    # Only a slot's batch has an epoch; a schema older than 0.2 has no column for it.
    epoch = first[at + 7] if len(first) > at + 7 else None
    fence = None if slot is None or epoch is None else Fence(queue, consumer, slot, epoch)
    i, t, d, k, n, c = at + 1, at + 4, at + 5, at + 6, at + 3, at + 2
    messages = [Message(r[i], r[t], r[d], r[k], r[n], r[c], payload_type, fence)
                for r in rows if r[i] is not None]
    return Batch(queue=queue, consumer=consumer, batch_id=first[at], messages=messages,
                 slot=slot, slots=slots, fence=fence)


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
