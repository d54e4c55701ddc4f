"""Registers the GGUF engine (llama.cpp), its settings, the GGUF files of the local
Hugging Face cache as models, and the bare-name rule for requests. Importing this module
does not import llama_cpp."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from millm_core.api import (
    Capability,
    EngineFactory,
    LoadPlan,
    ModelLocation,
    ModelRegistry,
    ModelSource,
    PluginSetting,
    ServedModel,
    Settings,
    hookimpl,
    host_available_bytes,
    parse_bool,
)

MILLM_PLUGIN_KIND = "engine"
NAME = "gguf"
# What ModelInfo.engine says: the name `--engine` takes, as /api/models lists an unloaded file.
ENGINE = NAME
CAPABILITIES = frozenset(
    {
        Capability.GENERATE,
        Capability.SEED,
        Capability.EMBEDDINGS,
        Capability.STRUCTURED_OUTPUT,
        Capability.TOOLS,
        Capability.REWIND,
        Capability.CHAT_TEMPLATE_KWARGS,
    }
)


def _positive(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("must be ≥ 0")
    return number


def _can_load(location: ModelLocation) -> bool:
    return location.path.endswith(".gguf") and os.path.isfile(location.path)


def _load(location: ModelLocation, settings: Settings) -> object:
    from .loader import load_engine

    return load_engine(location, settings)


def _preflight(location: ModelLocation, settings: Settings) -> LoadPlan:
    """llama.cpp maps the file, so the weights take its size in memory, and allocates
    the sequences' KV cache (read from the file's metadata, without its tensors)."""
    from .loader import kv_cache_bytes

    need = os.path.getsize(location.path) + kv_cache_bytes(location, settings)
    return LoadPlan(need={"cpu": need}, free={"cpu": host_available_bytes()})


@hookimpl
def millm_register_engines(register: Callable[[EngineFactory], None]) -> None:
    register(EngineFactory(name=NAME, capabilities=CAPABILITIES, can_load=_can_load, load=_load, preflight=_preflight))


EMBEDDINGS = PluginSetting(
    "gguf_enable_embeddings", True, "load GGUF models able to embed (a second, embeddings-only llama.cpp context)", parse_bool
)
PARALLEL = PluginSetting("gguf_parallel", 8, "sequences a GGUF model decodes together (concurrent requests share its batch)", _positive)
PREFIX_CACHE_MB = PluginSetting(
    "gguf_prefix_cache_mb",
    256,
    "MiB of prompts' saved KV state kept for prefix reuse where a row's numbers do not depend on its batch (shared batches that are invariant, or one sequence at a time; 0: off)",
    _positive,
)
KV_CELLS = PluginSetting(
    "gguf_kv_cells",
    0,
    "KV-cache cells, shared equally by those sequences' streams (0: each the context, or less to keep the cache within 2 GiB)",
    _positive,
)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    for setting in (EMBEDDINGS, PARALLEL, KV_CELLS, PREFIX_CACHE_MB):
        register(setting)


def _cached(repo: str, tag: str, path: str) -> ModelSource:
    def materialise(settings: Settings) -> ModelLocation:
        return ModelLocation(path=path, served_name=f"{repo}:{tag}", quantization=tag, extra={"gguf_name": repo})

    return ModelSource(
        name=f"{repo}:{tag}", materialise=materialise, description=f"GGUF in the local Hugging Face cache ({os.path.basename(path)})"
    )


def _bare(repo: str, tags: dict[str, str]) -> ModelSource:
    def materialise(settings: Settings) -> ModelLocation:
        from .naming import pick

        tag, path = pick(repo, tags)
        return ModelLocation(path=path, served_name=f"{repo}:{tag}", quantization=tag, extra={"gguf_name": repo})

    return ModelSource(
        name=repo, materialise=materialise, description=f"GGUF in the local Hugging Face cache ({', '.join(sorted(tags))})", alias=True
    )


@hookimpl
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    from .naming import cached_gguf_repos

    for repo, tags in cached_gguf_repos().items():
        register(_bare(repo, tags))
        for tag, path in tags.items():
            register(_cached(repo, tag, path))


@hookimpl
def millm_resolve(ctx: Any, request: Any, models: ModelRegistry) -> ServedModel | None:
    from .naming import refuse_bare_name

    name = getattr(request, "model", None)
    if isinstance(name, str) and models.get(name) is None and ":" not in name:
        from .naming import cached_gguf_repos, served_name

        cached = [served_name(name, tag) for tag in cached_gguf_repos().get(name, {})]  # loadable by their tagged names
        refuse_bare_name(name, sorted({*cached, *(m.info.served_name for m in models if m.info.engine == ENGINE)}))
    return None
