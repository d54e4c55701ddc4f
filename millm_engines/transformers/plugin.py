"""Registers the transformers engine. Importing this module does not import torch."""

from __future__ import annotations

from collections.abc import Callable

from millm_core.config import Settings
from millm_core.engine import Capability, EngineFactory, ModelLocation
from millm_core.hookspecs import hookimpl

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
    }
)


def _can_load(location: ModelLocation) -> bool:
    from .loader import is_checkpoint_dir

    return is_checkpoint_dir(location)


def _load(location: ModelLocation, settings: Settings) -> object:
    from .loader import load_engine

    return load_engine(location, settings)


@hookimpl
def millm_register_engines(register: Callable[[EngineFactory], None]) -> None:
    register(EngineFactory(name="transformers", capabilities=CAPABILITIES, can_load=_can_load, load=_load))
