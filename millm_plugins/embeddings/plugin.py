"""Serves ``POST /v1/embeddings`` and honours its fields."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.codec import encode
from millm_core.config import PluginSetting
from millm_core.contracts.embeddings import (
    EmbeddingItem,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from millm_core.engine import Capability, Embedder
from millm_core.errors import FieldNotHonoured, InvalidRequest
from millm_core.fields import FieldRule
from millm_core.hookspecs import hookimpl
from millm_core.server.pipeline import check_field_policy, refuse_unused_if_strict
from millm_core.server.respond import response_headers
from millm_core.server.routes.common import decode_request, log_unused

from .vectors import check_inputs, check_lengths, encode_base64, finish_vector

NAME = "embeddings"
MAX_INPUTS = "embeddings_max_inputs"


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting], None]) -> None:
    register(PluginSetting(MAX_INPUTS, 256, "most input strings in one embeddings request", int))


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    for name in ("encoding_format", "normalize"):
        register(FieldRule(name, ("embeddings",), by=NAME, requires=Capability.EMBEDDINGS))
    register(FieldRule("pooling", ("embeddings",), by=NAME, requires=Capability.POOLINGS))
    register(FieldRule("pooling", ("embeddings",), by=NAME, requires=Capability.EMBEDDINGS, condition='"mean" only on this engine'))


async def embeddings(request: Request) -> Response:
    state, ctx, body = await decode_request(request, "embeddings", EmbeddingRequest)
    refuse_unused_if_strict(ctx)
    model = state.host.resolve(ctx, body, state.models)
    if model is None:  # pragma: no cover - the core's resolve answers or raises
        raise InvalidRequest("no plugin resolved a model for this request", param="model")
    check_field_policy(state, ctx, body, model)
    engine = model.engine
    if Capability.EMBEDDINGS not in model.capabilities or not isinstance(engine, Embedder):
        why = getattr(engine, "refusals", {}).get(Capability.EMBEDDINGS)
        raise FieldNotHonoured(f"the {model.info.engine} engine serving '{model.info.served_name}' cannot embed" + (f": {why}" if why else ""), param="input")
    pooling = body.pooling if _sent(body.pooling) else "mean"
    if pooling != "mean" and Capability.POOLINGS not in model.capabilities:
        raise FieldNotHonoured(f"pooling {pooling!r} is not available on the {model.info.engine} engine; it pools by mean only", param="pooling")
    texts = body.inputs()
    single = isinstance(body.input, str)
    check_inputs(texts, single, int(ctx.settings.plugin(MAX_INPUTS)))
    ids = [engine.encode(text, add_special_tokens=True) for text in texts]
    check_lengths([len(i) for i in ids], model.info.context_length, single)
    # Model code runs on the scheduler's thread only.
    vectors = await asyncio.wrap_future(state.scheduler.call(lambda: engine.embed(ids, str(pooling))))
    normalize = bool(body.normalize) if _sent(body.normalize) else False
    as_base64 = body.encoding_format == "base64"
    data = []
    for index, vector in enumerate(vectors):
        finished = finish_vector(vector, index, normalize)
        data.append(EmbeddingItem(index=index, embedding=encode_base64(finished) if as_base64 else finished))
    tokens = sum(len(i) for i in ids)
    log_unused(ctx)
    payload = EmbeddingResponse(data=data, model=model.info.served_name, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(encode(payload), media_type="application/json", headers=response_headers(ctx, model.info.served_name))


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    register("/v1/embeddings", embeddings, ["POST"])
