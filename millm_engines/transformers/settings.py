"""The transformers engine's own settings (declared by its plugin)."""

from __future__ import annotations

from millm_core.api import PluginSetting, parse_bool


def _mebibytes(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be ≥ 0")
    return number


# Architectures the lean decode step serves (read off config.json's model_type).
LEAN_MODEL_TYPES = ("llama",)

FAST_DECODE = PluginSetting(
    "fast_decode", True, "true | false: the lean decode step where it supports the architecture (Llama-style models)", parse_bool
)
PACKED_WEIGHTS = PluginSetting(
    "packed_weights",
    True,
    "true | false: on a CPU with native bf16, the lean decode step multiplies by blocked copies of its bf16 weights "
    "(faster; one more copy of the weights in memory)",
    parse_bool,
)
PREFIX_CACHE_MB = PluginSetting(
    "prefix_cache_mb",
    256,
    "MiB of prompts' KV state kept for prefix reuse on the lean decode step (least recently used evicted first; 0: off)",
    _mebibytes,
)
