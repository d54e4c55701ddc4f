"""The one request path of every model endpoint (chat, completions, embeddings):
decode → admit (strict mode, resolve, field policy, validate) → execute (the plugin that
serves it) → generation or the plugin's computed reply → finalize → encode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ...codec import convert, decode_json
from ...context import Endpoint, RequestContext
from ...contracts.known import KNOWN_FIELDS
from ...errors import FieldNotHonoured, InvalidRequest, ModelNotLoaded, PayloadTooLarge, RequestTimeout
from ...fields import known_refusals
from ...pipeline_types import Compute, Generate
from ...prompts import render_prompts
from ...unknown import unknown_fields
from ..middleware import request_id as request_id_of
from ..pipeline import Admission, admit, prepare_generation, refuse_unused_if_strict
from ..respond import complete, reply, stream
from ..state import AppState, app_state
from ..switch import ensure_requested_model
from .chat import SHAPES as CHAT_SHAPES
from .completions import SHAPES as COMPLETION_SHAPES

log = structlog.get_logger("millm.request")

# A chat template rendering longer than this is refused (it runs on the render pool, so
# the event loop answers meanwhile).
RENDER_TIMEOUT_S = 10.0
CLIENT_CLOSED = 499


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked while reading) and
    with 408 when the whole body takes longer than ``timeout_s`` to arrive (``--read-timeout``:
    a slow-body client cannot hold a request slot; the response time is not limited)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body ({declared} bytes) exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)

    try:
        async with asyncio.timeout(timeout_s):
            await read()
    except ClientDisconnect as exc:  # gone mid-body
        raise InvalidRequest(f"The request body stopped after {size} bytes (client gone)", code="incomplete_body") from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s ({size} bytes came); send it faster") from exc
    return b"".join(chunks)


def check_loaded(state: AppState) -> None:
    """Refuse with 503 while no model is loaded (still loading, or its load failed)."""
    if not len(state.models):
        # The load error's text stays in the log (model_load_failed): it may name paths.
        failed = f" (the model failed to load: {state.load_error.split(':', 1)[0]})" if state.load_error else ""
        reason = failed or (" (still loading)" if state.loading else "")
        raise ModelNotLoaded(f"No model is loaded{reason}; retry when GET /api/health/ready answers 200")


def decode_body(
    state: AppState, endpoint: Endpoint, raw: Any, *, request_id: str, headers: dict[str, str], access_log: dict[str, Any]
) -> Admission:
    """Decode a parsed JSON body into the endpoint's request type in one typed pass;
    record the fields it does not declare (reported) and the known output-changing ones
    that nothing enabled declares (refused in admission)."""
    type_ = state.request_types[endpoint]
    decoded = convert(raw, type_)
    ctx = RequestContext(
        request_id=request_id,
        endpoint=endpoint,
        settings=state.settings,
        headers=headers,
        app=state.app,
        stream=bool(getattr(decoded, "stream", False)),
        access_log=access_log,
    )
    # A known field is either refused (non-neutral) or asks for nothing: never "unused".
    ctx.ignored_fields.extend(loc for loc in unknown_fields(raw, type_) if loc not in KNOWN_FIELDS)
    return Admission(state=state, ctx=ctx, request=decoded, refused_known=known_refusals(raw, type_.__struct_fields__))


async def decode_request(request: Request, endpoint: Endpoint) -> Admission:
    """The HTTP request's body, read (size- and time-limited) and decoded (:func:`decode_body`)."""
    state = app_state(request)
    if not state.settings.auto_load or state.loading:
        check_loaded(state)  # else a request may name a model to load (respond_to checks again)
    raw = decode_json(await read_body(request, state.settings.max_body_bytes, state.settings.read_timeout))
    return decode_body(
        state,
        endpoint,
        raw,
        request_id=request_id_of(request),
        headers=joined_headers(request.headers.items()),
        access_log=request.scope.setdefault("state", {}),
    )


def log_unused(ctx: RequestContext) -> None:
    """One warning naming unused field locations — never their values."""
    if ctx.ignored_fields:
        log.warning("request_fields_unused", locations=ctx.ignored_fields, endpoint=ctx.endpoint)


# How a non-streamed request's work is awaited: cancelled when its client leaves (the
# HTTP route), or as it is (a request served from a plugin's background task).
Guard = Callable[[Coroutine[Any, Any, Response]], Awaitable[Response]]


async def serve(request: Request, endpoint: Endpoint) -> Response:
    """Every model endpoint: decode, admit (every early refusal), then the first plugin
    that takes the request serves it (``millm_execute``)."""
    admission = await decode_request(request, endpoint)
    return await respond_to(admission, lambda work: until_disconnect(request, work))


def _report_unused(
    ctx: RequestContext, reported: Sequence[str], rename: Callable[[str], str] | None, unreported: Callable[[str], bool] | None = None
) -> None:
    """Strict mode and the unused-fields log, once every place that can report a field
    ran; a caller serving this request for another API adds its own locations first,
    leaves out those of the body it made itself (``unreported``, on the endpoint's
    locations) and names the rest in its own terms (``rename``)."""
    if reported or rename is not None or unreported is not None:
        own = [loc for loc in ctx.ignored_fields if unreported is None or not unreported(loc)]
        ctx.ignored_fields[:] = [*reported, *(map(rename, own) if rename is not None else own)]
    refuse_unused_if_strict(ctx)
    log_unused(ctx)


async def respond_to(
    admission: Admission,
    guard: Guard,
    *,
    reported: Sequence[str] = (),
    rename: Callable[[str], str] | None = None,
    unreported: Callable[[str], bool] | None = None,
) -> Response:
    """Admit a decoded request and serve it: the first plugin that takes it
    (``millm_execute``) runs it. A stream is returned as soon as it may start; it notices
    a disconnect itself. ``reported``, ``rename`` and ``unreported``: see :func:`_report_unused`."""
    state, ctx, body = admission.state, admission.ctx, admission.request
    endpoint = ctx.endpoint
    await ensure_requested_model(admission)  # a loadable model the request names is loaded first
    check_loaded(state)
    model = admit(admission)
    # Counted on its model until it ends (an unload waits for it); refused first while the model unloads or another is locked.
    with state.lifecycle.admitted(model) as hold:
        if endpoint != "embeddings":
            await render_prompts(
                ctx, body, model, state.render_pool, RENDER_TIMEOUT_S, adjust=lambda chat: state.host.render_chat(ctx, body, model, chat)
            )
        execution = state.host.execute(ctx, body, model)
        if isinstance(execution, Generate) and endpoint != "embeddings":
            prepared = prepare_generation(state, ctx, body, model)
            shapes = CHAT_SHAPES if endpoint == "chat.completions" else COMPLETION_SHAPES
            streaming = False

            async def generate() -> Response:
                nonlocal streaming
                for wait in prepared.plan.waits:  # what the rows need, built off the event loop and the model thread
                    await wait()
                _report_unused(ctx, reported, rename, unreported)  # after every place that can report a field, waits included
                if ctx.stream:
                    streaming = True
                    return hold(stream(state, prepared, shapes))  # a stream notices a disconnect itself, and releases its claim
                return await complete(state, prepared, shapes)

            try:
                # A stream notices a disconnect itself once it runs (its waits first, at most
                # as long as they bound themselves); the guard would take that notice from it.
                return await (generate() if ctx.stream else guard(generate()))
            except BaseException:
                prepared.release()
                raise
            finally:
                if not streaming:
                    prepared.release()
        if isinstance(execution, Compute):
            _report_unused(ctx, reported, rename, unreported)
            run = execution.run

            async def computed() -> Response:
                return reply(state, ctx, body, model, await run())

            return await guard(computed())
    enabled = ", ".join(n for n in state.host.names() if n != "core") or "none"
    raise FieldNotHonoured(
        f"no enabled plugin serves this {endpoint} request (enabled plugins: {enabled})"
        + ("; a server without the sampling plugin does not generate" if endpoint != "embeddings" else ""),
        param="input" if endpoint == "embeddings" else None,
    )


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Await ``work``, cancelling it as soon as the client disconnects: a non-streamed
    request's rows are freed at the next step, and queued work never runs. For plugins'
    own routes too: read the body first (``read_json``), then wrap the rest."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        log.info("client_disconnected", endpoint=str(request.url.path))
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; nginx's code for the access log
    return task.result()


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await serve(request, "chat.completions")


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    return await serve(request, "completions")


def model_endpoint(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The route handler that serves ``endpoint`` through the one request path; a plugin
    that serves an endpoint the core does not route itself registers it
    (``register("/v1/embeddings", model_endpoint("embeddings"), ["POST"])``)."""

    async def endpoint_handler(request: Request) -> Response:
        return await serve(request, endpoint)

    endpoint_handler.__name__ = endpoint.replace(".", "_")
    return endpoint_handler


def joined_headers(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Request headers by lower-case name; a repeated header's values joined with ", "
    in order (RFC 9110 §5.3), so a plugin can tell a repeated header from a single one."""
    headers: dict[str, str] = {}
    for name, value in items:
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers
