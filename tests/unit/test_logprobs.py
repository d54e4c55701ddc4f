"""Scoring math: normalisation over the allowed set, temperature, non-finite rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from millm_core.api import NonFiniteLogits
from millm_plugins.scoring.logprobs import score_row


@given(arrays(np.float32, 50, elements=st.floats(-30, 30, width=32)), st.sets(st.integers(0, 49), min_size=1, max_size=10))
@example(np.array([-1.1754944e-38, 0.0] + [-30.0] * 48, dtype=np.float32), {0, 1})  # a subnormal against 0.0
def test_allowed_set_sums_to_one_and_best_is_argmax(logits: np.ndarray, allowed: set[int]) -> None:
    ids = sorted(allowed)
    scored = score_row(logits, ids, 0.0, None)
    assert {t for t, _ in scored.candidates} == set(ids)
    assert math.isclose(sum(math.exp(lp) for _, lp in scored.candidates), 1.0, abs_tol=1e-9)
    assert logits[scored.best[0]] == max(logits[i] for i in ids)


def test_temperature_divides_logits() -> None:
    logits = np.array([2.0, 0.0], dtype=np.float32)
    scored = score_row(logits, None, 0.5, 2)
    expected = 4.0 - math.log(math.exp(4.0) + 1.0)
    assert math.isclose(scored.best[1], expected, rel_tol=1e-12)


def test_non_finite_rules() -> None:
    nan_outside = np.array([1.0, np.nan, 0.5], dtype=np.float32)
    assert score_row(nan_outside, [0, 2], 0.0, None).best[0] == 0  # outside the set: fine
    with pytest.raises(NonFiniteLogits):
        score_row(nan_outside, None, 0.0, 1)  # unrestricted: NaN reaches the answer
    with pytest.raises(NonFiniteLogits):
        score_row(np.array([1.0, np.inf], dtype=np.float32), [0, 1], 0.0, None)
    masked = np.array([1.0, -np.inf, 0.5], dtype=np.float32)
    assert score_row(masked, None, 0.0, 2).best[0] == 0  # -inf not reported: fine
    with pytest.raises(NonFiniteLogits):
        score_row(masked, [0, 1], 0.0, None)  # a reported token at -inf
