"""W3C Trace Context: the ``traceparent`` request header puts a request in the caller's
trace, so that every probe result carries the caller's ``trace_id``.

Parsing follows the W3C rules as the OpenTelemetry propagator applies them: lowercase hex
only; version ``ff`` is invalid; version ``00`` is exactly four fields, a later version may
carry more after a ``-``; an all-zero trace id or parent id is invalid; spaces and tabs
around the value are tolerated; a value over 512 characters is ignored. A header sent more
than once is ignored too (the Trace Context rule; the propagator would take the first),
and so is a value holding a ``,``: a traceparent never contains one, so it is a repeated
header that HTTP joined (the core joins repeated headers with ", "). Whatever is ignored,
the request gets a new trace id.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

HEADER = "traceparent"
MAX_LENGTH = 512
_FORMAT = re.compile(r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)")


@dataclass(frozen=True)
class Trace:
    """The request's trace: ``trace_id`` (32 hex), the caller's span (``parent_id``, None
    when minted) and where the id came from."""

    trace_id: str
    parent_id: str | None
    source: Literal["traceparent", "minted"]


def parse(values: Sequence[str]) -> tuple[str, str] | None:
    """``(trace_id, parent_id)`` from the header's values, or None when it must be ignored
    (absent, repeated or malformed)."""
    if len(values) != 1 or len(values[0]) > MAX_LENGTH or "," in values[0]:
        return None
    match = _FORMAT.fullmatch(values[0])
    if match is None:
        return None
    version, trace_id, parent_id, _flags, rest = match.groups()
    if trace_id == "0" * 32 or parent_id == "0" * 16 or version == "ff" or (version == "00" and rest):
        return None
    return trace_id, parent_id


def mint() -> str:
    """A new random trace id (never all zeros)."""
    return uuid.uuid4().hex


def trace_of(headers: Mapping[str, str | Sequence[str]]) -> Trace:
    """The request's trace from its (lower-cased) headers. A value may be one string or
    the list of every value sent; a comma-joined value (how HTTP combines a repeated
    field) is repeated too, so a repeated header is ignored either way."""
    raw = headers.get(HEADER)
    values: Sequence[str] = () if raw is None else ([raw] if isinstance(raw, str) else raw)
    parsed = parse(values)
    if parsed is None:
        return Trace(mint(), None, "minted")
    return Trace(parsed[0], parsed[1], "traceparent")
