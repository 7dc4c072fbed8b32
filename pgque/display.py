"""How the ``pgque`` command line shows things: JSON for scripts, rich tables and
lines for people, and errors as one line.

User data (queue and consumer names, event types, keys, payloads, reasons) is
never read as rich markup and never reaches the terminal raw: control
characters are written as escapes, so an event cannot drive the terminal.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import msgspec
import psycopg
from psycopg import errors as pg_errors
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from pgque.info import ConsumerInfo, GeneratedCode, GroupInfo, QueueInfo, SlotStatus, TickerInfo
from pgque.types import Message

__all__ = [
    "PAYLOAD_SHOWN_CHARS",
    "age",
    "cell",
    "console",
    "describe_error",
    "dumps",
    "escape",
    "event_json",
    "event_line",
    "one_line",
    "payload",
    "queues_table",
    "session_name",
    "state",
    "status_view",
    "table",
]

# How much of a payload too deeply nested to parse is shown (as a string).
PAYLOAD_SHOWN_CHARS = 200


def console() -> Console:
    """A console for stdout; piped, it is wide, so tables are not squeezed."""
    out = Console(highlight=False, soft_wrap=True)  # an event line stays one line
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = 200  # piped: don't squeeze tables into 80 columns
    return out


# -- JSON --------------------------------------------------------------------------------------


def _json_default(value: object) -> object:
    """JSON for what the info calls return: records as objects, intervals as
    seconds, times as ISO 8601."""
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.asdict(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def dumps(document: object, *, indent: int | None = 2) -> str:
    """``document`` as JSON: indented, or compact on one line with ``indent=None``."""
    separators = None if indent else (",", ":")
    return json.dumps(document, default=_json_default, indent=indent, separators=separators)


def payload(data: str | None) -> Any:
    """A stored payload as a JSON value (the server only stores valid JSON).

    JSON nested deeper than Python can parse (the server takes thousands of
    levels) becomes a string: its start, cut, and a note saying why.
    """
    if data is None:
        return None
    try:
        value = json.loads(data)
        json.dumps(value)  # what parses at the limit may not write back
    except RecursionError:
        cut = data[:PAYLOAD_SHOWN_CHARS] + ("..." if len(data) > PAYLOAD_SHOWN_CHARS else "")
        return f"{cut} (payload nested too deeply to show)"
    return value


# -- text and tables ---------------------------------------------------------------------------


def escape(text: str) -> str:
    """Text with its control characters (Unicode category Cc: ESC, BEL, CR, newline...)
    written as escapes (\\x1b), so user data cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(
        (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        if unicodedata.category(ch) == "Cc" else ch
        for ch in text)


def age(value: timedelta | None) -> str:
    """A short human duration: 0.35s, 42.0s, 3m07s, 2h05m, 4d03h."""
    if value is None:
        return "-"
    seconds = value.total_seconds()
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 1 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def cell(value: object) -> Text:
    """A table cell; Text, so user data is never read as rich markup."""
    if value is None:
        return Text("-", style="dim")
    if isinstance(value, timedelta):
        return Text(age(value))
    if isinstance(value, datetime):
        return Text(value.astimezone().isoformat(sep=" ", timespec="seconds"))
    return Text(escape(str(value)))


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> Table:
    """A table of ``rows``; a value that is already Text keeps its style."""
    result = Table(title=title, title_justify="left", title_style="bold")
    for column in columns:
        result.add_column(column)
    for row in rows:
        result.add_row(*(v if isinstance(v, Text) else cell(v) for v in row))
    return result


def policy(group: GroupInfo) -> Text:
    """A group's failure policy; a pause with no bound is shown as a warning:
    a head that never succeeds then blocks its key until an operator acts."""
    if group.failure_policy != "pause":
        return Text(group.failure_policy)
    if group.max_attempts is None and group.pause_timeout is None:
        return Text("pause, unbounded", style="bold yellow")
    bounds = [f"{group.max_attempts} attempts" if group.max_attempts is not None else None,
              f"{group.pause_timeout}" if group.pause_timeout is not None else None]
    return Text(f"pause ({', '.join(b for b in bounds if b)})")


def _total(counts: Iterable[int | None]) -> int | None:
    """The sum of counts, or None when one of them could not be counted."""
    total = 0
    for count in counts:
        if count is None:
            return None
        total += count
    return total


def state(stalled: bool) -> Text:
    """The state cell of a queue or slot: STALLED, or ok."""
    return Text("STALLED", style="bold red") if stalled else Text("ok", style="dim")


def session_name(pid: int | None, name: str | None, nobody: str) -> Text:
    """A session as people know it: the application name it set (a Worker's lane,
    a ticker), else its pid; ``nobody`` when there is no session."""
    if pid is None:
        return Text(nobody, style="dim")
    return Text(escape(name)) if name else Text(f"pid {pid}")


def slot_owner(slot: SlotStatus) -> Text:
    """A slot's owner: its session (see session_name), or by lease the lease's
    name and id."""
    if slot.owner_lease is None:
        return session_name(slot.owner_pid, slot.owner_name, "unowned")
    if slot.owner_name:
        return Text(f"{escape(slot.owner_name)} (lease {slot.owner_lease})")
    return Text(f"lease {slot.owner_lease}")


def queues_table(queues: Sequence[QueueInfo], title: str | None = None) -> Table:
    """Queues, as ``queue list`` and ``status`` show them: STALLED when events
    wait for a tick that nobody has made for ``stalled after``; the delayed
    events not in the log yet and when the next one is due; the idempotency
    keys remembered."""
    return table(
        title,
        ["queue", "consumers", "last tick", "tick age", "since tick", "delayed", "next due",
         "idem keys", "tables", "rotation", "max retries", "stalled after", "state"],
        ([q.queue_name, q.consumers, q.last_tick_id, q.last_tick_age,
          q.events_since_last_tick, q.delayed_events, q.next_delivery, q.idempotency_keys,
          f"{q.current_table}/{q.event_tables}",
          q.rotation_period, q.max_retries, q.stalled_after, state(q.stalled)]
         for q in queues))


def _generated_cell(generated: Sequence[GeneratedCode]) -> RenderableType:
    lagging = [f"{g.kind} of {g.queue_name}" if g.queue_name else g.kind
               for g in generated if not g.current]
    return Text("lagging: " + ", ".join(lagging), style="yellow") if lagging else "current"


def status_view(ticker: TickerInfo, queues: Sequence[QueueInfo],
                consumers: Sequence[ConsumerInfo], groups: Sequence[GroupInfo],
                slots: Sequence[SlotStatus],
                generated: Sequence[GeneratedCode] = (),
                keys: Sequence[Mapping[str, Any]] | None = None) -> RenderableType:
    """The tables of ``pgque status``: a summary (counts of what the caller may see,
    and the active ticker), queues, plain consumers, consumer groups and their
    slots (owners by name), and with ``keys`` (rows of key_lag with their queue
    and group) the keys with the most events waiting; generated code that lags
    is named in the summary."""
    # Slot subscriptions (group#k/N) are shown per slot below, not as consumers.
    plain = [c for c in consumers if "#" not in c.consumer_name]
    stalled_queues = sum(q.stalled for q in queues)
    nobody_ticks = ticker.active_pid is None
    # No ticker is a warning (something may tick by hand, pg_cron pauses between
    # runs), and an alarm once events wait for a tick.
    ticker_cell = (Text("none active", style="bold red" if stalled_queues else "yellow")
                   if nobody_ticks else session_name(ticker.active_pid, ticker.active_name, ""))
    summary = table(
        "summary",
        ["queues", "stalled queues", "consumers", "groups", "slots", "owned slots",
         "stalled slots", "ticker", "generated code"],
        [[len(queues), stalled_queues, len(plain), len(groups), len(slots),
          sum(s.owned for s in slots), sum(s.stalled for s in slots),
          ticker_cell, _generated_cell(generated)]])
    consumer_table = table(
        "consumers",
        ["queue", "consumer", "lag", "ticks behind", "pending", "oldest unconsumed",
         "open batch", "retries", "dead letters"],
        ([c.queue_name, c.consumer_name, c.lag, c.ticks_behind, c.pending_events,
          c.oldest_unconsumed_age, c.open_batch_id, c.retries_waiting, c.dead_letters]
         for c in plain))
    slots_of: dict[tuple[str, str], list[SlotStatus]] = {}
    for slot in slots:
        slots_of.setdefault((slot.queue_name, slot.consumer_name), []).append(slot)
    group_table = table(
        "consumer groups",
        ["queue", "group", "slots", "members", "owned", "pending", "stalled slots",
         "newest epoch", "policy", "blocked keys", "oldest blocked", "dead letters"],
        ([g.queue_name, g.consumer_name, g.slots, g.members, f"{g.owned_slots}/{g.slots}",
          _total(s.pending_events for s in slots_of.get((g.queue_name, g.consumer_name), [])),
          sum(s.stalled for s in slots_of.get((g.queue_name, g.consumer_name), [])),
          g.newest_epoch, policy(g),
          g.blocked_keys, max((s.oldest_blocked_age
                               for s in slots_of.get((g.queue_name, g.consumer_name), [])
                               if s.oldest_blocked_age is not None), default=None),
          g.dead_letters]
         for g in groups))
    slot_table = table(
        "consumer group slots",
        ["queue", "group", "slot", "owner", "epoch", "pending", "oldest unconsumed",
         "ticks behind", "retries", "dead letters", "blocked keys", "state"],
        ([s.queue_name, s.consumer_name, f"{s.slot}/{s.slots}",
          slot_owner(s), s.epoch, s.pending_events,
          s.oldest_unconsumed_age, s.ticks_behind, s.retries_waiting, s.dead_letters,
          s.blocked_keys, state(s.stalled)]
         for s in slots))
    parts: list[RenderableType] = [summary]
    if nobody_ticks and stalled_queues:
        parts.append(Text("No ticker is active and events wait for a tick: run 'pgque ticker', "
                          "a Worker whose login may tick (pgque_admin), or pg_cron.",
                          style="bold red"))
    parts.append(queues_table(queues, "queues"))
    if plain:
        parts.append(consumer_table)
    if groups:
        parts.append(group_table)
    if slots:
        parts.append(slot_table)
    if keys:
        now = datetime.now(timezone.utc)
        parts.append(table(
            "keys waiting",
            ["queue", "group", "key", "slot", "pending", "oldest"],
            ([k["queue_name"], k["consumer_name"],
              "(none)" if k["partition_key"] is None else k["partition_key"], k["slot"],
              k["pending"], now - k["oldest"]] for k in keys)))
    return Group(*parts)


# -- events (pgque tail) -----------------------------------------------------------------------


def event_json(message: Message[Any]) -> str:
    """An event as one line of JSON."""
    return dumps({"id": message.id, "time": message.created_at, "type": message.type,
                  "key": message.partition_key, "retry_count": message.retry_count,
                  "delayed_id": message.delayed_id, "payload": payload(message.data)},
                 indent=None)


def event_line(message: Message[Any]) -> Text:
    """An event as one line for people: id, time, type, key, ``delayed=<id>`` for
    an event that came from a delay (the id its send returned), and the payload's
    JSON."""
    compact = dumps(payload(message.data), indent=None)
    return Text.assemble(
        (str(message.id), "bold"), " ",
        (message.created_at.astimezone().isoformat(sep=" ", timespec="milliseconds"), "dim"),
        " ", ("-", "dim") if message.type is None else (escape(message.type), "cyan"), " ",
        (f"key={escape(message.partition_key)}" if message.partition_key is not None
         else "key=-", "yellow"),
        ("" if message.delayed_id is None else (f" delayed={message.delayed_id}", "magenta")),
        " ", compact)


# -- errors ------------------------------------------------------------------------------------


def one_line(text: str) -> str:
    """``text`` with every run of whitespace, newlines included, made one space."""
    return " ".join(text.split())


def _not_installed(exc: psycopg.Error) -> bool:
    """Whether an error says pgque's schema or one of its objects is missing."""
    missing = (pg_errors.UndefinedFunction, pg_errors.UndefinedTable,
               pg_errors.InvalidSchemaName)
    text = exc.diag.message_primary or str(exc)
    return isinstance(exc, missing) and ("pgque." in text or '"pgque"' in text)


def describe_error(exc: BaseException) -> str:
    """One line saying what went wrong, with the server's hint when it gave one."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    if isinstance(cause, psycopg.Error) and _not_installed(cause):
        return ("pgque is not installed in this database, or is older than this client "
                "(run 'pgque install')")
    if isinstance(exc, psycopg.Error):
        text = exc.diag.message_primary or str(exc) or type(exc).__name__
    else:
        text = str(exc) or type(exc).__name__
    hint = cause.diag.message_hint if isinstance(cause, psycopg.Error) else None
    return one_line(f"{text} (hint: {hint})" if hint else text)
