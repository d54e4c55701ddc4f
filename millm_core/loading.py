"""Turn ``--model`` into a loaded engine: a local directory, a model offered by a
model-source plugin, or a model already in the local Hugging Face cache (offline)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import structlog

from .config import Settings
from .engine import UNRECORDED, Engine, EngineFactory, ModelLocation
from .errors import ConfigError
from .plugins import PluginHost

log = structlog.get_logger("millm.loading")

SOURCE_FILE = "millm_source.json"
_SNAPSHOT = re.compile(r"[\\/]snapshots[\\/](?P<rev>[0-9a-f]{7,64})[\\/]?$")


def local_revision(path: str) -> str:
    """The revision recorded for a local directory: millm's own record, else the commit of
    a Hugging Face cache snapshot, else ``unrecorded``."""
    record = os.path.join(path, SOURCE_FILE)
    if os.path.isfile(record):
        with open(record) as fh:
            revision = json.load(fh).get("revision")
        if isinstance(revision, str) and revision:
            return revision
    match = _SNAPSHOT.search(os.path.abspath(path))
    return match.group("rev")[:12] if match else UNRECORDED


def _from_hf_cache(name: str) -> str | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        return None
    try:
        return str(snapshot_download(repo_id=name, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None


def locate(settings: Settings, host: PluginHost) -> ModelLocation:
    """Where the model to serve lives. Never downloads anything."""
    name = settings.model or host.default_model(settings)
    if not name:
        raise ConfigError("no model given (--model) and no plugin offers a default model")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        served = settings.served_name or os.path.basename(os.path.normpath(path))
        return ModelLocation(path=os.path.abspath(path), served_name=served, revision=local_revision(path))
    if os.path.isfile(path):  # a single-file model (GGUF): the engine names it
        served = settings.served_name or os.path.basename(path)
        return ModelLocation(path=os.path.abspath(path), served_name=served, revision=local_revision(os.path.dirname(os.path.abspath(path))))
    sources = host.model_sources()
    if name in sources:
        location: ModelLocation = sources[name].materialise(settings)
        if settings.served_name:
            location = dataclasses.replace(location, served_name=settings.served_name)
        return location
    cached = _from_hf_cache(name)
    if cached:
        return ModelLocation(path=cached, served_name=settings.served_name or name, revision=local_revision(cached))
    known = ", ".join(sorted(sources)) or "none"
    raise ConfigError(
        f"model {name!r} is not a local directory, not offered by a plugin (offered: {known}), "
        "and not in the local Hugging Face cache; millm never downloads weights"
    )


def choose_engine(location: ModelLocation, settings: Settings, host: PluginHost) -> EngineFactory:
    factories = host.engines()
    if settings.engine:
        factories = [f for f in factories if f.name == settings.engine]
        if not factories:
            names = ", ".join(f.name for f in host.engines())
            raise ConfigError(f"no engine named {settings.engine!r}; installed engines: {names}")
    for factory in factories:
        if factory.can_load(location):
            return factory
    raise ConfigError(f"no installed engine can serve {location.path}")


def load(location: ModelLocation, settings: Settings, host: PluginHost) -> Engine:
    factory = choose_engine(location, settings, host)
    log.info("model_loading", model=location.served_name, engine=factory.name, path=location.path)
    engine: Engine = factory.load(location, settings)
    return engine
