"""Sampling one row's llama.cpp logits in numpy, with the same rule as the transformers
engine: greedy at temperature 0; otherwise temperature, then top-k, then top-p (the
smallest prefix whose mass reaches it), and the token picked by inverse CDF with a
uniform draw from :func:`millm_core.rng.uniform` keyed by (seed, stream, position)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from millm_core.api import SamplingParams, uniform


def sample_row(
    logits: np.ndarray, params: SamplingParams, position: int, bias: Mapping[int, float] | None = None, allowed: Any = None
) -> int:
    """One token from ``logits`` [vocab] float32 (modified in place by ``bias``); with
    ``allowed`` (token ids) every other token is excluded."""
    if bias:
        ids = np.fromiter(bias.keys(), dtype=np.int64)
        logits[ids] += np.fromiter(bias.values(), dtype=np.float32)
    if allowed is not None:
        ids = np.asarray(allowed, dtype=np.int64)
        masked = np.full_like(logits, -np.inf)
        masked[ids] = logits[ids]
        logits = masked
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k is not None and params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    cum = np.cumsum(sorted_probs)
    keep = (cum - sorted_probs) < params.top_p
    keep[0] = True
    kept = sorted_probs * keep
    cum = np.cumsum(kept)
    target = uniform(params.seed, params.stream, position) * cum[-1]
    choice = min(int(np.searchsorted(cum, target, side="right")), int(keep.sum()) - 1)
    return int(order[choice])
