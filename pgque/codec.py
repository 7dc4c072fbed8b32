"""Payload encoding: Python values to JSON text and back, with msgspec.

What ``send`` accepts as a payload:

* any value msgspec can encode to JSON (dicts, lists, str, numbers, None,
  msgspec Structs, dataclasses, datetimes, ...);
* ``bytes`` / ``bytearray`` / ``memoryview`` or ``msgspec.Raw``: JSON that is
  already encoded, passed through as is (the server still checks it is JSON).

NaN and infinite floats are refused with PayloadError: JSON has no such
numbers, and msgspec would write them as null. So are payloads nested deeper
than Python can encode or decode (about a thousand levels): PayloadError, not
RecursionError, and never the server's stack depth error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from pgque.errors import PayloadError

__all__ = ["decode_payload", "encode_payload", "encode_payloads"]

T = TypeVar("T")

def _encode_other(value: Any) -> Any:
    """What msgspec cannot encode itself: an int subclass (a SentId a send
    returned, put in another event's payload) is encoded as its int."""
    if isinstance(value, int):
        return int(value)
    raise TypeError(f"Encoding objects of type {type(value).__name__} is unsupported")


_encoder = msgspec.json.Encoder(enc_hook=_encode_other)
_encode = _encoder.encode
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode_payload(payload: Any) -> str:
    """The JSON text for a payload; raises PayloadError if it cannot be encoded."""
    return encode_payloads((payload,))[0]


def encode_payloads(payloads: Sequence[Any]) -> list[str]:
    """The JSON text of each payload, in order; raises PayloadError if any of
    them cannot be encoded. For a batch: one pass, and one search for NaN over
    them all (_check_finite)."""
    try:
        # A dict or list is never pre-encoded JSON: straight to the encoder.
        raws = [_encode(payload) if type(payload) in _PLAIN_TYPES else _other_json(payload)
                for payload in payloads]
    except PayloadError:
        raise
    except RecursionError as exc:
        raise PayloadError("payload is nested too deeply to encode as JSON") from exc
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        raise PayloadError(f"payload cannot be encoded as JSON: {exc}") from exc
    _check_finite(payloads, raws)
    try:
        return [raw.decode("utf-8") for raw in raws]
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not UTF-8 JSON: {exc}") from exc


def _other_json(payload: Any) -> bytes:
    """The JSON of a payload that is no plain JSON value: pre-encoded JSON as it
    is (bytes, memoryview, msgspec.Raw), anything else through the encoder."""
    if isinstance(payload, (bytes, bytearray, memoryview, msgspec.Raw)):
        raw = bytes(payload)
        _check_depth(raw)
        return raw
    return _encode(payload)


def _check_finite(payloads: Sequence[Any], raws: list[bytes]) -> None:
    """PayloadError if a payload holds NaN or an infinity. msgspec writes them as
    null, and JSON has no such numbers: refuse them rather than store a
    different value. Only a payload whose JSON holds a null can hold one, so
    most are never walked; and one search over their JSON joined by a byte no
    JSON holds costs less than one search each. Pre-encoded JSON holds no
    Python floats."""
    if b"null" not in (raws[0] if len(raws) == 1 else b"\0".join(raws)):
        return
    for payload, raw in zip(payloads, raws, strict=True):
        if b"null" in raw and _has_non_finite(payload):
            raise PayloadError("payload holds NaN or Infinity, which JSON cannot represent")


# Payload types that are never pre-encoded JSON: encoded without asking.
_PLAIN_TYPES = frozenset({dict, list, str, int, float, bool, type(None)})


# JSON passed through as bytes with fewer opening brackets than this cannot be
# nested deeply enough to trouble a decoder (Python's or the server's).
_DEPTH_CHECK_BRACKETS = 500


def _check_depth(raw: bytes) -> None:
    """Refuse pre-encoded JSON nested deeper than Python can decode.

    Counting brackets is cheap; only a payload with many of them is decoded to
    find out (the server would otherwise fail on it with a stack depth error,
    or accept JSON no Python consumer could read).
    """
    if raw.count(b"[") + raw.count(b"{") < _DEPTH_CHECK_BRACKETS:
        return
    try:
        msgspec.json.decode(raw)
    except RecursionError as exc:
        raise PayloadError("payload is nested too deeply to decode as JSON") from exc
    except msgspec.DecodeError:
        pass  # not JSON: the server says so, as for any other malformed payload


def _has_non_finite(payload: Any) -> bool:
    """Whether a float in payload (at any depth) is NaN or infinite."""
    try:
        pending: list[Any] = [msgspec.to_builtins(payload)]
    except (TypeError, ValueError, msgspec.EncodeError):
        return False  # it encoded above; if it cannot be walked, trust that
    while pending:  # a loop, not recursion: deep payloads must not overflow the stack
        value = pending.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return True
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return False


def decode_payload(data: str | None, payload_type: type[T] | None) -> T:
    """Decode JSON text into payload_type (any JSON value when None).

    SQL NULL decodes as None. Raises PayloadError when the JSON does not fit.
    """
    if data is None:
        data = "null"
    decoder = _decoders.get(payload_type)
    if decoder is None:
        decoder = msgspec.json.Decoder(Any if payload_type is None else payload_type)
        _decoders[payload_type] = decoder
    try:
        result: T = decoder.decode(data)
    except RecursionError as exc:
        raise PayloadError("payload is nested too deeply to decode") from exc
    except msgspec.DecodeError as exc:
        raise PayloadError(f"payload does not decode as {payload_type}: {exc}") from exc
    return result
