"""Loading a GGUF file as a served model for tests (the fixtures are in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_core.plugins import PluginHost
from millm_core.registry import ServedModel
from millm_engines.gguf.loader import load_engine


def load_gguf(path: str, served: str | None = None, **settings: Any) -> ServedModel:
    values = {"log_level": "warning", **({"served_name": served} if served else {})}
    plugin_values = {k: v for k, v in settings.items()}
    declared = PluginHost.declared_settings()
    loaded = load_settings({**values, **plugin_values}, environ={}, plugin_settings=declared)
    engine = load_engine(ModelLocation(path=path, served_name=served or "unused"), loaded)
    return ServedModel(info=engine.info, engine=engine)
