"""Registers the example engine. It shows the whole of what an engine plugin declares,
using only ``millm_core.api`` as any third party would:

- ``MILLM_PLUGIN_KIND = "engine"``: engines are infrastructure, always enabled;
- one :class:`EngineFactory`: its name (``--engine example``), the capabilities it
  declares before loading (so requests are refused before any model loads), which model
  locations it serves (``can_load``) and how to load one (``load``).

Importing this module imports nothing heavy; the engine module is imported only to load.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from millm_core.api import Capability, EngineFactory, ModelLocation, Settings, hookimpl

MILLM_PLUGIN_KIND = "engine"
NAME = "example"
SUFFIX = ".bigram.json"
# Declared here, before loading; the conformance suite checks the loaded engine agrees.
CAPABILITIES = frozenset({Capability.GENERATE, Capability.SEED})


def _can_load(location: ModelLocation) -> bool:
    return location.path.endswith(SUFFIX) and os.path.isfile(location.path)


def _load(location: ModelLocation, settings: Settings) -> object:
    from .engine import load

    return load(location, settings)


@hookimpl
def millm_register_engines(register: Callable[[EngineFactory], None]) -> None:
    register(EngineFactory(name=NAME, capabilities=CAPABILITIES, can_load=_can_load, load=_load))
