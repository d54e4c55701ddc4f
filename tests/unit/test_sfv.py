"""Header values serialise as RFC 8941, checked with an independent parser (http-sfv)."""

from __future__ import annotations

import http_sfv
from hypothesis import given
from hypothesis import strategies as st

from millm_core.sfv import percent_encode_nonprintable, string_list


def parse_strings(value: str) -> list[str]:
    parsed = http_sfv.List()
    parsed.parse(value.encode("ascii"))
    return [item.value for item in parsed]


@given(st.lists(st.text(max_size=30), max_size=20))
def test_string_list_round_trips_through_independent_parser(items: list[str]) -> None:
    if not items:
        return
    value = string_list(items)
    assert parse_strings(value) == [percent_encode_nonprintable(i) for i in items]


@given(st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=80))
def test_capped_list_fits_and_counts_what_it_dropped(items: list[str]) -> None:
    value = string_list(items, max_bytes=1024)
    assert len(value.encode()) <= 1024
    parsed = parse_strings(value)
    if parsed[-1].startswith("+") and parsed[-1].endswith(" more") and len(parsed) - 1 < len(items):
        dropped = int(parsed[-1][1:-5])
        assert len(parsed) - 1 + dropped == len(items)
    else:
        assert len(parsed) == len(items)


def test_nonprintable_and_percent_are_encoded() -> None:
    assert percent_encode_nonprintable("a\u00e9%\n") == "a%C3%A9%25%0A"
