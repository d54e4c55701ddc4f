"""The transformers engine's own settings (declared by its plugin)."""

from __future__ import annotations

from millm_core.api import PluginSetting, parse_bool

FAST_DECODE = PluginSetting(
    "fast_decode", True, "true | false: the lean decode step where it supports the architecture (Llama-style models)", parse_bool
)
