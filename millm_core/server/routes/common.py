"""Decoding shared by the generation endpoints."""

from __future__ import annotations

from typing import TypeVar

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from ...codec import convert, decode_json
from ...context import Endpoint, RequestContext
from ...contracts.chat import ChatCompletionRequest
from ...contracts.completions import CompletionRequest
from ...errors import FieldNotHonoured, ModelNotLoaded, PayloadTooLarge
from ...registry import ServedModel
from ...unknown import unknown_fields
from ..middleware import mint_request_id
from ..pipeline import admit, prepare_generation
from ..respond import Shapes, complete, stream
from ..state import AppState

T = TypeVar("T", bound=msgspec.Struct)

log = structlog.get_logger("millm.request")


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.millm
    return state


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body ({declared} bytes) exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_request(request: Request, endpoint: Endpoint, type_: type[T]) -> tuple[AppState, RequestContext, T]:
    state = app_state(request)
    if not len(state.models):
        reason = f" ({state.load_error})" if state.load_error else " (still loading)" if state.loading else ""
        raise ModelNotLoaded(f"No model is loaded{reason}; retry when GET /api/health/ready answers 200")
    raw = decode_json(await read_body(request, state.settings.max_body_bytes))
    decoded = convert(raw, type_)
    ctx = RequestContext(
        request_id=request.scope.get("state", {}).get("request_id") or mint_request_id(),
        endpoint=endpoint,
        settings=state.settings,
        headers={k.lower(): v for k, v in request.headers.items()},
        stream=bool(getattr(decoded, "stream", False)),
        services=state,
    )
    ctx.ignored_fields.extend(unknown_fields(raw, type_))
    return state, ctx, decoded


def log_unused(ctx: RequestContext) -> None:
    """One warning naming unused field locations — never their values."""
    if ctx.ignored_fields:
        log.warning("request_fields_unused", locations=ctx.ignored_fields, endpoint=ctx.endpoint)


async def serve_completion(request: Request, endpoint: Endpoint, type_: type[ChatCompletionRequest] | type[CompletionRequest]) -> Response:
    """The chat and text completion endpoints: decode, admit (every early refusal), then
    the first plugin that takes the request runs it (``millm_execute``)."""
    state, ctx, body = await decode_request(request, endpoint, type_)
    model = admit(state, ctx, body)
    run = state.host.execute(ctx, body, model, state)
    if run is None:
        enabled = ", ".join(n for n in state.host.names() if n != "core") or "none"
        raise FieldNotHonoured(
            f"no enabled plugin serves this {endpoint} request (enabled plugins: {enabled}); "
            "a server without the sampling plugin does not generate",
            param=None,
        )
    log_unused(ctx)
    return await run


async def generate(state: AppState, ctx: RequestContext, body: ChatCompletionRequest | CompletionRequest, model: ServedModel, shapes: Shapes) -> Response:
    """Generation: prompt ids, budget, pre-forward, then a streamed or complete response."""
    prepared = prepare_generation(state, ctx, body, model)
    return stream(state, prepared, shapes) if ctx.stream else await complete(state, prepared, shapes)
