"""Helpers for tests of the lean decode step (millm_engines.transformers.fastpath)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from millm_engines.transformers.fastpath import KVCache


def prefilled(model: Any, prompts: list[list[int]]) -> tuple[KVCache, torch.Tensor]:
    """Each prompt prefilled alone by HF's forward (so the caches do not depend on each
    other), merged right-aligned into one cache; and each prompt's greedy next token."""
    caches, tokens = [], []
    with torch.inference_mode():
        for prompt in prompts:
            hf_cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([prompt]), cache=hf_cache, use_cache=True)
            caches.append(KVCache.from_hf(hf_cache))
            tokens.append(out.logits[0, -1].argmax(-1))
    merged = caches[0]
    for cache in caches[1:]:
        merged = KVCache.merge(merged, cache)
    return merged, torch.stack(tokens)
