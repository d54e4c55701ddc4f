"""Whole-input forward passes outside generation: next-token scores, pooled embeddings and
one block's residual stream, over batches of padded inputs (no KV cache, no sampling)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

EMBED_BATCH = 16
SCORE_BATCH = 64


class _Stop(Exception):
    """Raised by a forward hook to end a pass after the block it reads."""


def last_logits(model: Any, prompts: Sequence[Sequence[int]], pad_id: int) -> Any:
    """The next-token logits after each prompt (float32, ``[prompts, vocab]`` numpy): one
    left-padded forward pass per ``SCORE_BATCH`` prompts, last position only, on whichever
    device ``model`` lives (a float32 copy may live elsewhere)."""
    out = []
    for start in range(0, len(prompts), SCORE_BATCH):
        chunk = prompts[start : start + SCORE_BATCH]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        padded = any(len(p) != width for p in chunk)
        device = next(model.parameters()).device
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device) if padded else None,
            position_ids=positions.to(device),
            use_cache=False,
            logits_to_keep=1,
        ).logits[:, -1, :]
        out.append(logits.float().cpu())
    return torch.cat(out).numpy()


def right_padded(chunk: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention mask)`` for sequences padded on the right."""
    width = max(len(seq) for seq in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, seq in enumerate(chunk):
        ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


@torch.inference_mode()
def embed(model: Any, inputs: Sequence[Sequence[int]], pooling: str, pad_id: int, device: Any) -> list[list[float]]:
    """Pooled last hidden states (``last``, ``cls`` or mean), right-padded batches of
    ``EMBED_BATCH``."""
    base = model.base_model
    vectors: list[list[float]] = []
    for start in range(0, len(inputs), EMBED_BATCH):
        chunk = inputs[start : start + EMBED_BATCH]
        lengths = torch.tensor([len(ids) for ids in chunk])
        ids, mask = right_padded(chunk, pad_id)
        hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        if pooling == "last":
            pooled = hidden[torch.arange(len(chunk)), lengths - 1]
        elif pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.to(hidden.device, hidden.dtype)[..., None]
            pooled = (hidden * weights).sum(1) / weights.sum(1)
        vectors.extend(pooled.cpu().tolist())
    return vectors


def residuals(model: Any, inputs: Sequence[Sequence[int]], layer: int, pad_id: int, device: Any) -> list[Any]:
    """Block ``layer``'s output per position (float32 numpy, one array per input),
    right-padded batches of ``EMBED_BATCH``; the blocks after ``layer`` are not run."""
    blocks = model.model.layers
    if not 0 <= layer < len(blocks):
        raise ValueError(f"layer {layer} is outside 0..{len(blocks) - 1}")
    out: list[Any] = []
    captured: list[torch.Tensor] = []

    def grab(module: Any, args: Any, output: Any) -> Any:
        captured.append((output[0] if isinstance(output, tuple) else output).float())
        raise _Stop

    handle = blocks[layer].register_forward_hook(grab)
    try:
        for start in range(0, len(inputs), EMBED_BATCH):
            chunk = inputs[start : start + EMBED_BATCH]
            ids, mask = right_padded(chunk, pad_id)
            captured.clear()
            with contextlib.suppress(_Stop), torch.inference_mode():
                model.model(input_ids=ids.to(device), attention_mask=mask.to(device))
            hidden = captured[0].cpu().numpy()
            out.extend(hidden[row, : len(seq)].copy() for row, seq in enumerate(chunk))
    finally:
        handle.remove()
    return out
