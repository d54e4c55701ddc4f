"""Whole-input forward passes outside generation: next-token scores, pooled embeddings and
one block's residual stream (no KV cache, no sampling).

Each input runs in a pass of its own, so what it gets is a function of that input alone.
A padded batch would make it depend on the inputs sent with it: bf16 attention reduces
over the masked padding in another order, and float32 products pick their kernels by
row count. A score, an embedding or a probe's reading must not change with its company
(measured on SmolLM2 in bf16: an embedding moved by up to 0.1 beside a longer input).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch


class _Stop(Exception):
    """Raised by a forward hook to end a pass after the block it reads."""


def _ids(seq: Sequence[int], device: Any) -> torch.Tensor:
    return torch.tensor([list(seq)], dtype=torch.long, device=device)


@torch.inference_mode()
def last_logits(model: Any, prompts: Sequence[Sequence[int]]) -> Any:
    """The next-token logits after each prompt (float32, ``[prompts, vocab]`` numpy), last
    position only, on whichever device ``model`` lives (a float32 copy may live elsewhere)."""
    device = next(model.parameters()).device
    out = [model(input_ids=_ids(prompt, device), use_cache=False, logits_to_keep=1).logits[:, -1, :].float().cpu() for prompt in prompts]
    return torch.cat(out).numpy()


@torch.inference_mode()
def embed(model: Any, inputs: Sequence[Sequence[int]], pooling: str, device: Any) -> list[list[float]]:
    """Pooled last hidden states: the ``last`` token's, the first's (``cls``), or the mean."""
    base = model.base_model
    vectors: list[list[float]] = []
    for seq in inputs:
        hidden = base(input_ids=_ids(seq, device)).last_hidden_state[0].float()
        pooled = hidden[-1] if pooling == "last" else hidden[0] if pooling == "cls" else hidden.sum(0) / len(seq)
        vectors.append(pooled.cpu().tolist())
    return vectors


def residuals(model: Any, inputs: Sequence[Sequence[int]], layer: int, device: Any) -> list[Any]:
    """Block ``layer``'s output per position (float32 numpy, one array per input); the
    blocks after ``layer`` are not run."""
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
        for seq in inputs:
            captured.clear()
            with contextlib.suppress(_Stop), torch.inference_mode():
                model.model(input_ids=_ids(seq, device))
            out.append(captured[0][0].cpu().numpy().copy())
    finally:
        handle.remove()
    return out
