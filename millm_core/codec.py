"""JSON encoders/decoders built once, body decoding into contracts, and SSE framing."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from .errors import InvalidRequest

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_raw_decoder = msgspec.json.Decoder()
# msgspec reports where a value failed as "... - at `$.path`". We lift that path into the
# error's ``param`` so clients see which field; the error *kind* is decided by the
# exception class alone.
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
# A bad key of a mapping: "... - at `key` in `$.path`" (the mapping's path).
_KEY = re.compile(r" - at `key` in `\$\.?(?P<path>[^`]*)`$")
# A field named in the message itself: the param is the field's own path.
_FIELD = re.compile(r"^Object (?:contains unknown|missing required) field `(?P<field>.*)`$")


def encode(obj: Any) -> bytes:
    """Encode a Struct (or plain data) as compact JSON."""
    return _encoder.encode(obj)


def decode_json(body: bytes) -> Any:
    """Parse a request body as JSON, refusing anything else with ``invalid_json``."""
    try:
        return _raw_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        # msgspec reports nesting deeper than the interpreter's recursion limit this way.
        raise InvalidRequest("Request body is nested too deeply to decode", code="invalid_json") from exc


def convert(data: Any, type_: type[T]) -> T:
    """Convert parsed JSON into a contract Struct; a type or range error is a 400 whose
    ``param`` is the JSON path of the offending value."""
    if not isinstance(data, dict):
        raise InvalidRequest("Request body must be a JSON object", code="invalid_request")
    try:
        return msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text) or _KEY.search(text)
        param = match.group("path") if match else None
        if match:
            text = text[: match.start()]
        named = _FIELD.match(text)
        if named:
            param = f"{param}.{named.group('field')}" if param else named.group("field")
        raise InvalidRequest(f"{text}" + (f" (at '{param}')" if param else ""), param=param) from exc


def sse_frame(obj: Any) -> bytes:
    """One Server-Sent Events frame: ``data: <json>`` and a blank line."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
