"""Passwords in DSNs: no error, log line or traceback of pgque names one.

libpq quotes pieces of a DSN it rejects in its errors, as they are (a quote
in a piece is not escaped), and where the DSN is malformed it cannot say
which piece is the password: a password with an unquoted space ends at the
space, and libpq then quotes the rest as a keyword; a quoted one ends at its
first inner quote; one with an unencoded '@' or '/' in a URI spills into the
host or port. So the text that may be a password is taken generously (the
"secret spans" of the DSN below), and redact() masks in a message:

- every occurrence of a secret: a span's text as written, unquoted and
  unescaped, percent-decoded; the password libpq parses; one given apart;
- every quoted piece that holds a piece _PIECE long of a secret (all of a
  shorter one), whole; every quoted piece that is text of the DSN, where it
  overlaps a span. A piece is what lies between any two like quotes (an inner
  quote does not end it), so a quote in a password cannot cut it short;
- the passwords of the key=value and URI DSNs that the message holds.

check_dsn() refuses before psycopg sees it a URI whose host libpq would take
from what may be a password: psycopg looks hosts up (a DNS query) and logs
the ones it cannot resolve.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import psycopg

from pgque.errors import ConnectError, InvalidDSN

__all__ = ["TRANSIENT_STATES", "check_dsn", "connect_error", "redact", "secret_spans"]

# SQLSTATEs worth waiting for while a server starts: cannot connect now,
# the database system is starting up / shutting down, too many connections.
TRANSIENT_STATES = {None, "57P03", "57P01", "53300", "08001", "08006"}

# A password in a key=value DSN (quoted or not) or in a URI's query string...
_KEY_VALUE_PASSWORD = re.compile(
    r"""(?i)\b((?:ssl)?password\s*=\s*)((?:'(?:[^'\\]|\\.)*'?)+|[^\s&'"]+)""")
# ...and in a URI's user info, up to its last '@': scheme://user:password@host.
_URI_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s/:@]*:(\S*)@")
# A secret shorter than this is not hunted for in free text (it would garble
# every message); the spans and the patterns above still hide it.
_MIN_HUNTED = 3
# A quoted piece holding this many characters of a secret in a row (all of a
# shorter one) is masked whole.
_PIECE = 4
# The keyword and '=' of a secret setting (sslpassword: the client key's).
_SECRET_KEY = re.compile(r"(?i)(?<![\w-])(?:ssl)?password\s*=\s*")
# A key=value DSN starts with a keyword and '='; anything else is read as a URI
# here, even one libpq reads as key=value for a missing slash.
_KEY_VALUE_DSN = re.compile(r"\s*[\w.-]*\s*=")
_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*:")
# What libpq reads as a keyword in a key=value DSN, and in a URI's query, after '&'.
_KEYWORD = re.compile(r"([^\s=]+)\s*=")
_NEXT_QUERY = re.compile(r"&(\w+)=")
_QUOTES = "\"'"  # libpq's "...", psycopg's '...' (repr)
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


def _word_end(dsn: str, index: int) -> int:
    """The end of the value libpq reads at ``index`` of a key=value DSN: a quoted
    one past its closing quote, another at the next blank; a backslash escapes
    the next character in both."""
    quoted = dsn.startswith("'", index)
    index += quoted
    while index < len(dsn):
        char = dsn[index]
        if char == "\\":
            index += 2
        elif quoted and char == "'":
            return index + 1
        elif not quoted and char.isspace():
            return index
        else:
            index += 1
    return len(dsn)


def _key_value_end(dsn: str, start: int) -> int:
    """Where the value at ``start`` of a key=value DSN may end: after the words
    (values as libpq reads them) that follow it up to the next known keyword
    and '='. libpq ends a password at a blank or its closing quote, and reads
    what follows (a doubled quote's rest, say) as a keyword."""
    end = _word_end(dsn, start)
    while True:
        index = end
        while index < len(dsn) and dsn[index].isspace():
            index += 1
        keyword = _KEYWORD.match(dsn, index)
        if index == len(dsn) or (keyword and keyword[1] in _keywords()):
            return end
        end = _word_end(dsn, index)


def secret_spans(dsn: str) -> list[tuple[int, int]]:
    """Where in ``dsn`` a password may be, as (start, end) offsets, taken
    generously: the values of ``password`` and ``sslpassword`` up to the next
    known keyword, and in a URI everything between the user name's ':' and
    the last '@'."""
    spans: list[tuple[int, int]] = []
    key_value = bool(_KEY_VALUE_DSN.match(dsn))
    if not key_value:
        at = dsn.rfind("@")
        scheme = _SCHEME.match(dsn)
        colon = dsn.find(":", scheme.end() if scheme else 0, max(at, 0))
        if colon >= 0:
            spans.append((colon + 1, at))
    for match in _SECRET_KEY.finditer(dsn):
        start = match.end()
        end = (_key_value_end(dsn, start) if key_value
               else _value_end(dsn, start, _NEXT_QUERY))
        spans.append((start, end))
    return spans


def _unescaped(text: str) -> str:
    """``text`` without libpq's quotes and backslash escapes."""
    return re.sub(r"\\(.)|'", r"\1", text, flags=re.S)


def _secrets_of(dsn: str, spans: list[tuple[int, int]], given: Iterable[str]) -> list[str]:
    """The texts to hide wherever they appear: the spans as written, unquoted
    and unescaped, percent-decoded; the passwords libpq parses; the ``given``
    ones."""
    found = [*given]
    for start, end in spans:
        text = dsn[start:end].strip()
        found += [text, _unescaped(text), urllib.parse.unquote(text)]
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn) if dsn else {}
    except (psycopg.Error, UnicodeError):
        params = {}
    found += [value for key, value in params.items()
              if key in ("password", "sslpassword") and isinstance(value, str)]
    return sorted({s for s in found if len(s) >= _MIN_HUNTED}, key=len, reverse=True)


def _occurrences(text: str, piece: str) -> Iterator[int]:
    """Where ``piece`` starts in ``text``, overlapping occurrences too."""
    start = text.find(piece)
    while start >= 0:
        yield start
        start = text.find(piece, start + 1)


def _quoted_pieces(text: str, longest: int) -> Iterator[tuple[int, int]]:
    """(start, end) of every piece of ``text`` between two like quotes, any two
    (a quote in a piece does not end it), up to ``longest`` characters long."""
    for quote in _QUOTES:
        at = [index for index, char in enumerate(text) if char == quote]
        for n, start in enumerate(at):
            for end in at[n + 1:]:
                if end - start - 1 > longest:
                    break
                yield start + 1, end


def _enclosing_piece(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The quoted piece of ``text`` that holds ``text[start:end]``, the innermost:
    from a quote before it to the next like quote after it; None if none."""
    pieces = [(opening + 1, closing) for quote in _QUOTES
              if (opening := text.rfind(quote, 0, start)) >= 0
              and (closing := text.find(quote, end)) >= 0]
    return max(pieces, default=None)


def _secret_cuts(text: str, dsn: str, spans: list[tuple[int, int]],
                 secrets_found: list[str]) -> Iterator[tuple[int, int]]:
    """What to mask in ``text`` (libpq's or psycopg's message, and the DSN they
    came from) by the secrets of the DSN, as (start, end) offsets: see above."""
    for secret in secrets_found:
        for start in _occurrences(text, secret):
            yield start, start + len(secret)
    # The pieces of secrets: any quoted piece holding one is masked whole, or,
    # if it is text of the DSN, where it overlaps a span (below).
    pieces: dict[int, set[str]] = {}
    for secret in secrets_found:
        size = min(_PIECE, len(secret))
        pieces.setdefault(size, set()).update(
            secret[i:i + size] for i in range(len(secret) - size + 1))
    for size, known in pieces.items():
        for start in range(len(text) - size + 1):
            if text[start:start + size] in known:
                quoted = _enclosing_piece(text, start, start + size)
                if quoted is not None:
                    yield start, start + size
                    if not (dsn and text[slice(*quoted)] in dsn):
                        yield quoted
    # Quoted text of the DSN, where it overlaps a span; other quoted text that
    # is a part of a secret, whole.
    longest = max([len(dsn), *map(len, secrets_found)])
    for start, end in _quoted_pieces(text, longest):
        piece = text[start:end]
        if not piece:
            continue
        places = list(_occurrences(dsn, piece)) if dsn else []
        inside = [p for p in places
                  if any(s < p + len(piece) and p < e for s, e in spans)]
        if not places:
            if len(piece) >= _MIN_HUNTED and any(piece in s for s in secrets_found):
                yield start, end
            continue
        # A piece too short to tell anything, found outside a span too (a user
        # "u" of a password with a "u"), is that other text.
        if len(inside) < len(places) and len(piece) < _MIN_HUNTED:
            continue
        for place in inside:
            for span_start, span_end in spans:
                low, high = max(span_start, place), min(span_end, place + len(piece))
                if low < high:
                    yield start + low - place, start + high - place


def redact(text: str, dsn: str | None = None, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password hidden (``***``): in key=value and URI DSNs
    it holds; when the ``dsn`` it came from is given, every quoted piece of
    that DSN that may belong to its password (libpq quotes pieces of a DSN it
    rejects) and every quoted piece holding a piece of it, and its password
    wherever it appears; and ``secrets`` (passwords given apart from the DSN)
    wherever they appear."""
    spans = secret_spans(dsn) if dsn else []
    cuts = list(_secret_cuts(text, dsn or "", spans, _secrets_of(dsn or "", spans, secrets)))
    cuts += [m.span(1) for m in _URI_PASSWORD.finditer(text)]
    cuts += [m.span(2) for m in _KEY_VALUE_PASSWORD.finditer(text)]
    merged: list[list[int]] = []
    for start, end in sorted(cuts):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif start < end:
            merged.append([start, end])
    parts: list[str] = []
    position = 0
    for start, end in merged:
        parts += [text[position:start], _MASK]
        position = end
    parts.append(text[position:])
    return "".join(parts)


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


# libpq's URIs, and a list of host[:port] in one, an empty host or port the default.
_URI_PREFIXES = ("postgresql://", "postgres://")
_URI_HOST = r"""(?:\[[^\]\s/?#@]+\]|[^\s"'`\\@/?#,:\[\]]*)(?::\d*)?"""
_URI_HOSTS = re.compile(rf"{_URI_HOST}(?:,{_URI_HOST})*")
_URI_AUTHORITY_END = re.compile(r"[/?#]")


def _misread_uri(dsn: str) -> str | None:
    """What is wrong with a URI whose hosts libpq may read from its password, or
    None.

    The user name and password end at the last '@' before the hosts: those
    run from there to the next '/', '?' or '#', and must be host[:port]
    pairs. libpq ends them at the first '@' or '/', though: a password
    holding one (or an '@' after the hosts, which may end one) would leave
    libpq a host or port made of a piece of it, which psycopg looks up (a DNS
    query) and logs."""
    prefix = next((p for p in _URI_PREFIXES if dsn.startswith(p)), None)
    if prefix is None:
        return None
    rest = dsn[len(prefix):]
    at = rest.rfind("@")
    end = _URI_AUTHORITY_END.search(rest, at + 1)
    user_info, _, hosts = rest[:end.start() if end else len(rest)].rpartition("@")
    if re.search("[@/]", user_info):
        return ('a URI with an "@" or "/" before its last "@", where libpq would end '
                "the password and read the rest as hosts: write them as %40 and %2F "
                'in a password, and an "@" after the hosts as %40')
    if not _URI_HOSTS.fullmatch(hosts):
        return f'hosts "{hosts}" of a URI are not host[:port] pairs'
    return None


def check_dsn(dsn: str, settings: Mapping[str, Any] | None = None) -> None:
    """Raise InvalidDSN, its text masking every password, unless libpq parses
    ``dsn``, its hosts and ports (``settings`` override them) can be hosts
    and ports, and, in a URI, libpq reads its hosts after its last '@'.
    Checked before psycopg connects: psycopg would look up and log a host
    that holds part of a password."""
    error: InvalidDSN | None = None
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        error = _rejected(exc, dsn, _given_secrets(settings))
    except UnicodeError:  # psycopg's error holds the bytes, a password's maybe
        error = InvalidDSN("invalid DSN: not UTF-8 (a value of a URI once "
                           "percent-decoded, or the DSN itself)")
    else:
        params.update({k: v for k, v in (settings or {}).items()
                       if k in ("host", "hostaddr", "port") and v is not None})
        problem = _misplaced_piece(params) or _misread_uri(dsn)
        if problem is not None:
            advice = ("" if _KEY_VALUE_DSN.match(dsn) else
                      "; write '@' and '/' in a URI's password as %40 and %2F")
            error = _invalid_dsn(problem, dsn, _given_secrets(settings), advice)
    if error is not None:
        raise error  # here, not in the except: psycopg's error quotes the DSN
