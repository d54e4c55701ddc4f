"""Checking a batch's input file before anything runs.

Every line is parsed and checked as a whole (a JSON object with ``custom_id``, ``method``,
``url`` and ``body``, nothing else): a unique, non-empty ``custom_id``, ``method``
``POST``, ``url`` equal to the batch's endpoint, ``body`` a JSON object. Any problem fails
the batch, each one named by its line number (1-based, blank lines counted and skipped).
What a body asks for (its model, its fields' values) is checked when the line runs, by the
endpoint itself, and an error there goes to the batch's error file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgspec

from .objects import BatchError

MAX_ERRORS = 100
"""Validation errors reported at most (the first ones, by line)."""
LINE_KEYS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class Line:
    """A checked line: where it is in the input file, and its ``custom_id``."""

    number: int
    custom_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Oversized:
    """A line longer than one request body may be, read past without being kept."""

    length: int


def read_lines(source: BinaryIO, limit: int) -> Iterator[bytes | Oversized]:
    """``source``'s lines, each with its line break, as a binary file iterates them; a line
    whose content (without its break) is longer than ``limit`` bytes comes as
    :class:`Oversized`, so a batch file of one huge line is never held in memory."""
    while raw := source.readline(limit + 2):  # room for the content and a CRLF
        # A read that filled its limit without reaching a line break is part of a longer line
        # (content of limit bytes and its CRLF would end in the break).
        whole = raw.endswith(b"\n") or len(raw) < limit + 2
        if whole and len(raw.rstrip(b"\r\n")) <= limit:
            yield raw
            continue
        length = len(raw)
        while not raw.endswith(b"\n") and (raw := source.readline(1 << 20)):
            length += len(raw)
        yield Oversized(length)


@dataclass
class Checked:
    """The input file's lines, or why the batch fails; ``model`` is the one model every
    line names, if they all name the same."""

    lines: list[Line] = field(default_factory=list)
    errors: list[BatchError] = field(default_factory=list)
    model: str | None = None

    def fail(self, error: BatchError) -> None:
        """Add a problem (the first :data:`MAX_ERRORS` are kept)."""
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)


def _check(obj: Any, number: int, url: str, seen: dict[str, int]) -> list[BatchError]:
    if not isinstance(obj, dict):
        return [BatchError(code="invalid_json_line", line=number, message=f"line {number} is not a JSON object")]
    problems: list[BatchError] = []
    for key in obj:
        if key not in LINE_KEYS:
            problems.append(
                BatchError(
                    code="unknown_parameter",
                    line=number,
                    param=key,
                    message=f"line {number} has an unknown field {key!r}: a line has custom_id, method, url and body",
                )
            )
    for key in LINE_KEYS:
        if key not in obj:
            problems.append(BatchError(code="missing_required_parameter", line=number, param=key, message=f"line {number} has no {key!r}"))
    custom_id = obj.get("custom_id")
    if "custom_id" in obj and (not isinstance(custom_id, str) or not custom_id):
        problems.append(
            BatchError(
                code="invalid_custom_id", line=number, param="custom_id", message=f"line {number}: custom_id must be a non-empty string"
            )
        )
    elif isinstance(custom_id, str) and custom_id in seen:
        problems.append(
            BatchError(
                code="duplicate_custom_id",
                line=number,
                param="custom_id",
                message=f"line {number} repeats the custom_id {custom_id!r} of line {seen[custom_id]}",
            )
        )
    if "method" in obj and obj["method"] != "POST":
        problems.append(
            BatchError(
                code="invalid_method", line=number, param="method", message=f'line {number}: method must be "POST", not {obj["method"]!r}'
            )
        )
    if "url" in obj and obj["url"] != url:
        problems.append(
            BatchError(
                code="invalid_url",
                line=number,
                param="url",
                message=f"line {number}: url is {obj['url']!r}, but this batch's endpoint is {url!r}",
            )
        )
    if "body" in obj and not isinstance(obj["body"], dict):
        problems.append(BatchError(code="invalid_body", line=number, param="body", message=f"line {number}: body must be a JSON object"))
    return problems


def check_lines(raw_lines: Iterable[bytes | Oversized], url: str, max_lines: int, max_line_bytes: int | None = None) -> Checked:
    """Check the input file, given as its raw lines (each with its line break, as a binary
    file iterates, or as :func:`read_lines` gives them), for a batch whose endpoint is
    ``url``. A line is one request body: longer than ``max_line_bytes`` (the server's
    ``--max-body-bytes``), it is refused as a request that long would be."""
    result = Checked()
    seen: dict[str, int] = {}
    models: set[str] = set()
    offset = 0
    number = 0
    for number, raw in enumerate(raw_lines, start=1):
        if isinstance(raw, Oversized) or max_line_bytes is not None and len(raw.rstrip(b"\r\n")) > max_line_bytes:
            length = raw.length if isinstance(raw, Oversized) else len(raw)
            offset += length
            result.fail(
                BatchError(
                    code="line_too_long",
                    line=number,
                    message=f"line {number} is {length} bytes, over the {max_line_bytes} bytes a request body may have (--max-body-bytes)",
                )
            )
            continue
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            result.fail(BatchError(code="invalid_json_line", line=number, message=f"line {number} is not valid JSON ({exc})"))
            continue
        except RecursionError:  # nested deeper than the interpreter's recursion limit
            result.fail(BatchError(code="invalid_json_line", line=number, message=f"line {number} is nested too deeply to decode"))
            continue
        problems = _check(obj, number, url, seen)
        for problem in problems:
            result.fail(problem)
        if problems:
            continue
        seen[obj["custom_id"]] = number
        model = obj["body"].get("model")
        models.add(model if isinstance(model, str) else "")
        result.lines.append(Line(number=number, custom_id=obj["custom_id"], offset=start, length=len(raw)))
    if not result.lines and not result.errors:
        result.fail(BatchError(code="empty_file", message="the input file has no request lines"))
    elif len(seen) > max_lines:
        result.fail(
            BatchError(
                code="too_many_requests",
                message=f"the input file has {len(seen)} request lines; this server takes at most {max_lines} (--batch-max-lines)",
            )
        )
    if result.errors:
        result.lines = []
    elif len(models) == 1 and "" not in models:
        result.model = models.pop()
    return result
