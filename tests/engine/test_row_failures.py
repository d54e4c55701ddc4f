"""A row whose logits go non-finite fails alone: the engine reports it with RowsFailed,
the other rows of the step are sampled exactly as they would be alone."""

from __future__ import annotations

import math

import pytest
import torch

from millm_core.api import RowsFailed
from millm_core.engine import RowSpec, SamplingParams
from millm_engines.transformers.engine import _non_finite_rows

GREEDY = SamplingParams(temperature=0.0)


def test_a_non_finite_row_is_reported_alone(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(tiny_engine.encode("The sea is", add_special_tokens=True))
    d_model = tiny_engine.info.d_model
    solo = tiny_engine.open_batch([RowSpec(prompt_ids=prompt, sampling=GREEDY, max_new_tokens=2)])
    try:
        expected = tiny_engine.step(solo, [None])[0]
    finally:
        tiny_engine.close(solo)
    # An infinite steering delta drives row 1's residual stream, and so its logits, to NaN/inf.
    poisoned = RowSpec(prompt_ids=prompt, sampling=GREEDY, deltas={0: (math.inf,) * d_model}, max_new_tokens=2)
    batch = tiny_engine.open_batch([RowSpec(prompt_ids=prompt, sampling=GREEDY, max_new_tokens=2), poisoned])
    try:
        with pytest.raises(RowsFailed) as info:
            tiny_engine.step(batch, [None, None])
    finally:
        tiny_engine.close(batch)
    assert set(info.value.errors) == {1}
    assert info.value.errors[1].code == "non_finite_logits"  # type: ignore[attr-defined]
    assert info.value.tokens[0] == expected


def test_non_finite_rows_are_found_wherever_they_are() -> None:
    """NaN and either infinity are found at any position; finite logits whose sum
    overflows float32 are not mistaken for them."""
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 0] = math.nan
    logits[2, 999] = math.inf
    logits[3, 500] = -math.inf
    logits[4, 10], logits[4, 20] = math.inf, -math.inf
    logits[5] = 3e38  # finite, but the row sums to inf
    assert _non_finite_rows(logits) == [1, 2, 3, 4]
    assert _non_finite_rows(logits[[0, 5]]) == []
