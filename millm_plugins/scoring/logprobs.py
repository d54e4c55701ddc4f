"""Next-token log-probabilities from one row of logits (numpy, engine-agnostic).

With ``allowed`` ids the distribution is renormalised over that set alone, so every listed
token gets a log-probability. Temperature divides the logits first (0 means no scaling).
Non-finite values that reach the answer are refused, never reported: NaN or +inf on an
allowed token (anywhere, when nothing is restricted), or a reported token at -inf. A -inf
outside the allowed set is fine (padded vocabularies are masked that way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from millm_core.api import NonFiniteLogits


@dataclass(frozen=True)
class Scored:
    """The chosen token and the candidates to report, both as (id, logprob)."""

    best: tuple[int, float]
    candidates: list[tuple[int, float]]


def score_row(logits: np.ndarray, allowed: Sequence[int] | None, temperature: float, top: int | None) -> Scored:
    """``top``: how many candidates to report (None: all allowed ids, or none)."""
    row = logits.astype(np.float64)
    ids = np.asarray(allowed, dtype=np.int64) if allowed is not None else np.arange(row.shape[0])
    values = row[ids]
    if np.isnan(values).any() or np.isposinf(values).any():
        raise NonFiniteLogits("the model produced NaN or +inf logits where they reach the answer")
    if temperature > 0:
        values = values / temperature
    peak = values.max()
    if not np.isfinite(peak):
        raise NonFiniteLogits("every candidate token has a -inf logit")
    logz = peak + np.log(np.exp(values - peak).sum())
    logprobs = values - logz
    # Order by the logits themselves: values that differ by less than float64 resolution
    # after normalisation (a subnormal against 0.0) must still rank as the logits do.
    order = np.argsort(-values, kind="stable")
    best = int(order[0])
    count = len(order) if top is None else min(top, len(order))
    candidates = [(int(ids[i]), float(logprobs[i])) for i in order[:count]]
    for token, logprob in [(int(ids[best]), float(logprobs[best])), *candidates]:
        if not np.isfinite(logprob):
            raise NonFiniteLogits(f"token {token} would be reported with a -inf log-probability")
    return Scored(best=(int(ids[best]), float(logprobs[best])), candidates=candidates)
