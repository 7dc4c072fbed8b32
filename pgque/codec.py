"""Payload encoding: Python values to JSON text and back, with msgspec.

What ``send`` accepts as a payload:

* any value msgspec can encode to JSON (dicts, lists, str, numbers, None,
  msgspec Structs, dataclasses, datetimes, ...);
* ``bytes`` / ``bytearray`` / ``memoryview`` or ``msgspec.Raw``: JSON that is
  already encoded, passed through as is (the server still checks it is JSON).

NaN and infinite floats are refused with PayloadError: JSON has no such
numbers, and msgspec would write them as null.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec

from pgque.errors import PayloadError

__all__ = ["decode_payload", "encode_payload"]

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode_payload(payload: Any) -> str:
    """The JSON text for a payload; raises PayloadError if it cannot be encoded."""
    if isinstance(payload, (bytes, bytearray, memoryview, msgspec.Raw)):
        raw = bytes(payload)
    else:
        try:
            raw = _encoder.encode(payload)
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            raise PayloadError(f"payload cannot be encoded as JSON: {exc}") from exc
        # msgspec writes NaN and infinities as null; JSON has no such numbers,
        # so refuse them rather than store a different value. Only a payload
        # whose JSON holds a null can hold one, so most are never walked.
        if b"null" in raw and _has_non_finite(payload):
            raise PayloadError("payload holds NaN or Infinity, which JSON cannot represent")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not UTF-8 JSON: {exc}") from exc


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
    except msgspec.DecodeError as exc:
        raise PayloadError(f"payload does not decode as {payload_type}: {exc}") from exc
    return result
