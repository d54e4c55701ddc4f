"""Serves ``POST /v1/embeddings`` and owns its millm fields (``pooling``, ``normalize``).

The route is the core's one request path (``model_endpoint("embeddings")``): this plugin
only decides that it serves the request and computes the vectors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from millm_core.api import (
    Capability,
    Compute,
    Embedder,
    EmbeddingItem,
    EmbeddingResponse,
    EmbeddingUsage,
    Execution,
    FieldNotHonoured,
    FieldRule,
    InvalidRequest,
    Outcome,
    PluginSetting,
    Problem,
    Reply,
    RequestContext,
    RequestField,
    ServedModel,
    SwitchTarget,
    hookimpl,
    model_endpoint,
)

from .vectors import check_inputs, check_lengths, encode_base64, finish_vector

NAME = "embeddings"
MAX_INPUTS = PluginSetting("embeddings_max_inputs", 256, "most input strings in one embeddings request", int)
POOLING: RequestField[str] = RequestField(
    "pooling", Literal["mean", "last", "cls"], ("embeddings",), owner=NAME, neutral=lambda v: v == "mean",
    requires=Capability.POOLINGS, description="how token vectors become one: mean (default), last or cls",
)  # fmt: skip
NORMALIZE: RequestField[bool] = RequestField(
    "normalize", bool, ("embeddings",), owner=NAME, requires=Capability.EMBEDDINGS, description="scale each vector to unit length"
)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(MAX_INPUTS)


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(POOLING)
    register(NORMALIZE)


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    register(FieldRule("encoding_format", ("embeddings",), by=NAME, requires=Capability.EMBEDDINGS))
    # ``pooling`` is honoured where the engine declares POOLINGS (its RequestField); elsewhere
    # only its neutral "mean" is accepted, and another value is refused before any model load.


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    register("/v1/embeddings", model_endpoint("embeddings"), ["POST"])


def _input_problems(ctx: RequestContext, request: Any) -> list[Problem]:
    """An empty input, an empty string or more inputs than ``embeddings_max_inputs``."""
    try:
        check_inputs(request.inputs(), isinstance(request.input, str), MAX_INPUTS.get(ctx.settings))
    except InvalidRequest as exc:
        return [Problem(exc.message, param=exc.param, code=exc.code, status=exc.status)]
    return []


@hookimpl
def millm_validate_switch(ctx: RequestContext, request: Any, target: SwitchTarget) -> list[Problem]:
    """Inputs that would be refused anyway are refused before the resident model is
    unloaded for ``target``."""
    return _input_problems(ctx, request) if ctx.endpoint == "embeddings" else []


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    return _input_problems(ctx, request) if ctx.endpoint == "embeddings" else []


async def _embed(ctx: RequestContext, request: Any, model: ServedModel, engine: Any, pooling: str) -> Reply:
    texts = request.inputs()
    single = isinstance(request.input, str)
    # Tokenising up to --max-body-bytes of text runs off the event loop.
    ids: list[list[int]] = await ctx.app.run_text(lambda: [engine.encode(text, add_special_tokens=True) for text in texts])
    check_lengths([len(i) for i in ids], model.info.context_length, single)
    vectors = await ctx.app.run_model(lambda: engine.embed(ids, pooling))
    normalize = NORMALIZE.get(request) or False
    as_base64 = request.encoding_format == "base64"
    data = []
    for index, vector in enumerate(vectors):
        finished = finish_vector(vector, index, normalize)
        data.append(EmbeddingItem(index=index, embedding=encode_base64(finished) if as_base64 else finished))
    tokens = sum(len(i) for i in ids)
    body = EmbeddingResponse(data=data, model=model.info.served_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Reply(body=body, outcome=Outcome(choices=(), prompt_tokens=tokens, completion_tokens=0, kind="embeddings"))


@hookimpl
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
    if ctx.endpoint != "embeddings":
        return None
    engine = model.engine
    if Capability.EMBEDDINGS not in model.capabilities or not isinstance(engine, Embedder):
        why = getattr(engine, "refusals", {}).get(Capability.EMBEDDINGS)
        raise FieldNotHonoured(f"the {model.info.engine} engine serving '{model.info.served_name}' cannot embed" + (f": {why}" if why else ""), param="input")
    pooling = POOLING.get(request) or "mean"
    if pooling != "mean" and Capability.POOLINGS not in model.capabilities:
        raise FieldNotHonoured(f"pooling {pooling!r} is not available on the {model.info.engine} engine; it pools by mean only", param="pooling")
    return Compute(lambda: _embed(ctx, request, model, engine, pooling))
