"""Batched sampling on torch logits with counter-based draws.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p,
and pick the token by inverse CDF with a uniform draw from
:func:`millm_core.rng.uniform` keyed by (seed, stream, position): the choice depends on
the row's own logits and counters only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from millm_core.api import SamplingParams, uniform


def apply_biases(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> None:
    """Add each row's sparse bias to its logits, in place."""
    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=logits.device)
            vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, vals)


def apply_masks(logits: torch.Tensor, allowed: Sequence[Any]) -> None:
    """Keep only each constrained row's allowed token ids (the rest become ``-inf``), in
    place; a row whose entry is None is untouched."""
    for row, ids in enumerate(allowed):
        if ids is None:
            continue
        index = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
        kept = logits[row].index_select(0, index)
        logits[row].fill_(float("-inf"))
        logits[row].index_copy_(0, index, kept)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest logit: ``argmax``'s answer, from
    ``max(dim)``'s indices, which return the first maximum too and run about three times
    faster on the CPU (82 against 250 us for 8 rows of a 49k vocabulary, measured)."""
    return logits.max(dim=-1).indices.tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
) -> list[int]:
    """One token per row. ``logits`` is [rows, vocab] float32; ``positions[i]`` is the
    absolute position of the token being drawn for row i."""
    if all(p.greedy for p in params):
        return _argmax(logits)
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        picked = _argmax(logits[greedy])
        for i, tok in zip(greedy, picked, strict=True):
            out[i] = tok
    rows = [i for i, p in enumerate(params) if not p.greedy]
    sub = logits[rows]
    temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype, device=sub.device)
    sub = sub / temps[:, None]
    ks = [params[i].top_k for i in rows]
    if any(k is not None for k in ks):
        vocab = sub.shape[-1]
        kmax = min(max(k or vocab for k in ks), vocab)
        top_vals = sub.topk(kmax, dim=-1).values
        kth = torch.stack([top_vals[r, min(k or vocab, vocab) - 1] if k else sub[r].min() for r, k in enumerate(ks)])
        sub = sub.masked_fill(sub < kth[:, None], float("-inf"))
    probs = torch.softmax(sub, dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    cum = sorted_probs.cumsum(dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=cum.dtype, device=cum.device)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = (cum - sorted_probs) < top_p[:, None]
    keep[:, 0] = True
    sorted_probs = sorted_probs * keep
    cum = sorted_probs.cumsum(dim=-1)
    draws = torch.tensor(
        [uniform(params[i].seed, params[i].stream, positions[i]) for i in rows],
        dtype=cum.dtype,
        device=cum.device,
    )
    target = (draws * cum[:, -1])[:, None]
    choice = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[-1] - 1)
    # A zero-probability slot can only be hit through rounding at the very end; step back
    # to the last kept token.
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    choice = torch.minimum(choice, last_kept)
    picked = sorted_ids.gather(1, choice).squeeze(1).tolist()
    for i, tok in zip(rows, picked, strict=True):
        out[i] = tok
    return out
