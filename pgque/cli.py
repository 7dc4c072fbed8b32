"""The ``pgque`` command line: install, queues, send, tail, workers, ticker, status, verify,
skew, the Prometheus exporter, dead letters, blocked keys.

Every command that talks to a database takes ``--dsn`` (default: the
``PGQUE_DSN`` environment variable) and ``--connect-timeout``. Errors end as one
line on stderr, ``error: ...``, with exit code 1 (2 for bad usage); ``--debug``
or ``PGQUE_DEBUG=1`` shows the traceback instead. Neither shows the DSN's
password, even of a DSN libpq cannot parse (see :func:`pgque._dsn.redact`).

It needs click and rich, the ``cli`` extra (``pip install 'pgque[cli]'``), which
the library does without; missing one, it ends with a line that says so.

Here are the commands and their options; how things are shown is in
:mod:`pgque.display`, and the long-running commands are services
(:mod:`pgque.lifecycle`): ``tail`` (:mod:`pgque.tail`), ``worker`` and ``ticker``;
``exporter`` serves :mod:`pgque.exporter`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
import psycopg

try:
    import click
    from rich.json import JSON
    from rich.live import Live
except ModuleNotFoundError as exc:  # the library needs neither: the command has an extra
    missing = (exc.name or "").partition(".")[0]
    if missing not in ("click", "rich"):
        raise
    raise SystemExit(f"error: the pgque command needs {missing}, which the cli extra "
                     "installs: pip install 'pgque[cli]'") from None

import pgque
from pgque import _install, display
from pgque._acompat import _is_coroutine_function
from pgque._dsn import redact
from pgque.errors import translated
from pgque.tail import ConsumerLeftBehind, Tail

__all__ = ["cli", "main"]

F = TypeVar("F", bound=Callable[..., Any])
#: A handler: FUNCTION(message), or (message, conn) with --transactional; or async.
Handler = Callable[..., Any]

DEFAULT_CONNECT_TIMEOUT = 5.0
SEND_CHUNK = 1000  # events per send_batch round trip when reading stdin
LOG_LEVELS = ("debug", "info", "warning", "error")
QUEUE_SETTINGS = ("ticker_max_count", "ticker_max_lag", "ticker_idle_period", "rotation_period",
                  "max_retries", "event_tables")


# -- invocation state ---------------------------------------------------------------


class State:
    """What the options of one invocation gathered, and the connection it opened."""

    def __init__(self) -> None:
        self.dsn: str | None = None
        self.connect_timeout = DEFAULT_CONNECT_TIMEOUT
        self.debug = os.environ.get("PGQUE_DEBUG", "") not in ("", "0")
        self._client: pgque.Client | None = None

    def require_dsn(self) -> str:
        """The DSN, or a usage error naming both ways to give one."""
        if not self.dsn:
            raise click.UsageError("no database given: pass --dsn or set PGQUE_DSN",
                                   click.get_current_context(silent=True))
        return self.dsn

    def connect_kwargs(self) -> dict[str, Any]:
        """The psycopg.connect settings of the invocation's connections."""
        # libpq's own limit bounds each attempt at an unreachable host (it
        # rounds values below 2 up to 2).
        return {"connect_timeout": max(2, math.ceil(self.connect_timeout)),
                "application_name": "pgque-cli"}

    def client(self) -> pgque.Client:
        """The invocation's client, connected on first use (failing fast on a bad DSN)."""
        if self._client is None:
            self._client = pgque.connect(self.require_dsn(), timeout=self.connect_timeout,
                                         pool_size=0, **self.connect_kwargs())
        return self._client

    def close(self) -> None:
        """Close the connection, if one was opened; a dead one closes quietly."""
        client, self._client = self._client, None
        if client is not None:
            with suppress(psycopg.Error):
                client.close()


pass_state = click.make_pass_decorator(State, ensure=True)


def _set_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.ensure_object(State).dsn = value


def _set_connect_timeout(ctx: click.Context, param: click.Parameter, value: float) -> None:
    ctx.ensure_object(State).connect_timeout = value


def db_options(command: F, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> F:
    """Add ``--dsn`` and ``--connect-timeout`` (default ``connect_timeout``) to a
    command (stored in its State)."""
    command = click.option(
        "--connect-timeout", type=click.FloatRange(min=0), default=connect_timeout,
        show_default=True, expose_value=False, callback=_set_connect_timeout,
        help="Seconds to wait for the server before giving up.")(command)
    command = click.option(
        "--dsn", envvar="PGQUE_DSN", show_envvar=True, expose_value=False, callback=_set_dsn,
        help="PostgreSQL connection string.")(command)
    return command


# -- errors ---------------------------------------------------------------------------


def _fail(message: str, code: int, dsn: str | None = None) -> None:
    click.echo(f"error: {display.one_line(redact(message, dsn))}", err=True)
    sys.exit(code)


def _fail_with_traceback(exc: BaseException, dsn: str | None) -> None:
    """--debug: the traceback, with the DSN's password hidden wherever it shows."""
    text = "".join(traceback.format_exception(exc))
    click.echo(redact(text, dsn).rstrip("\n"), err=True)
    sys.exit(1)


# -- the command group ------------------------------------------------------------------


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(State).debug = True


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(pgque.__version__, "--version", prog_name="pgque",
                      message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug,
              help="Show tracebacks instead of one-line errors (or set PGQUE_DEBUG=1).")
def cli() -> None:
    """pgque: Kafka's partition model inside PostgreSQL."""


# -- install ------------------------------------------------------------------------------


@cli.command()
@click.option("--print", "print_script", is_flag=True,
              help="Write the install script to stdout instead of installing.")
@db_options
@pass_state
def install(state: State, print_script: bool) -> None:
    """Install or upgrade pgque in the database (idempotent)."""
    if print_script:
        click.echo(pgque.install_script())
        return
    client = state.client()
    # The server says what the install could not do (e.g. a role the installer
    # may not create, whose grants are skipped) only in notices: pass them on.
    client.conn.add_notice_handler(_echo_notice)
    try:
        with translated():
            before, granted = _install.install_report(client.conn)
        version = pgque.__version__
    finally:
        client.conn.remove_notice_handler(_echo_notice)
    if before is None:
        click.echo(f"pgque {version} installed")
        return
    # After a first install, a role granted pgque's privileges is one created
    # since (by a superuser, where the installer may not create roles; see 'The
    # three roles' in docs/operations.md) or whose grants were revoked. Over
    # the current version, that is all the install changed.
    grants = f"granted its privileges to {_and(granted)}, which had none" if granted else ""
    if before == version:
        click.echo(f"pgque {version} was installed already: "
                   + (f"only {grants}" if grants else "nothing changed"))
    else:
        click.echo(f"pgque upgraded from {before} to {version}"
                   + (f", and {grants}" if grants else ""))


def _and(names: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


# What CREATE ... IF NOT EXISTS says each time the idempotent script runs again:
# duplicate schema, duplicate table (relations, sequences, indexes), duplicate object,
# duplicate column (ADD COLUMN IF NOT EXISTS).
_RERUN_NOTICES = frozenset({"42P06", "42P07", "42710", "42701"})


def _echo_notice(diag: psycopg.errors.Diagnostic) -> None:
    """Print a server notice or warning to stderr as one line, 'notice: ...'."""
    if diag.sqlstate in _RERUN_NOTICES:
        return
    severity = (diag.severity_nonlocalized or diag.severity or "notice").lower()
    click.echo(f"{severity}: {display.one_line(diag.message_primary or '')}", err=True)


@cli.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@db_options
@pass_state
def uninstall(state: State, yes: bool) -> None:
    """Drop pgque with every queue, event and consumer in it (roles are kept)."""
    client = state.client()
    # The client has no "is it installed" call; ask the catalog.
    row = client.conn.execute("select to_regnamespace('pgque') is not null").fetchone()
    if not (row and row[0]):
        click.echo("pgque is not installed")
        return
    if not yes:
        click.confirm("Drop pgque with every queue and event in this database?", abort=True,
                      err=True)
    client.uninstall()
    click.echo("pgque uninstalled")


# -- queues -------------------------------------------------------------------------------


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | str | None:
    """A duration option: seconds as a float, or an interval literal such as
    '5 minutes' for the server to judge."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def _setting_value(text: str) -> float | str:
    """A --set value: a JSON number, else text (an interval literal, for the server to judge)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, str)) else text


def _show_config(config: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(display.dumps(config))
        return
    display.console().print(display.table(None, ["setting", "value"], sorted(config.items())))


@cli.group()
def queue() -> None:
    """Create, drop, list and configure queues."""


@queue.command("create")
@click.argument("name")
@click.option("--ticker-max-count", type=click.IntRange(min=1),
              help="Tick once this many events are pending.")
@click.option("--ticker-max-lag", callback=_duration, metavar="DURATION",
              help="Tick pending events at most this late (seconds or interval).")
@click.option("--ticker-idle-period", callback=_duration, metavar="DURATION",
              help="Tick an idle queue this often (seconds or interval).")
@click.option("--rotation-period", callback=_duration, metavar="DURATION",
              help="Switch event tables this often (seconds or interval).")
@click.option("--max-retries", type=click.IntRange(min=0),
              help="Retries before an event becomes a dead letter.")
@click.option("--event-tables", type=click.IntRange(min=2), help="Rotating event tables.")
@click.option("--exist-ok", is_flag=True, help="Succeed if the queue already exists.")
@db_options
@pass_state
def queue_create(state: State, /, name: str, exist_ok: bool,
                 **settings: float | str | None) -> None:
    """Create queue NAME."""
    config = {key: value for key, value in settings.items() if value is not None}
    queue_id = state.client().create_queue(name, exist_ok=exist_ok, **config)
    click.echo(f"queue {name} ready (id {queue_id})")


@queue.command("drop")
@click.argument("name")
@click.option("--force", is_flag=True, help="Drop even while consumers are subscribed.")
@db_options
@pass_state
def queue_drop(state: State, name: str, force: bool) -> None:
    """Drop queue NAME with all its events, retries and dead letters."""
    state.client().drop_queue(name, force=force)
    click.echo(f"queue {name} dropped")


@queue.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def queue_list(state: State, as_json: bool) -> None:
    """List the queues."""
    queues = state.client().queue_info()
    if as_json:
        click.echo(display.dumps(queues))
    else:
        display.console().print(display.queues_table(queues))


@queue.command("config")
@click.argument("name")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Change a setting (repeatable): "
                   f"{', '.join(k for k in QUEUE_SETTINGS if k != 'event_tables')} "
                   "(event_tables is fixed when the queue is created).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def queue_config(state: State, name: str, assignments: tuple[str, ...], as_json: bool) -> None:
    """Show (or with --set, change) the settings of queue NAME."""
    changes: dict[str, float | str] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, not {assignment!r}",
                                     param_hint="'--set'")
        changes[key.strip().replace("-", "_")] = _setting_value(text.strip())
    client = state.client()
    config = client.set_queue_config(name, **changes) if changes else client.queue_config(name)
    _show_config(config, as_json)


# -- send ---------------------------------------------------------------------------------


def _read_json_lines(stream: Iterable[bytes]) -> list[bytes]:
    """Every non-blank line, checked to be UTF-8 JSON; the first bad one fails them all."""
    lines: list[bytes] = []
    for number, raw in enumerate(stream, 1):
        line = raw.strip()
        if not line:
            continue
        try:
            line.decode("utf-8")
            msgspec.json.decode(line)
        except (UnicodeDecodeError, msgspec.DecodeError) as exc:
            raise click.ClickException(
                f"stdin line {number} is not valid JSON ({exc}); nothing was sent") from exc
        lines.append(line)
    return lines


@cli.command()
@click.argument("queue_name", metavar="QUEUE")
@click.argument("event_type", metavar="TYPE")
@click.argument("payload", required=False)
@click.option("--key", help="Partition key (events of one key are delivered in order).")
@click.option("--ids", "print_ids", is_flag=True,
              help="With stdin: print every event id, one a line, instead of a count.")
@click.option("--deliver-after", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Delay the events: they enter the log this many seconds from now "
                   "(the database's clock), at most 30 days.")
@click.option("--idempotency-key",
              help="With PAYLOAD: send only if this key was not sent to the queue within "
                   "its idempotency window; else print the first event's id.")
@db_options
@pass_state
def send(state: State, queue_name: str, event_type: str, payload: str | None, key: str | None,
         print_ids: bool, deliver_after: float | None, idempotency_key: str | None) -> None:
    """Send an event of TYPE with the JSON PAYLOAD; prints its id.

    Without PAYLOAD, reads JSON lines from stdin (one event each, blank lines
    skipped), checks them all, then sends them in one transaction: all or none.
    A delayed event's id is printed with the time it enters the log; a send of
    an idempotency key already sent says so on stderr.
    """
    if payload is not None:
        try:
            msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise click.BadParameter(f"not valid JSON ({exc})", param_hint="'PAYLOAD'") from exc
        client = state.client()
        sent = client.send(queue_name, event_type, payload.encode(), key,
                           deliver_after=deliver_after, idempotency_key=idempotency_key)
        click.echo(int(sent))
        if sent.duplicate:
            click.echo(f"duplicate: key {idempotency_key!r} was sent already; nothing written",
                       err=True)
        if sent.deliver_at is not None:
            click.echo(f"delayed: enters the log at {sent.deliver_at.isoformat()}", err=True)
        return
    if idempotency_key is not None:
        raise click.UsageError("--idempotency-key needs PAYLOAD (one event)")
    if sys.stdin.isatty():
        click.echo("reading JSON lines from stdin (Ctrl-D to end)", err=True)
    lines = _read_json_lines(sys.stdin.buffer)
    client = state.client()
    ids: list[int] = []
    with client.conn.transaction():
        for start in range(0, len(lines), SEND_CHUNK):
            chunk = lines[start:start + SEND_CHUNK]
            ids += client.send_batch(queue_name, [(event_type, line, key) for line in chunk],
                                     deliver_after=deliver_after)
    if print_ids:
        for event_id in ids:
            click.echo(event_id)
    else:
        click.echo(f"sent {len(ids)} event{'' if len(ids) == 1 else 's'} to {queue_name}")


# -- tail ---------------------------------------------------------------------------------


@cli.command()
@click.argument("queue_name", metavar="QUEUE")
@click.option("--key", help="Show only events of this partition key.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event and line.")
@click.option("--from-now", is_flag=True,
              help="Skip events sent before tail started that no tick has cut yet "
                   "(a role that may not tick waits for the next tick).")
@click.option("--limit", type=click.IntRange(min=1), help="Stop after this many events.")
@click.option("--poll-interval", type=click.FloatRange(min=0.01), default=0.2,
              show_default=True, help="Seconds between polls when nothing is ready.")
@db_options
@pass_state
def tail(state: State, queue_name: str, key: str | None, as_json: bool, from_now: bool,
         limit: int | None, poll_interval: float) -> None:
    """Follow the events of QUEUE as they arrive, until --limit, Ctrl-C or SIGTERM.

    Subscribes a temporary consumer (tail-<pid>-<random>) and unsubscribes it
    on the way out, also after an error, so it does not hold back rotation.
    Events need ticks: tail ticks the queue itself (within its thresholds) when
    its role may (pgque_admin); for a role that may not (pgque_reader) a ticker
    or a worker must run. A lost connection is retried until it comes back.
    """
    out = display.console()

    def show(message: pgque.Message[Any]) -> None:
        if as_json:
            click.echo(display.event_json(message))
        else:
            out.print(display.event_line(message))

    def say(text: str) -> None:
        click.echo(text, err=True)

    follower = Tail(state.require_dsn(), queue_name, show=show, say=say, key=key, limit=limit,
                    from_now=from_now, poll_interval=poll_interval,
                    connect_timeout=state.connect_timeout, connect_kwargs=state.connect_kwargs())
    try:
        follower.run()  # until --limit, SIGINT or SIGTERM; raises what cannot heal
    except ConsumerLeftBehind as exc:
        raise click.ClickException(str(exc)) from None


# -- worker and ticker --------------------------------------------------------------------


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _import_object(path: str, metavar: str, example: str, hint: str) -> Any:
    """Import ``module:name`` (the name may be a dotted attribute path); a
    click.BadParameter of parameter ``hint`` says what failed: the format, the
    import or a missing attribute."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise click.BadParameter(f"expected {metavar}, e.g. {example}, not {path!r}",
                                 param_hint=hint)
    # A console script's sys.path starts at its bin directory; handlers usually
    # live next to where the command is run, as with python -m.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise click.BadParameter(f"cannot import module {module_name!r}: no module named "
                                     f"{exc.name!r}", param_hint=hint) from exc
        raise click.BadParameter(f"importing module {module_name!r} failed: {exc}",
                                 param_hint=hint) from exc
    except Exception as exc:
        raise click.BadParameter(f"importing module {module_name!r} failed: "
                                 f"{type(exc).__name__}: {exc}", param_hint=hint) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise click.BadParameter(f"module {module_name!r} has no attribute {attribute!r}",
                                     param_hint=hint) from exc
    return target


def load_handler(path: str) -> Handler:
    """Import ``module:function`` (the function may be a dotted attribute path).

    Raises click.BadParameter saying what failed: the format, the import, a
    missing attribute or something that is not callable.
    """
    hint = "'MODULE:FUNCTION'"
    target = _import_object(path, "MODULE:FUNCTION", "myapp.handlers:handle", hint)
    if not callable(target):
        raise click.BadParameter(f"{path!r} is not callable (it is a {type(target).__name__})",
                                 param_hint=hint)
    handler: Handler = target
    return handler


def load_payload_type(path: str) -> Any:
    """Import ``module:type``, a type payloads can be decoded into (see
    :mod:`pgque.codec`); click.BadParameter otherwise."""
    hint = "'--payload-type'"
    target = _import_object(path, "MODULE:TYPE", "myapp.events:Order", hint)
    try:
        msgspec.json.Decoder(target)
    except TypeError as exc:  # what msgspec raises for a type it cannot decode into
        raise click.BadParameter(f"{path!r} is not a payload type: {exc}",
                                 param_hint=hint) from exc
    return target


def load_exception_class(path: str) -> type[BaseException]:
    """Import ``module:Class``, an exception class (for ``--non-retryable``);
    click.BadParameter otherwise."""
    hint = "'--non-retryable'"
    target = _import_object(path, "MODULE:CLASS", "myapp.errors:BadPayload", hint)
    if not (isinstance(target, type) and issubclass(target, BaseException)):
        raise click.BadParameter(f"{path!r} is not an exception class", param_hint=hint)
    return target


#: The Worker's parameters that have defaults, with them: the worker command's
#: options default to these, so that it runs as the library does.
_WORKER_DEFAULTS: dict[str, Any] = {
    name: param.default for name, param in inspect.signature(pgque.Worker).parameters.items()
    if param.default is not inspect.Parameter.empty}


def _worker_db_options(command: F) -> F:
    # A worker waits for the server as long as the library's does (a service
    # may well start before its database), not an interactive command's 5 s.
    return db_options(command, connect_timeout=_WORKER_DEFAULTS["connect_timeout"])


def _seconds(name: str, text: str, minimum: float = 0, min_open: bool = True) -> Callable[[F], F]:
    """A worker option in seconds, defaulting to the library's parameter ``name``."""
    return click.option(f"--{name.replace('_', '-')}", name, metavar="SECONDS",
                        type=click.FloatRange(min=minimum, min_open=min_open),
                        default=_WORKER_DEFAULTS[name], show_default=True, help=text)


@cli.command()
@click.argument("handler_path", metavar="MODULE:FUNCTION")
@click.option("--queue", "queue_name", required=True, help="Queue to consume.")
@click.option("--consumer", required=True, help="Consumer group name.")
@click.option("--slots", type=click.IntRange(min=1), required=True,
              help="Slots of the group (fixed once the group exists).")
@click.option("--transactional", is_flag=True,
              help="Call FUNCTION(message, conn) inside the transaction that acks: what it "
                   "writes on conn commits with the ack, exactly once.")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Lanes, each a session taking its slots in turns: that many slots "
                   "handled at the same time [default: one session handling every slot "
                   "at once; with --transactional, a lane per slot].")
@click.option("--key-concurrency", type=click.IntRange(min=1),
              default=_WORKER_DEFAULTS["key_concurrency"], show_default=True,
              help="Events of different keys of a slot's batch handled at the same time "
                   "(never two of one key; not with --transactional).")
@click.option("--payload-type", "payload_path", metavar="MODULE:TYPE",
              help="Decode payloads into this type (a msgspec Struct, a dataclass...) "
                   "[default: any JSON].")
@click.option("--max-events", type=click.IntRange(min=1), default=_WORKER_DEFAULTS["max_events"],
              show_default=True, help="Events per receive of a slot.")
@_seconds("retry_after", "Wait before a failed event comes back.", min_open=False)
@click.option("--non-retryable", "non_retryable_paths", metavar="MODULE:CLASS", multiple=True,
              help="Failures of this exception class are not retried: the event goes to the "
                   "dead letters at once (repeatable; pgque.NonRetryable always is).")
@click.option("--failure-policy", type=click.Choice(["skip", "pause"]),
              help="Set the group's failure policy: skip (a failed event is retried later, "
                   "its key goes on) or pause (its key waits for it) [default: the group's].")
@_seconds("poll_interval", "Poll an idle slot this often (the fallback for a lost "
                           "tick notification) [default: 1 while listening, 0.2 without].")
@_seconds("rebalance_interval", "Check the worker's fair share of slots this often.")
@click.option("--ticker/--no-ticker", "run_ticker", default=_WORKER_DEFAULTS["ticker"],
              show_default=True,
              help="Also run a ticker (standing by while another one is active).")
@click.option("--listen/--no-listen", default=_WORKER_DEFAULTS["listen"],
              help="Wake on tick notifications (LISTEN), not only by polling [default: "
                   "listen with --ownership advisory; by lease, which LISTEN cannot serve, "
                   "poll].")
@click.option("--ownership", type=click.Choice(["advisory", "lease"]),
              default=_WORKER_DEFAULTS["ownership"], show_default=True,
              help="How the group's slots are owned: session advisory locks, or leases "
                   "renewed by the worker (behind a transaction-mode pooler such as "
                   "PgBouncer). One mode a group at a time.")
@click.option("--lease", type=click.FloatRange(min=1, max=3600), metavar="SECONDS",
              default=_WORKER_DEFAULTS["lease"], show_default=True,
              help="With --ownership lease: the group's lease time, how long a crashed "
                   "worker's slots wait for a new owner.")
@_seconds("network_timeout", "Keep the slots this long at most once the network went "
                             "silent (at least 2).", minimum=2, min_open=False)
@click.option("--name", help="Name in logs, threads and session names "
                             "[default: pgque-worker-QUEUE-CONSUMER].")
@click.option("--record", is_flag=True,
              help="Record every handler call (event, slot, epoch, start, end, outcome) "
                   "for `pgque verify`: one more statement per ack.")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535),
              help="Serve the worker's metrics for Prometheus on this port "
                   "(needs pgque[prometheus]).")
@click.option("--metrics-host", default=_WORKER_DEFAULTS["metrics_host"], show_default=True,
              help="The address --metrics-port listens on (0.0.0.0: every interface).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              default="info", show_default=True)
@_worker_db_options
@pass_state
def worker(state: State, /, handler_path: str, queue_name: str, consumer: str, slots: int,
           run_ticker: bool, payload_path: str | None, log_level: str,
           non_retryable_paths: tuple[str, ...], **options: Any) -> None:
    """Run a worker of consumer group --consumer that calls MODULE:FUNCTION with each
    message, until SIGTERM or Ctrl-C (it finishes its batches and releases its slots).

    An async function (async def) runs under an AsyncWorker, awaited on one event
    loop; a plain one under a Worker, on threads. A worker that stops for good (a
    dropped queue, a missing privilege, a server it never reached) ends the
    command with its error and exit code 1.
    """
    handler = load_handler(handler_path)
    payload_type = None if payload_path is None else load_payload_type(payload_path)
    non_retryable = tuple(load_exception_class(path) for path in non_retryable_paths)
    dsn = state.require_dsn()
    # The library's own test for an async handler, so the choice is always one
    # the chosen class accepts (each refuses the other kind).
    worker_class = pgque.AsyncWorker if _is_coroutine_function(handler) else pgque.Worker
    try:
        # The other options are named as the Worker's parameters.
        service = worker_class(dsn, queue=queue_name, consumer=consumer, slots=slots,
                               handler=handler, payload_type=payload_type, ticker=run_ticker,
                               connect_timeout=state.connect_timeout,
                               non_retryable=non_retryable,
                               # The global one: a handler's module may set it up on import.
                               meter_provider=None, **options)
    except ValueError as exc:  # the library's word on the options, e.g. two that conflict
        raise click.UsageError(str(exc), click.get_current_context()) from None
    except ImportError as exc:  # --metrics-port without prometheus-client
        raise click.UsageError(str(exc), click.get_current_context()) from None
    # Check the DSN, the queue and the slot count before logging starts, so a
    # mistake is one line; the worker stops on such errors by itself too (run()
    # raises them) but only after its log lines. Subscribing is idempotent.
    state.client().subscribe_slots(queue_name, consumer, slots=slots)
    state.close()
    _setup_logging(log_level)
    # Runs until SIGTERM or Ctrl-C; raises what cannot heal (a pooler, a
    # dropped queue), which main() reports as one line with a non-zero exit.
    if isinstance(service, pgque.AsyncWorker):
        logging.getLogger("pgque.cli").info("%s is an async function: running an AsyncWorker",
                                            handler_path)
        asyncio.run(service.run())
    else:
        service.run()


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8765, show_default=True)
@click.option("--read-only", is_flag=True,
              help="Show, never act: no replay, purge or tail, whatever the role may do.")
@click.option("--allowed-host", "hosts", multiple=True, metavar="NAME",
              help="A host name the pages answer to besides the loopback's and --host "
                   "(repeatable; '*': any). Needed behind a proxy or with --host 0.0.0.0.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              metavar="SECONDS", help="How often the figures are read (one query each time).")
@db_options
@pass_state
def dashboard(state: State, host: str, port: int, read_only: bool, interval: float,
              hosts: tuple[str, ...]) -> None:
    """Serve a web dashboard of the queues, groups, slots, lag and dead letters.

    It acts as the DSN's role: pgque's access rules decide what it shows and
    what it may do. Needs the dashboard extra: pip install 'pgque[dashboard]'.
    """
    try:
        from pgque import dashboard as web
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs pgque[dashboard] (pip install 'pgque[dashboard]'): {exc}"
        ) from None
    dsn = state.require_dsn()
    try:  # fail fast: reachable, pgque installed, a role that may read its figures
        state.client().conn.execute("select count(*) from pgque.metrics()")
    except psycopg.errors.InsufficientPrivilege as exc:
        raise click.ClickException(f"{str(exc).strip().splitlines()[0]}: the dashboard's "
                                   "role needs pgque_reader (or pgque_admin)") from None
    state.close()
    _setup_logging("info")
    logging.getLogger("pgque.cli").info("dashboard on http://%s:%s/%s", host, port,
                                        " (read-only)" if read_only else "")
    web.serve(dsn, host=host, port=port, read_only=read_only, interval=interval, hosts=hosts)


#: The Ticker's parameters that have defaults, with them: the ticker command's
#: options default to these, so that it runs as the library's does.
_TICKER_DEFAULTS: dict[str, Any] = {
    name: param.default for name, param in inspect.signature(pgque.Ticker).parameters.items()
    if param.default is not inspect.Parameter.empty}


def _ticker_seconds(name: str, text: str, minimum: float = 0) -> Callable[[F], F]:
    """A ticker option in seconds, defaulting to the library's parameter ``name``."""
    return click.option(f"--{name.replace('_', '-')}", name, metavar="SECONDS",
                        type=click.FloatRange(min=minimum, min_open=minimum == 0),
                        default=_TICKER_DEFAULTS[name], show_default=True, help=text)


@cli.command()
@_ticker_seconds("min_interval", "Shortest time between two ticks of a queue.")
@_ticker_seconds("idle_interval", "Poll interval while asleep (sends wake it).")
@_ticker_seconds("idle_after", "Fall asleep after this long without a tick.")
@_ticker_seconds("standby_interval", "How often a standby checks the active ticker.")
@_ticker_seconds("overdue_after", "A standby ticks a queue whose tick is this late.")
@_ticker_seconds("maintenance_interval", "Run maintenance this often.")
@_ticker_seconds("network_timeout", "Give up a session whose network went silent this long.",
                 minimum=2)
@click.option("--name", default=_TICKER_DEFAULTS["name"], show_default=True,
              help="The ticker's name, in logs and as its sessions' application_name.")
@click.option("--ownership", type=click.Choice(["advisory", "lease"]),
              default=_TICKER_DEFAULTS["ownership"], show_default=True,
              help="How the election is held: a session advisory lock, or a lease (behind "
                   "a transaction-mode pooler).")
@click.option("--lease", type=click.FloatRange(min=1, max=3600), metavar="SECONDS",
              default=_TICKER_DEFAULTS["lease"], show_default=True,
              help="With --ownership lease: how long the active ticker's lease lasts "
                   "unrenewed.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              default="info", show_default=True)
@_worker_db_options  # a ticker too waits for its server as long as the library's does
@pass_state
def ticker(state: State, min_interval: float, idle_interval: float, idle_after: float,
           standby_interval: float, overdue_after: float, maintenance_interval: float,
           network_timeout: float, name: str, ownership: str, lease: float,
           log_level: str) -> None:
    """Keep every queue ticking (and maintained) until SIGTERM or Ctrl-C.

    Any number may run: one is active, the others stand by and take over.
    """
    dsn = state.require_dsn()
    state.client().queue_info()  # fail fast: reachable, and pgque installed
    state.close()
    _setup_logging(log_level)
    runner = pgque.Ticker(dsn, min_interval=min_interval, idle_interval=idle_interval,
                          idle_after=idle_after, standby_interval=standby_interval,
                          overdue_after=overdue_after,
                          maintenance_interval=maintenance_interval,
                          meter_provider=None,  # the global one
                          connect_timeout=state.connect_timeout,
                          network_timeout=network_timeout, name=name, ownership=ownership,
                          lease=lease)
    try:
        runner.run()  # until SIGTERM or Ctrl-C; raises what cannot heal
    finally:
        logging.getLogger("pgque.ticker").info("stopped after %s ticks", runner.ticks)


# -- status -------------------------------------------------------------------------------


class _Status(NamedTuple):
    """What ``pgque status`` shows: all the caller may see, and only that."""

    ticker: pgque.TickerInfo
    queues: list[pgque.QueueInfo]
    consumers: list[pgque.ConsumerInfo]
    groups: list[pgque.GroupInfo]
    slots: list[pgque.SlotStatus]
    generated: list[pgque.GeneratedCode]
    # With --keys: each group's keys with the most events waiting (key_lag).
    keys: list[dict[str, Any]] | None = None


def _status(client: pgque.Client, queue_name: str | None,
            stalled_after: float | str | None, keys: int | None = None) -> _Status:
    queues = client.queue_info(queue_name, stalled_after=stalled_after)
    if queue_name is not None and not queues:
        raise pgque.QueueNotFound(f"queue {queue_name!r} does not exist")
    groups = client.group_info(queue_name)
    hot = None if keys is None else [
        {"queue_name": g.queue_name, "consumer_name": g.consumer_name,
         **msgspec.structs.asdict(lag)}
        for g in groups for lag in client.key_lag(g.queue_name, g.consumer_name, top=keys)]
    return _Status(client.ticker_info(), queues, client.consumer_info(queue_name), groups,
                   client.partition_slot_status(queue_name, stalled_after=stalled_after),
                   [g for g in client.generated_code()
                    if queue_name is None or g.queue_name in (None, queue_name)], hot)


@cli.command()
@click.argument("queue_name", metavar="[QUEUE]", required=False)
@click.option("--stalled-after", callback=_duration, metavar="DURATION",
              help="Call a queue or slot stalled once events have waited this long "
                   "(seconds or interval) [default: each queue's own, twice its "
                   "ticker_idle_period and at least 10 seconds].")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON document (with --watch: one per line and refresh).")
@click.option("--watch", type=click.FloatRange(min=0.1), metavar="SECONDS",
              help="Refresh every SECONDS until Ctrl-C.")
@click.option("--keys", type=click.IntRange(1, 1000), metavar="N",
              help="Also list each group's N keys with the most events waiting (the hot "
                   "keys; one read of the group's pending events).")
@db_options
@pass_state
def status(state: State, queue_name: str | None, stalled_after: float | str | None,
           as_json: bool, watch: float | None, keys: int | None) -> None:
    """What the queues, consumers and consumer groups you may use are doing.

    A summary (counts, and the active ticker), then queues (STALLED: events
    wait for a tick that nobody makes), plain consumers, consumer groups
    (members, owned slots, newest epoch) and their slots (owner by the
    application name its session set, epoch, pending events, oldest unconsumed
    age; STALLED: an event waits and nobody owns or moves the slot). The
    summary counts the generated code that lags behind the queues and groups
    (slower, never wrong, until the Ticker's maintenance writes it again).
    """
    client = state.client()

    def look() -> _Status:
        return _status(client, queue_name, stalled_after, keys)

    def document() -> dict[str, Any]:
        found = look()._asdict()
        if found["keys"] is None:
            del found["keys"]  # (asked for with --keys only)
        return found

    if watch is None:
        if as_json:
            click.echo(display.dumps(document()))
        else:
            display.console().print(display.status_view(*look()))
        return
    try:
        if as_json:
            while True:
                click.echo(display.dumps(document(), indent=None))
                time.sleep(watch)
        with Live(display.status_view(*look()), console=display.console(),
                  auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(display.status_view(*look()), refresh=True)
    except KeyboardInterrupt:  # the way to leave --watch
        return


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 time, such as "
                                 "2026-12-06T10:00:00+00:00") from None
    return moment if moment.tzinfo is not None else moment.astimezone()  # local time


@cli.command()
@click.option("--queue", "queue_name", required=True, help="Queue of the group.")
@click.option("--group", "consumer", required=True, help="Consumer group whose record to check.")
@click.option("--since", callback=_since, metavar="TIME",
              help="Check the calls and events from this ISO 8601 time on (no zone: local "
                   "time), if it is later than when the group's recording began.")
@click.option("--clock-skew", type=click.FloatRange(min=0), default=0.0, show_default=True,
              metavar="SECONDS",
              help="How far the clocks of the group's workers may differ: overlaps shorter "
                   "than this, and first calls closer than this, are not judged.")
@click.option("--strict", is_flag=True,
              help="Count zombie windows (the previous owner's call still running when its "
                   "slot moved) and calls while their key was paused (which an operator's "
                   "resume_key or skip_head allows) as violations too.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@db_options
@pass_state
def verify(state: State, queue_name: str, consumer: str, since: datetime | None,
           clock_skew: float, strict: bool, as_json: bool) -> None:
    """Check a consumer group's record of handler calls against pgque's promises.

    The group's workers must run with record=True (pgque worker --record). The
    check: every call in the slot its key routes to; each key's events first
    handled in delivery order (and, under the pause policy, nothing of a key
    handled while it waits for a failed event); no two calls of one key at
    once; every event the slots have passed handled, dead-lettered or still to
    be retried. Prints what it checked and each violation with the events
    involved; exits 1 when there is one, 0 otherwise.
    """
    result = state.client().verify(queue_name, consumer, since=since, clock_skew=clock_skew)
    violations = result.findings if strict else result.violations
    summary = result.summary
    if as_json:
        click.echo(display.dumps({"summary": msgspec.structs.asdict(summary),
                                  "findings": [msgspec.structs.asdict(f)
                                               for f in result.findings],
                                  "violations": len(violations)}))
    else:
        click.echo(f"{queue_name}/{consumer}: {summary.calls} handler calls of "
                   f"{summary.events} events ({summary.keys} keys, {summary.workers} workers) "
                   f"since {summary.since.isoformat()}")
        for finding in result.findings:
            label = "VIOLATION" if strict or finding.violation else "note"
            click.echo(f"  {label} {finding.kind}: event {finding.ev_id} (key "
                       f"{finding.partition_key!r}, slot {finding.slot}) at "
                       f"{finding.at.isoformat()}: {finding.detail}")
        click.echo(f"{len(violations)} violation{'' if len(violations) == 1 else 's'}"
                   + ("" if violations else ": per-key order, one handler per key at a time "
                                            "and no loss held"))
    if violations:
        sys.exit(1)


@cli.command()
@click.option("--queue", "queue_name", required=True, help="Queue of the group.")
@click.option("--group", "consumer", required=True, help="Consumer group whose spread to show.")
@click.option("--window", callback=_duration, default="60", show_default=True,
              metavar="DURATION",
              help="Count the events sent this long ago and since (seconds or interval); "
                   "no further back than the queue's oldest tick, kept a minute or more.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@db_options
@pass_state
def skew(state: State, queue_name: str, consumer: str, window: float | str,
         as_json: bool) -> None:
    """How evenly a consumer group's work spreads over its slots.

    Per slot: the events sent in the window that route to it, the distinct
    keys among them, its share of the events and its load (its events over
    the mean per slot: 1 is an even share). The summary's largest load is the
    max/mean ratio: a slot at 3x does three slots' work while others idle,
    from few keys (more keys, or a larger N, spread better) or from a hot key
    (see 'pgque status --keys'). One read of the window's events.
    """
    from datetime import timedelta

    interval = timedelta(seconds=window) if isinstance(window, float) else window
    conn = state.client().conn
    with translated():
        rows = conn.execute("select slot, events, keys, share, load, since"
                            "  from pgque.slot_skew(%s, %s, %s::interval)",
                            (queue_name, consumer, interval)).fetchall()
    events = sum(row[1] for row in rows)
    keys = sum(row[2] for row in rows)
    since: datetime = rows[0][5]
    busiest = max(rows, key=lambda row: (row[4] or 0, -row[0]))
    largest = busiest[4]
    idle = sum(1 for row in rows if row[1] == 0)
    if as_json:
        click.echo(display.dumps({
            "queue_name": queue_name, "consumer_name": consumer, "since": since,
            "events": events, "keys": keys, "max_over_mean": largest,
            "busiest_slot": busiest[0] if largest is not None else None,
            "slots_without_events": idle,
            "slots": [{"slot": slot, "events": n, "keys": k, "share": share, "load": load}
                      for slot, n, k, share, load, _ in rows]}))
        return
    click.echo(f"{queue_name}/{consumer}: {events} events of {keys} keys in {len(rows)} slots "
               f"since {since.astimezone().isoformat(sep=' ', timespec='seconds')}")
    display.console().print(display.table(
        None, ["slot", "events", "keys", "share", "load"],
        ([slot, n, k, "-" if share is None else f"{share:.1%}",
          "-" if load is None else f"{load:.2f}"] for slot, n, k, share, load, _ in rows)))
    if largest is None:
        click.echo("no events in the window: nothing to judge")
    else:
        click.echo(f"largest load {largest:.2f}x the mean (slot {busiest[0]}); "
                   f"{idle} slot{'' if idle == 1 else 's'} without events")


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9187, show_default=True,
              help="Port of http://HOST:PORT/metrics (0: a free one, printed at start).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: the metrics name "
                   "queues and groups, so only where the network is trusted).")
@click.option("--statement-timeout", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True, metavar="SECONDS", help="Bound of a scrape's query.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              default="info", show_default=True)
@db_options
@pass_state
def exporter(state: State, port: int, host: str, statement_timeout: float,
             log_level: str) -> None:
    """Serve pgque's database-side metrics to Prometheus until SIGTERM or Ctrl-C.

    Each scrape of http://HOST:PORT/metrics runs one query, pgque.metrics():
    events sent per queue, and per slot of every group its backlog, lag,
    ticks behind, owner, epoch, retries, dead letters and blocked keys, plus
    rotation, table sizes, the ticker and stall flags, of every queue and
    group the DSN's role may see (give it pgque_reader, or pgque_admin for
    all). Needs the prometheus extra: pip install 'pgque[prometheus]'.
    """
    import threading

    from pgque import _signals

    try:
        from pgque.exporter import Exporter, ProblemWithDatabase
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "prometheus_client":
            raise
        raise click.ClickException("pgque exporter needs prometheus-client, which the "
                                   "prometheus extra installs: pip install "
                                   "'pgque[prometheus]'") from None
    service = Exporter(state.require_dsn(), host=host, port=port,
                       connect_timeout=state.connect_timeout,
                       statement_timeout=statement_timeout)
    down: pgque.ConnectError | None = None
    try:
        service.check()  # fail fast where no scrape could succeed
    except ProblemWithDatabase as exc:
        raise click.ClickException(str(exc)) from exc
    except pgque.ConnectError as exc:
        if not exc.transient:
            raise
        down = exc  # a server down now may be up at the next scrape: pgque_up says
    _setup_logging(log_level)
    if down is not None:
        logging.getLogger("pgque.exporter").warning("%s; serving pgque_up 0 until it answers",
                                                    down)

    class _Stop:
        """Set by SIGTERM or SIGINT (see pgque._signals)."""

        def __init__(self) -> None:
            self.event = threading.Event()

        def _on_signal(self, signum: int) -> None:
            self.event.set()

    stop = _Stop()
    _signals.register(stop)
    try:
        with service:
            click.echo(f"pgque exporter: serving {service.url}", err=True)
            while not stop.event.wait(1):
                pass
    finally:
        _signals.unregister(stop)


# -- dead letters ------------------------------------------------------------------------


def _letter_dict(letter: pgque.DeadLetter) -> dict[str, Any]:
    document: dict[str, Any] = msgspec.structs.asdict(letter)
    document["payload"] = display.payload(document.pop("data"))
    return document


@contextmanager
def _dead_letter_refusal(state: State, action: str, queue_name: str) -> Iterator[None]:
    """Say what a role that may not call the dead-letter functions at all lacks.

    The engine's own refusals (PQ014 for the consumer, PQ015 for the queue's
    grants) name it already; a role without pgque's privileges gets only
    PostgreSQL's "permission denied" (42501), which does not.
    """
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        if state.debug:
            raise  # the traceback, as --debug promises
        raise click.ClickException(
            f"role {_session_role(state)} may not {action} dead letters of queue "
            f"{queue_name!r}: it needs to be in pgque_reader and own the consumer or be "
            "granted it (pgque.grant_consumer), or be in pgque_admin") from exc


def _session_role(state: State) -> str:
    """The role the session acts as (as pgque judges it), or the login when the
    session cannot say."""
    client = state.client()
    with suppress(psycopg.Error):
        row = client.conn.execute("select current_user").fetchone()
        if row is not None:
            return str(row[0])
    return client.conn.info.user


@cli.group()
def dlq() -> None:
    """Inspect, replay and purge dead letters."""


@dlq.command("list")
@click.argument("queue_name", metavar="QUEUE")
@click.option("--consumer", help="Only this consumer's.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def dlq_list(state: State, queue_name: str, consumer: str | None, limit: int,
             as_json: bool) -> None:
    """List the dead letters of QUEUE, oldest first."""
    with _dead_letter_refusal(state, "list", queue_name):
        letters = state.client().dead_letters(queue_name, consumer, limit=limit)
    if as_json:
        click.echo(display.dumps([_letter_dict(letter) for letter in letters]))
        return
    display.console().print(display.table(
        None, ["id", "consumer", "failed at", "event", "type", "key", "retries", "reason"],
        ([d.id, d.consumer, d.failed_at, d.event_id, d.type, d.partition_key, d.retry_count,
          d.reason] for d in letters)))


@dlq.command("show")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("letter_id", metavar="ID", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def dlq_show(state: State, queue_name: str, letter_id: int, as_json: bool) -> None:
    """Show dead letter ID of QUEUE with its payload."""
    # No get-one call in the client: the first letter after ID - 1 is ID if it exists.
    with _dead_letter_refusal(state, "show", queue_name):
        found = state.client().dead_letters(queue_name, limit=1, after_id=letter_id - 1)
    if not found or found[0].id != letter_id:
        # The listing holds only what this role may use: say so, since another
        # team's dead letter is there, just not this role's to see.
        raise pgque.DeadLetterNotFound(f"queue {queue_name!r} has no dead letter {letter_id}"
                                       " that this role may see")
    document = _letter_dict(found[0])
    if as_json:
        click.echo(display.dumps(document))
        return
    payload = document.pop("payload")
    console = display.console()
    console.print(display.table(None, ["field", "value"], document.items()))
    console.print(JSON(display.dumps(payload)))


def _dead_letter_filters(function: F) -> F:
    """The options that choose dead letters by what they are, for replay and purge."""
    for option in reversed([
            click.option("--consumer", help="Only this consumer's (or consumer group's)."),
            click.option("--type", "event_type", help="Only events of this type."),
            click.option("--key", help="Only events of this partition key."),
            click.option("--older-than", type=click.FloatRange(min=0), metavar="SECONDS",
                         help="Only those dead-lettered more than SECONDS ago."),
            click.option("--reason", help="Only those whose reason contains this text."),
            click.option("--dry-run", is_flag=True, help="Only count them.")]):
        function = option(function)
    return function


@dlq.command("replay")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("letter_ids", metavar="[ID...]", type=int, nargs=-1)
@click.option("--all", "all_matching", is_flag=True,
              help="Every dead letter the filters below match (instead of IDs).")
@_dead_letter_filters
@click.option("--as-next", is_flag=True,
              help="Each as the next event of its key in its slot (consumer groups), before "
                   "the key's events not handed out yet, instead of after everything since.")
@db_options
@pass_state
def dlq_replay(state: State, queue_name: str, letter_ids: tuple[int, ...], all_matching: bool,
               consumer: str | None, event_type: str | None, key: str | None,
               older_than: float | None, reason: str | None, dry_run: bool,
               as_next: bool) -> None:
    """Put dead letters back into the log for their consumers (all or none): the IDs
    given, or with --all every one the filters match."""
    client = state.client()
    filtered = any(v is not None for v in (consumer, event_type, key, older_than, reason))
    if bool(letter_ids) == all_matching:
        raise click.UsageError("give dead letter IDs, or --all (with filters)")
    if letter_ids and (filtered or dry_run):
        raise click.UsageError("the filters and --dry-run go with --all, not with IDs")
    if all_matching:
        with _dead_letter_refusal(state, "replay", queue_name):
            count = client.replay_dead_letters(
                queue_name, consumer, type=event_type, key=key, older_than=older_than,
                reason=reason, as_next=as_next, dry_run=dry_run)
        click.echo(f"{'would replay' if dry_run else 'replayed'} {count} dead "
                   f"letter{'' if count == 1 else 's'}")
        return
    replayed: list[tuple[int, int]] = []
    with _dead_letter_refusal(state, "replay", queue_name), client.conn.transaction():
        for letter_id in letter_ids:
            replayed.append((letter_id, client.replay_dead_letter(queue_name, letter_id,
                                                                  as_next=as_next)))
    for letter_id, event_id in replayed:
        where = " as its key's next event" if as_next else ""
        click.echo(f"dead letter {letter_id} replayed as event {event_id}{where}")


@dlq.command("purge")
@click.argument("queue_name", metavar="QUEUE")
@click.option("--id", "letter_ids", type=int, multiple=True, help="Only these (repeatable).")
@_dead_letter_filters
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@db_options
@pass_state
def dlq_purge(state: State, queue_name: str, letter_ids: tuple[int, ...],
              consumer: str | None, event_type: str | None, key: str | None,
              older_than: float | None, reason: str | None, dry_run: bool, yes: bool) -> None:
    """Delete dead letters of QUEUE: the given ids, or all that the filters match."""
    client = state.client()
    filtered = any(v is not None for v in (event_type, key, older_than, reason))
    if letter_ids and (filtered or dry_run):
        raise click.UsageError("the filters and --dry-run do not go with --id")
    if filtered or dry_run:
        if not dry_run and not yes:
            with _dead_letter_refusal(state, "purge", queue_name):
                count = client.purge_dead_letters_where(
                    queue_name, consumer, type=event_type, key=key, older_than=older_than,
                    reason=reason, dry_run=True)
            click.confirm(f"Delete {count} dead letter(s) of queue {queue_name}?", abort=True,
                          err=True)
        with _dead_letter_refusal(state, "purge", queue_name):
            count = client.purge_dead_letters_where(
                queue_name, consumer, type=event_type, key=key, older_than=older_than,
                reason=reason, dry_run=dry_run)
        click.echo(f"{'would purge' if dry_run else 'purged'} {count} dead "
                   f"letter{'' if count == 1 else 's'}")
        return
    if not yes:
        # A team's purge deletes only the dead letters of its own consumers.
        what = (f"{len(letter_ids)} dead letter(s)" if letter_ids
                else "all dead letters this role may purge")
        whose = f" of consumer {consumer}" if consumer else ""
        click.confirm(f"Delete {what}{whose} of queue {queue_name}?", abort=True, err=True)
    with _dead_letter_refusal(state, "purge", queue_name):
        count = client.purge_dead_letters(queue_name, consumer, list(letter_ids) or None)
    click.echo(f"purged {count} dead letter{'' if count == 1 else 's'}")


# -- blocked keys (the pause policy) -----------------------------------------------------


def _blocked_dict(key: pgque.BlockedKey) -> dict[str, Any]:
    document: dict[str, Any] = msgspec.structs.asdict(key)
    document["payload"] = display.payload(document.pop("data"))
    return document


@cli.group()
def blocked() -> None:
    """Keys that failed events block under the pause policy: list, show, retry, skip."""


@blocked.command("list")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("group")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def blocked_list(state: State, queue_name: str, group: str, as_json: bool) -> None:
    """List the blocked keys of consumer group GROUP of QUEUE, by slot and key."""
    keys = state.client().blocked_keys(queue_name, group)
    if as_json:
        click.echo(display.dumps([_blocked_dict(key) for key in keys]))
        return
    display.console().print(display.table(
        None, ["slot", "key", "head", "attempts", "blocked since", "retry at", "held",
               "last error"],
        ([k.slot, k.key, k.event_id, k.attempts, k.blocked_since, k.retry_at, k.held_behind,
          k.last_error] for k in keys)))


@blocked.command("show")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("group")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@db_options
@pass_state
def blocked_show(state: State, queue_name: str, group: str, key: str, as_json: bool) -> None:
    """Show blocked key KEY of GROUP with its head event's payload and errors."""
    found = [k for k in state.client().blocked_keys(queue_name, group) if k.key == key]
    if not found:
        raise pgque.KeyNotBlocked(f"key {key!r} is not blocked in consumer group {group!r}"
                                  f" of queue {queue_name!r}")
    document = _blocked_dict(found[0])
    if as_json:
        click.echo(display.dumps(document))
        return
    payload = document.pop("payload")
    console = display.console()
    console.print(display.table(None, ["field", "value"], document.items()))
    console.print(JSON(display.dumps(payload)))


@blocked.command("retry")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("group")
@click.argument("key")
@db_options
@pass_state
def blocked_retry(state: State, queue_name: str, group: str, key: str) -> None:
    """Hand KEY's head out again now, without waiting for its retry time."""
    state.client().retry_head(queue_name, group, key)
    click.echo(f"key {key}: its head is due now")


@blocked.command("skip")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("group")
@click.argument("key")
@click.option("--reason", help="The dead letter's reason (default: the head's last error).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@db_options
@pass_state
def blocked_skip(state: State, queue_name: str, group: str, key: str, reason: str | None,
                 yes: bool) -> None:
    """Send KEY's head to the dead letters and let the key go on."""
    if not yes:
        click.confirm(f"Dead-letter the head of key {key} in group {group} of queue "
                      f"{queue_name} and let the key go on?", abort=True, err=True)
    event_id = state.client().skip_head(queue_name, group, key, reason)
    click.echo(f"key {key}: event {event_id} dead-lettered, the key goes on")


@blocked.command("resume")
@click.argument("queue_name", metavar="QUEUE")
@click.argument("group")
@click.argument("key")
@db_options
@pass_state
def blocked_resume(state: State, queue_name: str, group: str, key: str) -> None:
    """Let KEY go on now; its head goes to the retry queue, as under skip."""
    event_id = state.client().resume_key(queue_name, group, key)
    click.echo(f"key {key}: event {event_id} goes to the retry queue, the key goes on")


# -- demo and bench ----------------------------------------------------------------------


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--dsn", help="Run on this server instead of a throwaway embedded one (not "
                            "read from PGQUE_DSN: a workload runs only where it is named).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(dsn: str | None, args: tuple[str, ...]) -> None:
    """Run the demo workload, on a throwaway embedded PostgreSQL unless --dsn.

    Further ARGS go to the demo ('python -m pgque.demo --help' lists them).
    """
    from pgque import demo as demo_module

    sys.exit(demo_module.main([*(["--dsn", dsn] if dsn else []), *args]))


def _bench_dirs() -> Iterator[Path]:
    """Where the bench package may be: the current directory, or the source
    checkout this pgque is installed from (editable installs)."""
    yield Path.cwd()
    yield Path(pgque.__file__).resolve().parent.parent


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
             add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run the benchmarks (python -m bench ARGS; 'pgque bench --help' for theirs).

    They live in bench/ of a source checkout, not in the installed package.
    """
    root = next((d for d in _bench_dirs() if (d / "bench" / "__main__.py").is_file()), None)
    if root is None:
        raise click.ClickException(
            "the benchmarks are not installed: 'pgque bench' runs bench/ of a pgque source "
            "checkout; run it from the repository")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    sys.exit(subprocess.call([sys.executable, "-m", "bench", *args], env=env))


# -- entry point ------------------------------------------------------------------------


@contextmanager
def _closing(state: State) -> Iterator[State]:
    try:
        yield state
    finally:
        state.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line; exits with 0, 1 (runtime error) or 2 (bad usage)."""
    state = State()
    try:
        with _closing(state):
            result = cli.main(args=None if argv is None else list(argv), prog_name="pgque",
                              standalone_mode=False, obj=state)
    except click.UsageError as exc:
        message = exc.format_message()
        if exc.ctx is not None and (not isinstance(exc, click.BadParameter)
                                    or isinstance(exc, click.MissingParameter)):
            message += f" (see '{exc.ctx.command_path} --help')"
        _fail(message, exc.exit_code)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except click.Abort as exc:
        interrupted = isinstance(exc.__cause__, KeyboardInterrupt)
        _fail("interrupted" if interrupted else "aborted", 130 if interrupted else 1)
    except (pgque.PgqueError, psycopg.Error) as exc:
        if state.debug:
            _fail_with_traceback(exc, state.dsn)
        _fail(display.describe_error(exc), 1, state.dsn)
    except Exception as exc:
        if state.debug:
            _fail_with_traceback(exc, state.dsn)
        _fail(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)", 1, state.dsn)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
