"""Registers the transformers engine and its settings. Importing this module does not
import torch."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from millm_core.api import Capability, EngineFactory, LoadPlan, ModelLocation, PluginSetting, Settings, hookimpl

from .settings import FAST_DECODE, PACKED_WEIGHTS, PREFIX_CACHE_MB

MILLM_PLUGIN_KIND = "engine"

CAPABILITIES = frozenset(
    {
        Capability.GENERATE,
        Capability.SEED,
        Capability.MULTIPLE_CHOICES,
        Capability.EMBEDDINGS,
        Capability.SCORING,
        Capability.STEERING,
        Capability.CHAT_TEMPLATE_KWARGS,
        Capability.POOLINGS,
        Capability.STRUCTURED_OUTPUT,
        Capability.TOOLS,
        Capability.TAPS,
        Capability.REWIND,
    }
)


def _can_load(location: ModelLocation) -> bool:
    """A Hugging Face checkpoint directory (it holds a ``config.json``); a cheap file test,
    so listing loadable models imports neither torch nor transformers."""
    return os.path.isdir(location.path) and os.path.isfile(os.path.join(location.path, "config.json"))


def _load(location: ModelLocation, settings: Settings) -> object:
    # millm never downloads: make the Hugging Face libraries fail instead of fetching.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from .loader import load_engine

    return load_engine(location, settings)


def _preflight(location: ModelLocation, settings: Settings) -> LoadPlan:
    from .preflight import preflight

    return preflight(location, settings)


@hookimpl
def millm_register_engines(register: Callable[[EngineFactory], None]) -> None:
    register(EngineFactory(name="transformers", capabilities=CAPABILITIES, can_load=_can_load, load=_load, preflight=_preflight))


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(FAST_DECODE)
    register(PACKED_WEIGHTS)
    register(PREFIX_CACHE_MB)
