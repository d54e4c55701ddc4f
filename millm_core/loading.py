"""Turn ``--model`` into a loaded engine: a local directory or file, a model offered by a
model-source plugin, or one a ``millm_locate_model`` plugin finds (the built-in
``hf_cache`` plugin: the local Hugging Face cache, offline)."""

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
from .registry import ServedModel

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
    located = host.locate_model(name, settings)
    if located is not None:
        return dataclasses.replace(located, served_name=settings.served_name) if settings.served_name else located
    known = ", ".join(sorted(sources)) or "none"
    raise ConfigError(
        f"model {name!r} is not a local directory, not offered by a plugin (offered: {known}), "
        "and no model-locating plugin found it (the hf_cache plugin looks in the local Hugging Face cache); "
        "millm never downloads weights"
    )


def choose_engine(location: ModelLocation, settings: Settings, host: PluginHost) -> EngineFactory:
    factories = host.engines()
    if settings.engine:
        factories = [f for f in factories if f.name == settings.engine]
        if not factories:
            names = ", ".join(f.name for f in host.engines())
            raise ConfigError(f"no engine named {settings.engine!r}; installed engines: {names}")
    for factory in factories:
        if engine_takes(factory, location):
            return factory
    raise ConfigError(f"no installed engine can serve {location.path}")


_REPORTED: set[tuple[str, str]] = set()


def engine_takes(factory: EngineFactory, location: ModelLocation) -> bool:
    """``factory.can_load(location)``; an engine whose check raises (a file it cannot read,
    a bug) takes nothing, and says so in the log once per engine and path: it must not
    hide the models other engines serve."""
    try:
        return bool(factory.can_load(location))
    except Exception as exc:  # noqa: BLE001 - a third party's check
        if (factory.name, location.path) not in _REPORTED:
            _REPORTED.add((factory.name, location.path))
            log.warning("engine_can_load_failed", engine=factory.name, path=location.path, error=f"{type(exc).__name__}: {exc}")
        return False


def load(location: ModelLocation, settings: Settings, host: PluginHost) -> Engine:
    factory = choose_engine(location, settings, host)
    log.info("model_loading", model=location.served_name, engine=factory.name, path=location.path)
    engine = factory.load(location, settings)
    if not isinstance(engine, Engine):
        raise ConfigError(f"the {factory.name} engine plugin's load() returned {type(engine).__name__}, which is not an Engine")
    return engine


def load_served_model(settings: Settings) -> ServedModel:
    """Locate and load the model ``settings`` name, with the plugins they enable (for
    commands such as ``millm sae train`` that need a model outside a server)."""
    host = PluginHost.build(settings)
    location = locate(settings, host)
    engine = load(location, settings, host)
    return ServedModel(info=engine.info, engine=engine)
