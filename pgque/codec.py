"""Payload encoding: Python values to JSON text and back, with msgspec.

What ``send`` accepts as a payload:

* any value msgspec can encode to JSON (dicts, lists, str, numbers, None,
  msgspec Structs, dataclasses, datetimes, ...);
* ``bytes`` / ``bytearray`` / ``memoryview`` or ``msgspec.Raw``: JSON that is
  already encoded, passed through as is (the server still checks it is JSON).
"""

from __future__ import annotations

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
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not UTF-8 JSON: {exc}") from exc


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
