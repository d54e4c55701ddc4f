"""Continuous batching on the generic HF forward (models without the lean decode step).

A joining request is prefilled on its own, into a ``DynamicCache`` of its own, and its
rows are then appended to the running batch's: per layer the keys and values
(``[rows, kv_heads, columns, head_dim]``) of the shorter of the two are left-padded with
zero columns to the longer length, the attention mask hides those columns, and each row
keeps its own positions (see ``TransformersEngine._merge``).

That is only sound when every cache layer is a plain :class:`DynamicLayer` — one key and
one value tensor holding every fed column, right-aligned across rows. Other layouts keep
state a merge cannot line up: a sliding-window layer has dropped its first columns (and
counts what it dropped), a linear-attention, convolutional or recurrent layer holds a state
per row and no columns, a quantized layer holds packed blocks, a KV-sharing "dummy" layer
holds nothing, and an encoder-decoder model has a cross-attention cache beside it. A model
with such a layer runs one request per batch, and says so (``batches_requests``). The
decision is made once per loaded model (:func:`join_refusal`): from the layers
``DynamicCache(config=…)`` builds for it, then from what a two-token forward pass actually
fills.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def join_refusal(model: Any) -> str | None:
    """Why the rows of ``model`` cannot join a running batch on the generic HF forward
    (None: they can): :func:`layout_refusal` of its config, then a two-token forward into
    a fresh cache, which must leave every layer a plain tensor pair of two columns (a model
    that keeps its state elsewhere, as recurrent ones do, fails it)."""
    config = getattr(model, "config", None)
    reason = layout_refusal(config)
    if reason is not None:
        return reason
    cache = DynamicCache(config=config)
    device = next(model.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], cache=cache, use_cache=True, logits_to_keep=1)
        filled = cache_length(cache)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot fill a plain cache cannot be merged
        return f"a forward pass does not fill a plain key/value cache ({type(exc).__name__}: {exc})"
    return None if filled == 2 else f"a two-token forward pass left {filled} cache columns"


def layout_refusal(config: Any) -> str | None:
    """Why the cache a model with ``config`` fills cannot be merged across requests, from
    its layer types (None: every layer is a plain :class:`DynamicLayer`)."""
    if config is None:
        return "the model has no config"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model's caches cannot be merged"
    try:
        layers = list(DynamicCache(config=config).layers)
    except Exception as exc:  # noqa: BLE001 - a layout transformers cannot build is a layout we cannot merge
        return f"the model's cache layout is unknown ({type(exc).__name__}: {exc})"
    if not layers:
        return "the model's cache declares no layers"
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    return f"the model's cache has layers whose rows cannot be merged ({', '.join(odd)})" if odd else None


def cache_length(cache: DynamicCache) -> int:
    """The columns every layer of a plain cache holds; raises ValueError for a cache whose
    layers are not plain key/value tensors of one length (nothing then may merge it)."""
    layers: list[Any] = list(cache.layers)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        raise ValueError("this batch's cache has layers that cannot be merged")
    length = int(layers[0].keys.shape[2])
    if any(layer.keys.shape[2] != length or layer.values.shape[2] != length for layer in layers):
        raise ValueError("this batch's cache layers hold different numbers of columns")
    return length


def merge_caches(first: DynamicCache, second: DynamicCache) -> int:
    """Append ``second``'s rows to ``first``'s (in place), right-aligned to the longer of
    the two: the shorter one's new left columns are zeros, which the attention mask hides.
    Returns the merged length."""
    la, lb = cache_length(first), cache_length(second)
    length = max(la, lb)
    ours: list[Any] = list(first.layers)
    theirs: list[Any] = list(second.layers)
    if len(ours) != len(theirs):
        raise ValueError(f"caches of {len(ours)} and {len(theirs)} layers cannot be merged")
    for a, b in zip(ours, theirs, strict=True):
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name).to(getattr(a, name).device)
            merged = x.new_zeros((x.shape[0] + y.shape[0], x.shape[1], length, x.shape[3]))
            merged[: x.shape[0], :, length - la :] = x
            merged[x.shape[0] :, :, length - lb :] = y
            setattr(a, name, merged)
    return length
