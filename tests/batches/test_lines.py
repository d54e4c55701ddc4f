"""How a Batch API input file is split into lines before it is checked: every byte is
accounted for (the offsets of later reads depend on it), and a line longer than one
request body may be is reported by its length, never held whole."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from millm_plugins.batches.lines import Oversized, check_lines, read_lines

LIMIT = 10


def split(data: bytes, limit: int = LIMIT) -> list[bytes | Oversized]:
    return list(read_lines(io.BytesIO(data), limit))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"ab\ncd", [b"ab\n", b"cd"]),  # no final break
        (b"x" * 10 + b"\n", [b"x" * 10 + b"\n"]),  # exactly the limit
        (b"x" * 10 + b"\r\n", [b"x" * 10 + b"\r\n"]),  # exactly the limit, CRLF
        (b"x" * 10, [b"x" * 10]),  # exactly the limit, the last line
        (b"x" * 11 + b"\n" + b"y\n", [Oversized(12), b"y\n"]),  # one past it
        (b"x" * 11, [Oversized(11)]),  # one past it, the last line
        (b"x" * 12, [Oversized(12)]),  # a read of limit + 2 bytes that is the whole file
        (b"x" * 10 + b"\r\rmore\n" + b"y\n", [Oversized(17), b"y\n"]),  # a read ending in \r\r is not a line's end
        (b"z" * 5000 + b"\nw\n", [Oversized(5001), b"w\n"]),
    ],
)
def test_lines_and_oversized_lines(data: bytes, expected: list[bytes | Oversized]) -> None:
    assert split(data) == expected


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from([b"\n", b"\r\n", b"\r", b""])), max_size=8))
def test_every_byte_is_accounted_for_and_no_line_is_cut(parts: list[tuple[int, bytes]]) -> None:
    data = b"".join(b"x" * n + end for n, end in parts)
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]  # the last piece has no break of its own
    lines = [line for line in lines if line]
    expected = [line if len(line.rstrip(b"\r\n")) <= LIMIT else Oversized(len(line)) for line in lines]
    assert split(data) == expected


def test_check_lines_refuses_an_oversized_line_by_number_and_keeps_offsets() -> None:
    body = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    data = body + b"y" * 500 + b"\n" + body.replace(b'"a"', b'"b"')
    checked = check_lines(read_lines(io.BytesIO(data), 200), "/v1/completions", 10, 200)
    assert [(e.line, e.code) for e in checked.errors] == [(2, "line_too_long")] and checked.lines == []  # nothing runs
    clean = body + b"\r\n" + body.replace(b'"a"', b'"b"').replace(b"\n", b"\r\n") + body.replace(b'"a"', b'"c"')
    checked = check_lines(read_lines(io.BytesIO(clean), 200), "/v1/completions", 10, 200)
    assert [(line.number, clean[line.offset : line.offset + line.length]) for line in checked.lines] == [
        (1, body),
        (3, body.replace(b'"a"', b'"b"').replace(b"\n", b"\r\n")),
        (4, body.replace(b'"a"', b'"c"')),
    ]
