"""Taking back a row's latest tokens (the rewind capability) on the transformers engine.

A batch's rows share cache columns, right-aligned: a row holds its fed tokens in the
columns ``[start, length)``, the mask hiding those to the left (no mask: every row starts
at 0). Rewinding a row by k drops its last k columns: its kept columns move right by k, the
mask hides the k columns freed at its left, and columns no row uses any more are cut from
the left of the cache (a view, no copy). Both paths attend over each row's own columns (the
lean decode step by construction, the generic HF forward through :mod:`.rows`), so the move
changes nothing the row computes. (A generic model attending without SDPA masks the freed
columns instead, which changes the row's sums by rounding, more in bfloat16: there a row is
exact when alone, its freed columns then all cut.)

A row taken back to its prompt (``k == n``) re-feeds its last prompt token through a decode
step, which reproduces the prefill's key, value and logits for that token only to rounding
(one column's products instead of the prompt's). So the step's logits for the row are
replaced by the prefill's (kept when the row was prefilled) and the column it wrote by the
prefill's key and value: the row then goes on exactly as after its prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from .engine import HFBatch


@dataclass
class PromptEnd:
    """The key and value (per layer, ``[kv_heads, head_dim]``) the prefill computed for a
    row's last prompt token, written back after the next step re-fed it."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def refusal(config: Any) -> str | None:
    """Why the generic HF forward cannot rewind rows of a model with ``config`` (None: it
    can): a sliding-window layer has forgotten what a row would need back, and a recurrent
    one keeps no per-token entries to drop."""
    odd = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer})
    return f"the model's cache has layers that cannot take tokens back ({', '.join(odd)})" if odd else None


def _stores(batch: HFBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Per-layer keys and values ``[rows, kv_heads, columns, head_dim]`` (in place) and the
    number of filled columns."""
    if batch.kv is not None:
        return batch.kv.keys, batch.kv.values, batch.kv.length
    assert batch.cache is not None
    layers: list[Any] = list(batch.cache.layers)
    length = batch.cache.get_seq_length()
    if any(type(layer) is not DynamicLayer for layer in layers) or any(layer.keys.shape[2] != length for layer in layers):
        raise RuntimeError("this model's cache cannot take tokens back (the engine does not declare rewind)")
    return [layer.keys for layer in layers], [layer.values for layer in layers], length


def _filled(batch: HFBatch, row: int) -> int:
    """Cache columns row ``row`` fills: its prompt and draws but the last (not fed yet)."""
    return len(batch.prompts[row]) + len(batch.drawn[row]) - 1


def rewind(batch: HFBatch, row: int, k: int) -> None:
    """Take back row ``row``'s last ``k`` draws (see :class:`millm_core.api.Rewinding`)."""
    if not 0 <= row < batch.size:
        raise ValueError(f"row {row} is not among the batch's {batch.size} stepped rows")
    n = len(batch.drawn[row])
    if not 1 <= k <= n:
        raise ValueError(f"row {row} drew {n} tokens: rewind takes back 1 to {n} of them, not {k}")
    assert batch.next_pos is not None and batch.last_tokens is not None and batch.draw_pos is not None
    keys, values, length = _stores(batch)
    start = length - _filled(batch, row)
    if k == n:  # back to the prompt: keep its last token's prefill key and value
        col = start + len(batch.prompts[row]) - 1
        batch.refill[row] = PromptEnd([t[row, :, col].clone() for t in keys], [t[row, :, col].clone() for t in values])
    if length - k > start:
        for store in (keys, values):
            for t in store:
                t[row, :, start + k : length] = t[row, :, start : length - k].clone()
    mask = batch.mask if batch.mask is not None else torch.ones((batch.size, length), dtype=torch.long, device=keys[0].device)
    mask = mask.clone()
    mask[row, : start + k] = 0
    batch.mask = mask
    batch.drawn[row] = batch.drawn[row][: n - k]
    fed = batch.drawn[row][-1] if batch.drawn[row] else batch.prompts[row][-1]
    last, pos = batch.last_tokens.clone(), batch.next_pos.clone()
    last[row], pos[row] = fed, pos[row] - k
    batch.last_tokens, batch.next_pos = last, pos
    batch.draw_pos = [p - k if r == row else p for r, p in enumerate(batch.draw_pos)]
    _cut_unused_columns(batch, length)


def _cut_unused_columns(batch: HFBatch, length: int) -> None:
    """Drop the left columns no row uses (after a rewind, the rewound row's, when it was
    the longest), so the cache is as wide as its longest row, as a batch that never
    rewound; a mask left all ones goes (the unmasked path, as then)."""
    cut = min(length - _filled(batch, r) for r in range(batch.size))
    if cut > 0:
        if batch.kv is not None:
            batch.kv.keys = [t[:, :, cut:] for t in batch.kv.keys]
            batch.kv.values = [t[:, :, cut:] for t in batch.kv.values]
            batch.kv.length = length - cut
        else:
            assert batch.cache is not None
            layers: list[Any] = list(batch.cache.layers)  # plain layers (checked by _stores)
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
        assert batch.mask is not None
        batch.mask = batch.mask[:, cut:]
    if batch.mask is not None and bool(batch.mask.bool().all()):
        batch.mask = None


def refeed_prompt_ends(batch: HFBatch, logits: torch.Tensor) -> None:
    """After a decode step: rows rewound to their prompt get their prefill's logits and,
    in the column the step wrote, their prefill's key and value (see the module's doc)."""
    if not batch.refill:
        return
    keys, values, length = _stores(batch)
    for row, end in batch.refill.items():
        for store, saved in ((keys, end.keys), (values, end.values)):
            for t, column in zip(store, saved, strict=True):
                t[row, :, length - 1] = column
        logits[row] = batch.first_logits[row]
    batch.refill = {}


def select(batch: HFBatch, keep: Sequence[int]) -> None:
    """The rewind state of the rows ``keep`` (in order), as :meth:`retain` keeps them."""
    batch.drawn = [batch.drawn[i] for i in keep]
    batch.first_logits = [batch.first_logits[i] for i in keep]
    if batch.refill:
        moved = {old: new for new, old in enumerate(keep)}
        batch.refill = {moved[r]: end for r, end in batch.refill.items() if r in moved}
