"""Property tests: the circuit dial rule, and the header members the steering plugin writes
for circuits (parsed back with http-sfv, whatever the id and λ)."""

from __future__ import annotations

import http_sfv
from hypothesis import given
from hypothesis import strategies as st

from millm_plugins.circuits.ladder import LADDER, header_value
from millm_plugins.steering.apply import Plan, report
from millm_plugins.steering.contrib import CircuitMember
from millm_plugins.steering.intensity import clamped_bounds, resolve_clamped

from .helpers import LADDER as SPEC_LADDER
from .helpers import members, rung

fractions = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
ranges = st.none() | st.tuples(fractions, fractions).map(lambda pair: (min(pair), max(pair)))


@given(dial=st.one_of(fractions, st.sampled_from(["off", "min", "max"])), declared=ranges, floor=fractions, ceiling=fractions)
def test_the_circuit_rule_clamps_both_ends_and_only_off_goes_below(dial, declared, floor, ceiling) -> None:  # type: ignore[no-untyped-def]
    lam = resolve_clamped(dial, declared, floor, ceiling)
    low, high = clamped_bounds(declared, floor, ceiling)
    if dial == "off" or dial == 0.0:
        assert lam == 0.0
    else:
        assert low <= lam <= high  # never below the floor, never above the ceiling
        assert 0.0 <= lam <= 2.0
    if declared is not None and dial not in ("off", 0.0):
        assert lam >= min(max(declared[0], floor), high)


def test_min_is_off_without_a_declared_range_and_the_default_floor() -> None:
    assert resolve_clamped("min", None, 0.0, 2.0) == 0.0 == resolve_clamped("off", None, 0.0, 2.0)
    assert resolve_clamped(0.1, (0.5, 1.5), 0.0, 2.0) == 0.5  # the specification's example


ids = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=24)


@given(
    circuits=st.lists(
        st.tuples(ids, st.floats(min_value=0.0, max_value=2.0, allow_nan=False), st.booleans()),
        min_size=1,
        max_size=4,
        unique_by=lambda c: c[0],
    ),
    changed=st.booleans(),
)
def test_circuit_members_parse_back_in_order(circuits, changed: bool) -> None:  # type: ignore[no-untyped-def]
    plan = Plan(circuits=tuple(sorted((CircuitMember(id=i, intensity=lam, composed=c) for i, lam, c in circuits), key=lambda m: m.id)))
    parsed = members(report(plan, changed=changed))
    assert [kind for kind, _ in parsed] == ["circuit"] * len(circuits)
    for (_, params), member in zip(parsed, plan.circuits, strict=True):
        assert params["id"] == member.id and float(params["intensity"]) == member.intensity
        assert params.get("composed", False) is member.composed and params.get("changed", False) is changed
        assert list(params)[:2] == ["id", "intensity"]


def test_the_rung_header_is_the_specifications_table() -> None:
    for value in range(4):
        assert LADDER[value][0] == SPEC_LADDER[value]
        assert rung(header_value(value)) == (value, {"language": SPEC_LADDER[value]})
        item = http_sfv.Item()
        item.parse(header_value(value).encode())
        assert str(item.params["language"]) == SPEC_LADDER[value]
