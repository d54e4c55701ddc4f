"""The intensity dial and the report's encoding, as pure functions."""

from __future__ import annotations

import http_sfv
from hypothesis import given
from hypothesis import strategies as st

from millm_core.steering import AppliedSet
from millm_plugins.steering.apply import Entry, Plan, percent_encode, report
from millm_plugins.steering.intensity import parse, resolve

lams = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
ranges = st.none() | st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0)).map(lambda r: (min(r), max(r)))


@given(lams, ranges, st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_a_numeric_dial_is_capped_never_raised(lam: float, declared: tuple[float, float] | None, a: float, b: float) -> None:
    value, problems = parse(lam)
    assert not problems
    floor, ceiling = sorted((a, b))
    resolved = resolve(value, declared, floor, ceiling)
    assert 0.0 <= resolved <= 2.0
    assert resolved <= lam  # a cap only lowers λ; dialing below the floor is honoured as sent


@given(ranges)
def test_symbols_resolve_inside_the_envelope_and_off_is_zero(declared: tuple[float, float] | None) -> None:
    low, high = resolve("min", declared, 0.5, 2.0), resolve("max", declared, 0.5, 2.0)
    assert 0.0 <= low <= high <= 2.0
    assert resolve("off", declared, 0.5, 2.0) == 0.0 == resolve(0.0, declared, 0.5, 2.0)


def test_invalid_dials_are_problems() -> None:
    for bad in (2.01, -0.5, "loud", True, float("nan"), None):
        assert parse(bad)[1], bad


def test_report_members_parse_as_rfc8941_and_encode_names() -> None:
    profile = Entry("profile", "sae-a", 3, AppliedSet.build("sae-a", [(1, 500.0)]), name='ça "va" 100%', source="active", intensity=0.75)
    manual = Entry("manual", "sae-b", 1, AppliedSet.build("sae-b", [(2, 1.0)]))
    value = report(Plan(entries=(manual, profile)), changed=True)
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    members = [(str(m.value), dict(m.params)) for m in parsed]
    assert [k for k, _ in members] == ["manual", "profile"]
    assert all(p["changed"] is True for _, p in members)
    assert members[1][1]["name"] == "%C3%A7a %22va%22 100%25" == percent_encode('ça "va" 100%')
    assert (members[1][1]["intensity"], members[1][1]["clamped"]) == ("0.75", 1)
    assert report(Plan(unknown="profile_unreadable"), changed=False) == "unknown;reason=profile_unreadable"
    assert report(Plan(), changed=True) == "none;changed"
