"""Passwords stay secret when libpq rejects a DSN, or a server refuses its password.

libpq quotes pieces of a DSN it cannot parse in its errors, and a password with
an unquoted space, an unencoded '@' or '/', or a bad percent-escape is exactly
such a piece. Every shape below is checked in-process (fast) through
``pgque.connect``, ``pgque.connect_async`` and the CLI's ``main`` (plain,
``--debug``, PGQUE_DSN): the error's text and repr, its whole chain, its
traceback, stdout and stderr, and every log record (psycopg's debug records
included). tests/test_cli.py runs a few of them as real subprocesses too.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import struct
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pgque
from pgque._dsn import check_dsn, redact
from pgque.cli import main as cli_main

# Two recognisable pieces: a password made of them leaks if either shows.
P1, P2 = "Sw0rdf1sh", "Zebr4Qu1lt"
SPACED = f"{P1} {P2}"
PIECES = (P1, P2)

# (id, DSN): every shape of libpq parse error, and DSNs that parse but that
# libpq (or psycopg) refuses to connect with, each holding P1 and often P2.
MALFORMED = [
    # key=value: an unquoted space ends the password; libpq quotes the rest.
    ("kv-space", f"host=127.0.0.1 port=1 user=u password={SPACED} dbname=x"),
    ("kv-space-last", f"host=127.0.0.1 user=u password={SPACED}"),
    ("kv-space-first", f"password={SPACED} host=127.0.0.1"),
    ("kv-spaced-keyword", f"host=127.0.0.1 password = {SPACED} user=u"),
    ("kv-space-equals", f"host=127.0.0.1 password={P1} {P2}=x"),  # invalid connection option
    ("kv-sslpassword", f"host=127.0.0.1 sslpassword={SPACED}"),
    ("kv-unterminated", f"host=127.0.0.1 password='{SPACED}"),
    ("kv-unterminated-after", f"host=127.0.0.1 password={P1}{P2} user='u"),
    ("kv-empty-keyword", f"host=127.0.0.1 password={P1} ={P2}"),
    ("kv-escaped-space", f"host=127.0.0.1\\ password={P1}{P2} port=1"),  # host takes the rest
    ("kv-hostaddr-count", f"host=127.0.0.1 port=1 hostaddr=1.2.3.4,5.6.7.8 password={P1}{P2}"),
    # Not a URI (one slash, none): parsed as key=value and quoted whole.
    ("uri-one-slash", f"postgresql:/u:{P1}{P2}@127.0.0.1/db"),
    ("uri-no-colon", f"postgres//u:{P1}{P2}@127.0.0.1/db"),
    # URIs libpq cannot parse: quoted whole, or the bad component.
    ("uri-ipv6-open", f"postgresql://u:{P1}{P2}@[bad/db"),
    ("uri-ipv6-empty", f"postgresql://u:{P1}{P2}@[]/db"),
    ("uri-after-ipv6", f"postgresql://u:{P1}{P2}@[::1]x/db"),
    ("uri-bad-escape", f"postgresql://u:{P1}%zz{P2}@127.0.0.1/db"),
    ("uri-nul-escape", f"postgresql://u:{P1}%00{P2}@127.0.0.1/db"),
    # psycopg's UnicodeDecodeError holds the bytes decoded.
    ("uri-not-utf8", f"postgresql://u:{P1}%A7{P2}@127.0.0.1/db"),
    ("uri-space", f"postgresql://u:{SPACED}@127.0.0.1:1/db"),
    ("uri-bad-option", f"postgresql://u:{P1}{P2}@127.0.0.1/db?bogus=1"),
    ("uri-query-equals", f"postgresql://u@127.0.0.1/db?password={P1}={P2}"),
    ("uri-query-ampersand", f"postgresql://u@127.0.0.1/db?password={P1}&{P2}"),
    ("uri-query-escape", f"postgresql://u@127.0.0.1/db?password={P1}%zz{P2}"),
    ("uri-query-space", f"postgresql://u@127.0.0.1/db?sslmode=disable&password={SPACED}"),
    # URIs libpq parses, then refuses to connect with.
    ("uri-port-letters", f"postgresql://u:{P1}{P2}@127.0.0.1:5x/db"),
    ("uri-port-range", f"postgresql://u:{P1}{P2}@127.0.0.1:99999/db"),
    ("uri-port-count", f"postgresql://u:{P1}{P2}@127.0.0.1,127.0.0.2/db?port=1,2,3"),
    ("uri-sslmode", f"postgresql://u:{P1}{P2}@127.0.0.1:1/db?sslmode=bogus"),
    ("uri-keepalives", f"postgresql://u:{P1}{P2}@127.0.0.1:1/db?keepalives=x"),
    ("uri-session-attrs", f"postgresql://u:{P1}{P2}@127.0.0.1:1/db?target_session_attrs=x"),
    # An unencoded '/' or '@' in the password: libpq takes part of it for the
    # port or the host.
    ("uri-slash", f"postgresql://u:{P1}/{P2}@127.0.0.1:1/db"),
    ("uri-at", f"postgresql://u:{P1}@{P2}@127.0.0.1:1/db"),
    # ... and an '@' then a '/': libpq takes the piece between for the host.
    ("uri-at-then-slash", f"postgresql://u:{P1}@{P2}/x@127.0.0.1:1/db"),
    # A double quote in the piece libpq quotes (it does not escape it).
    ("uri-quote-bad-escape", f'postgresql://u:{P1}"{P2}%zz@127.0.0.1:1/db'),
    ("uri-query-quote-escape", f'postgresql://u@127.0.0.1:1/db?password={P1}"{P2}%'),
    # SQL's doubled quote is no escape for libpq: the quoted value ends there.
    ("kv-doubled-quote", f"host=127.0.0.1 port=1 user=u password='{P1}''{P2}' dbname=x"),
]
MALFORMED_IDS = [name for name, _ in MALFORMED]
MALFORMED_DSNS = [dsn for _, dsn in MALFORMED]


def leaks(text: str) -> list[str]:
    """The pieces of the passwords that ``text`` shows."""
    return [piece for piece in PIECES if piece in text]


def exception_texts(exc: BaseException) -> Iterator[str]:
    """Everything an exception can show: its traceback as Python prints it, and
    the text and repr of it and of every exception chained to it, shown or not."""
    yield "".join(traceback.format_exception(exc))
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield str(current)
        yield repr(current)
        todo += [current.__cause__, current.__context__]


def log_texts(records: list[logging.LogRecord]) -> Iterator[str]:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    for record in records:
        yield formatter.format(record)


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record, psycopg's debug ones included (psycopg sets its logger to WARNING)."""
    caplog.set_level(logging.DEBUG)
    for name in ("psycopg", "psycopg.pool", "pgque"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def connect_both(dsn: str, **kwargs: object) -> list[pgque.ConnectError]:
    """The ConnectError of pgque.connect and of pgque.connect_async for ``dsn``."""
    errors: list[pgque.ConnectError] = []
    with pytest.raises(pgque.ConnectError) as sync:
        pgque.connect(dsn, timeout=0.1, pool_size=0, **kwargs)
    errors.append(sync.value)

    async def connect_async() -> None:
        await pgque.connect_async(dsn, timeout=0.1, pool_size=0, **kwargs)

    with pytest.raises(pgque.ConnectError) as async_:
        asyncio.run(connect_async())
    errors.append(async_.value)
    return errors


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """stdout and stderr of the CLI run in-process with ``args``; it must fail with 1."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(list(args))
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    return out + err


@pytest.mark.parametrize("dsn", MALFORMED_DSNS, ids=MALFORMED_IDS)
def test_connect_never_shows_a_password_of_a_malformed_dsn(
        dsn: str, all_logs: pytest.LogCaptureFixture) -> None:
    for error in connect_both(dsn):
        for text in exception_texts(error):
            assert not leaks(text), text
        # Not chained, shown or not: the psycopg error quotes the DSN.
        assert error.__cause__ is None and error.__context__ is None
        if isinstance(error, pgque.InvalidDSN):
            assert not error.transient
    for text in log_texts(all_logs.records):
        assert not leaks(text), text


@pytest.mark.parametrize("dsn", MALFORMED_DSNS, ids=MALFORMED_IDS)
def test_the_cli_never_shows_a_password_of_a_malformed_dsn(
        dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        all_logs: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PGQUE_DSN", raising=False)
    monkeypatch.delenv("PGQUE_DEBUG", raising=False)
    plain = run_cli(capsys, "status", "--dsn", dsn, "--connect-timeout", "0.1")
    assert plain.startswith("error: ") and not leaks(plain), plain
    debug = run_cli(capsys, "--debug", "status", "--dsn", dsn, "--connect-timeout", "0.1")
    assert "Traceback" in debug and not leaks(debug), debug
    monkeypatch.setenv("PGQUE_DSN", dsn)
    monkeypatch.setenv("PGQUE_DEBUG", "1")
    from_env = run_cli(capsys, "status", "--connect-timeout", "0.1")
    assert "Traceback" in from_env and not leaks(from_env), from_env
    for text in log_texts(all_logs.records):
        assert not leaks(text), text


@pytest.mark.parametrize("dsn", [
    f"host=127.0.0.1 password={SPACED}",
    f"postgresql://u:{P1}%zz{P2}@127.0.0.1/db",
    f"postgresql://u:{P1}{P2}@[bad/db",
], ids=["kv-space", "uri-bad-escape", "uri-ipv6-open"])
def test_a_malformed_dsn_is_invalid_dsn_at_once(dsn: str) -> None:
    """libpq cannot parse it: InvalidDSN, a ConnectError that is not transient (no
    retries), saying what libpq said with the pieces of the password masked."""
    for error in connect_both(dsn):
        assert isinstance(error, pgque.InvalidDSN) and isinstance(error, ValueError)
        assert not error.transient
        assert str(error).startswith("invalid DSN: ")
        assert "***" in str(error)


def test_what_libpq_says_is_kept_where_it_holds_no_password() -> None:
    [error, _] = connect_both("host=127.0.0.1 hots=db password=x")
    assert str(error) == 'invalid DSN: invalid connection option "hots"'
    [error, _] = connect_both(f"postgresql://u:{P1}@[bad/db")
    assert str(error) == ('invalid DSN: end of string reached when looking for matching "]" '
                          'in IPv6 host address in URI: "postgresql://u:***@[bad/db" '
                          '(*** hides what may be part of a password)')
    [error, _] = connect_both(f"host=127.0.0.1 port=1 password={SPACED} user=u")
    assert str(error) == ('invalid DSN: missing "=" after "***" in connection info string '
                          "(*** hides what may be part of a password; quote one with blanks: "
                          "password='...')")
    [error, _] = connect_both(f"postgresql://u:{P1}@{P2}@127.0.0.1/db")
    assert str(error) == ('invalid DSN: host "***@127.0.0.1" is not a host name (*** hides '
                          "what may be part of a password; write '@' and '/' in a URI's "
                          "password as %40 and %2F)")


def test_a_uri_whose_hosts_libpq_would_read_from_its_password_is_refused() -> None:
    """libpq ends the user info at the first '@' or '/', where the password may go
    on to the last '@': refused before psycopg looks the "host" up (and logs it)."""
    for dsn in (f"postgresql://u:{P1}@{P2}/x@127.0.0.1:1/db",
                f"postgresql://u:1234/{P2}@127.0.0.1:1/db",  # port 1234
                "postgresql://u@127.0.0.1:1/db?application_name=me@there"):
        with pytest.raises(pgque.InvalidDSN) as error:
            check_dsn(dsn)
        assert '"@" or "/" before its last "@"' in str(error.value)
        assert not leaks(str(error.value))
    with pytest.raises(pgque.InvalidDSN, match=r'hosts "h\"x" of a URI are not host\[:port\]'):
        check_dsn('postgresql://u:pw@h"x/db')
    for dsn in (f"postgresql://u:{P1}%40{P2}%2Fx@127.0.0.1:1/db",
                "postgresql://u@127.0.0.1:1/db?application_name=me%40there",
                f"postgresql://u:{P1}?#{P2}@[::1]:1,127.0.0.1:2/db?port=",
                "postgresql://%2Fvar%2Frun%2Fpostgresql/db", "postgresql://", "postgres:///db"):
        check_dsn(dsn)


def test_a_password_given_apart_from_the_dsn_stays_secret(
        all_logs: pytest.LogCaptureFixture) -> None:
    for error in connect_both("host=127.0.0.1 port=1 user='u", password=SPACED):
        for text in exception_texts(error):
            assert not leaks(text), text
    for error in connect_both("host=127.0.0.1 port=1 user=u", password=P1 + P2):
        for text in exception_texts(error):
            assert not leaks(text), text
    for text in log_texts(all_logs.records):
        assert not leaks(text), text


def test_a_client_given_a_malformed_dsn_for_its_pool_refuses_it(dsn: str) -> None:
    """The producer pool would log psycopg's error (quoting the DSN) on every attempt."""
    with psycopg.connect(dsn, autocommit=True) as conn, \
            pytest.raises(pgque.InvalidDSN) as error:
        pgque.Client(conn, dsn=f"host=127.0.0.1 password={SPACED}", pool_size=2)
    for text in exception_texts(error.value):
        assert not leaks(text), text


def test_a_service_never_logs_a_password(all_logs: pytest.LogCaptureFixture) -> None:
    ticker = pgque.Ticker(f"host=127.0.0.1 password={SPACED}", connect_timeout=0.2)
    with pytest.raises(pgque.InvalidDSN):
        ticker.run()
    assert any("invalid DSN" in text for text in log_texts(all_logs.records))
    for text in log_texts(all_logs.records):
        assert not leaks(text), text


# -- a server that refuses the password -------------------------------------------------


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _refuse(sock: socket.socket) -> None:
    """Speak just enough of the protocol to ask for a password and refuse it."""
    with sock:
        while True:
            (length,) = struct.unpack("!i", _read_exactly(sock, 4))
            body = _read_exactly(sock, length - 4)
            if body[:4] in (struct.pack("!i", 80877103), struct.pack("!i", 80877104)):
                sock.sendall(b"N")  # no SSL, no GSS encryption: ask again in clear
                continue
            break  # the startup message
        sock.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
        _read_exactly(sock, 1)
        (length,) = struct.unpack("!i", _read_exactly(sock, 4))
        _read_exactly(sock, length - 4)  # the password: never shown back
        fields = b"".join(code + text + b"\0" for code, text in [
            (b"S", b"FATAL"), (b"V", b"FATAL"), (b"C", b"28P01"),
            (b"M", b'password authentication failed for user "u"')])
        sock.sendall(b"E" + struct.pack("!i", 4 + len(fields) + 1) + fields + b"\0")


@pytest.fixture(scope="module")
def refusing_port() -> Iterator[int]:
    """The port of a server that asks for a password and refuses every one."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(5)
            with suppress(OSError, struct.error):  # the client gave up: next one
                _refuse(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        listener.close()


def test_a_refused_password_is_never_shown(refusing_port: int, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch,
                                           all_logs: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PGQUE_DSN", raising=False)
    monkeypatch.delenv("PGQUE_DEBUG", raising=False)
    for dsn in (f"postgresql://u:{P1}{P2}@127.0.0.1:{refusing_port}/db?sslmode=disable",
                f"host=127.0.0.1 port={refusing_port} user=u password='{SPACED}' "
                "sslmode=disable gssencmode=disable"):
        for error in connect_both(dsn):
            assert "password authentication failed" in str(error)
            for text in exception_texts(error):
                assert not leaks(text), text
        for debug in ([], ["--debug"]):
            shown = run_cli(capsys, *debug, "status", "--dsn", dsn, "--connect-timeout", "0.1")
            assert "password authentication failed" in shown
            assert not leaks(shown), shown
    for text in log_texts(all_logs.records):
        assert not leaks(text), text


# -- the retries while a server starts --------------------------------------------------


def _pipe(source: socket.socket, target: socket.socket) -> None:
    with suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with suppress(OSError):
        target.shutdown(socket.SHUT_WR)


@contextmanager
def starting_server(upstream: tuple[str, int], starting_for: int) -> Iterator[int]:
    """A port whose first ``starting_for`` connections are told "the database
    system is starting up" (57P03); later ones reach the server at ``upstream``."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()
    socks: list[socket.socket] = []

    def serve() -> None:
        refused = 0
        while not done.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            socks.append(sock)
            if refused < starting_for:
                refused += 1
                with suppress(OSError, struct.error), sock:
                    _read_exactly(sock, struct.unpack("!i", _read_exactly(sock, 4))[0] - 4)
                    fields = b"".join(code + text + b"\0" for code, text in [
                        (b"S", b"FATAL"), (b"V", b"FATAL"), (b"C", b"57P03"),
                        (b"M", b"the database system is starting up")])
                    sock.sendall(b"E" + struct.pack("!i", 4 + len(fields) + 1) + fields + b"\0")
                continue
            server = socket.create_connection(upstream)
            socks.append(server)
            for source, target in ((sock, server), (server, sock)):
                threading.Thread(target=_pipe, args=(source, target), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        listener.close()
        for sock in socks:
            sock.close()


def test_connect_still_waits_for_a_server_that_is_starting(dsn: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    upstream = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    with starting_server(upstream, starting_for=3) as port:
        started = time.monotonic()
        client = pgque.connect(psycopg.conninfo.make_conninfo(
            dsn, host="127.0.0.1", hostaddr="127.0.0.1", port=port, sslmode="disable",
            gssencmode="disable"), timeout=10, pool_size=0)
        with client:
            assert client.conn.execute("select 1").fetchone() == (1,)
        # Three refusals, waited out with backoff from 50 ms: about 0.35 s.
        assert 0.3 <= time.monotonic() - started < 5


# -- a sweep: passwords of awkward characters in both shapes of DSN -------------------------

# Letters that no message, repr, traceback or log record shows next to one
# another, so any 4 characters of a password that hold one of them and show
# are a leak; and the characters that end, quote, escape, split or encode a
# value in one shape or the other.
MARKED = "QXZJ"
AWKWARD = "'\"\\@/?#%&=:,[ "
SWEPT_PASSWORDS = st.text(alphabet=MARKED + "AF7" + AWKWARD, min_size=4, max_size=24)
SHAPES = [
    "host=127.0.0.1 port={port} user=u password={password} dbname=x sslmode=disable",
    "host=127.0.0.1 port={port} user=u password='{password}' dbname=x sslmode=disable",
    "postgresql://u:{password}@127.0.0.1:{port}/db?sslmode=disable",
    "postgresql://u@127.0.0.1:{port}/db?password={password}&sslmode=disable",
]


def pieces_of(password: str) -> set[str]:
    """The pieces 4 long, marked, of ``password``, as written and percent-decoded."""
    return {form[i:i + 4] for form in (password, urllib.parse.unquote(password))
            for i in range(len(form) - 3) if set(form[i:i + 4]) & set(MARKED)}


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def every_record() -> Iterator[list[logging.LogRecord]]:
    """Every log record meanwhile, psycopg's debug ones included."""
    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("", "psycopg", "psycopg.pool", "pgque")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
    loggers[0].addHandler(kept)
    try:
        yield kept.records
    finally:
        loggers[0].removeHandler(kept)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@given(password=SWEPT_PASSWORDS)
@settings(max_examples=min(40, settings().max_examples), deadline=None)
def test_no_piece_of_any_password_shows(password: str, refusing_port: int) -> None:
    """Whatever a password holds, written as it is in a key=value DSN (quoted or
    not) or a URI (user info or query): connect fails (the server refuses every
    password), and no piece of it shows in the error, its chain, its traceback
    or a log record."""
    pieces = pieces_of(password)
    for shape in SHAPES:
        dsn = shape.format(port=refusing_port, password=password)
        with every_record() as records, pytest.raises(pgque.ConnectError) as error:
            pgque.connect(dsn, timeout=0, pool_size=0)  # one attempt
        assert error.value.__cause__ is None and error.value.__context__ is None
        for text in [*exception_texts(error.value), *log_texts(records)]:
            shown = [piece for piece in pieces if piece in text]
            assert not shown, (dsn, shown, text)


# -- redact ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "dsn", "expected"), [
    # Pieces of a DSN quoted in a message are masked where they overlap its password.
    ('missing "=" after "b" in connection info string', "host=h password=a b user=u",
     'missing "=" after "***" in connection info string'),
    ('invalid connection option "b"', "host=h password=apple b=c",
     'invalid connection option "***"'),
    ('bad "postgresql://u:p w@h/db"', "postgresql://u:p w@h/db", 'bad "postgresql://u:***@h/db"'),
    ("failed to resolve host 'pw@h'", "postgresql://u:x@pw@h/db",
     "failed to resolve host '***@h'"),
    # ... and kept where they do not.
    ('invalid connection option "hots"', "hots=h password=pw", 'invalid connection option "hots"'),
    ('role "shop" does not exist', "postgresql://shop:pw@h/db", 'role "shop" does not exist'),
])
def test_redact_masks_the_pieces_of_a_password(text: str, dsn: str, expected: str) -> None:
    assert redact(text, dsn) == expected


def test_redact_masks_extra_secrets() -> None:
    assert redact(f"it was {P1}", "host=h", secrets=[P1]) == "it was ***"
    assert redact(f"it was {P1}", None, secrets=[P1]) == "it was ***"


# -- every failed connect: nothing it shows holds a piece of the password ---------------------


def everything_shown(call: Callable[[], Any]) -> str:
    """What a failed call shows: its error's text, repr and traceback, its chain,
    and every log record on the way (psycopg's debug records included)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    loggers = [logging.getLogger(n) for n in ("", "psycopg", "psycopg.pool", "pgque")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    loggers[0].addHandler(handler)
    shown: list[str] = []
    try:
        call()
    except Exception as exc:
        shown.append("".join(traceback.format_exception(exc)))
        current: BaseException | None = exc
        while current is not None:
            shown += [str(current), repr(current)]
            current = current.__cause__ or current.__context__
    finally:
        loggers[0].removeHandler(handler)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return "\n".join([*shown, stream.getvalue()])


@pytest.mark.parametrize("dsn", [
    # A double quote in a URI's password cuts libpq's quoted piece short.
    pytest.param(f'postgresql://u:{P1}"{P2}%zz@127.0.0.1:1/db', id="uri-quote-bad-escape"),
    pytest.param(f'postgresql://u@127.0.0.1:1/db?password={P1}"{P2}%', id="query-quote-escape"),
    # SQL's doubled quote is no escape for libpq: the quoted value ends there.
    pytest.param(f"host=127.0.0.1 port=1 user=u password='{P1}''{P2}' dbname=x",
                 id="kv-doubled-quote"),
    # The first '@' ends the user info: the rest of the password is a host, which
    # psycopg looks up (a DNS query) and logs.
    pytest.param(f"postgresql://u:{P1}@{P2}/x@127.0.0.1:1/db", id="uri-at-then-slash"),
])
def test_no_piece_of_a_password_shows_for_these_malformed_dsns(dsn: str) -> None:
    """No error, traceback or log line names a password (docs/api.md), not even a
    piece of one: for a double quote inside the piece libpq quotes, for SQL's
    doubled quote (no escape for libpq: the quoted value ends there), and for an
    '@' then a '/' in a URI password (which would leave a piece of the password
    for a host name, looked up and logged)."""
    text = everything_shown(lambda: pgque.connect(dsn, timeout=0.1, pool_size=0))
    assert "ConnectError" in text or "InvalidDSN" in text
    assert P1 not in text and P2 not in text, text[-600:]
