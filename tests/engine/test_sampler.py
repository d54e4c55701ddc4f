"""The sampler: greedy, the top-k/top-p filters and the sampling distribution."""

from __future__ import annotations

import torch

from millm_core.engine import SamplingParams
from millm_engines.transformers.sampler import apply_biases, sample


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams(temperature=0.0)] * 4, [0] * 4) == logits.argmax(-1).tolist()


def test_greedy_ties_pick_the_first_maximum() -> None:
    """Tied maxima resolve to the lowest index, as ``argmax`` does, in all-greedy calls
    and in greedy rows among sampled ones."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 4, (6, 300), generator=generator).float()
    logits[0] = 1.0  # every token tied
    want = [int(torch.nonzero(row == row.max())[0]) for row in logits]
    assert sample(logits, [SamplingParams(temperature=0.0)] * 6, [0] * 6) == want
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    picked = sample(logits, mixed, [0] * 6)
    assert [picked[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    want = logits.argmax(-1).tolist()
    for pos in range(20):
        assert sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=pos)] * 3, [pos] * 3) == want
        assert sample(logits, [SamplingParams(temperature=1.5, top_p=1e-9, seed=pos)] * 3, [pos] * 3) == want


def test_frequencies_follow_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits / 0.7, -1)[0].tolist()
    counts = [0, 0, 0, 0]
    draws = 8000
    for pos in range(draws):
        counts[sample(logits, [SamplingParams(temperature=0.7, seed=5)], [pos])[0]] += 1
    for c, p in zip(counts, probs):
        # 5 standard deviations of a binomial proportion.
        assert abs(c / draws - p) < 5 * (p * (1 - p) / draws) ** 0.5 + 1e-9


def test_top_k_and_top_p_never_pick_excluded_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    for pos in range(500):
        assert sample(logits, [SamplingParams(temperature=2.0, top_k=2, seed=1)], [pos])[0] in (0, 1)
        # The two best tokens hold well over half the mass: top_p=0.5 keeps only them.
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.5, seed=1)], [pos])[0] in (0, 1)


def test_biases_shift_only_their_row() -> None:
    logits = torch.zeros(2, 5)
    apply_biases(logits, [{3: 5.0}, None])
    assert logits[0, 3] == 5.0 and logits[1].abs().sum() == 0
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])[0] == 3
