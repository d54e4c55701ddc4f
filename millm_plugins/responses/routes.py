"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``.

A request is translated (:mod:`.translate`), served as a chat completion through the core's
one pipeline (``dispatch``, with this request as the outer one: a client that leaves
cancels it), and its reply translated back (:mod:`.output`, :mod:`.events`). Chat's
refusals come back with chat's status, code and message, naming this API's fields; the
chat reply's ``X-miLLM-*`` headers are this response's. The tokens are spent once chat
answers: a response that cannot be stored (the database busy) is still answered, with
``store: false``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import (
    CLIENT_CLOSED,
    Dispatched,
    FieldNotHonoured,
    InvalidRequest,
    MillmError,
    NotFound,
    StashKey,
    app_context,
    dispatch,
    event_stream,
    json_response,
    read_json,
)

from .events import ResponseStream, sse
from .objects import DeletedResponse
from .output import from_completion, started
from .sealing import Sealer
from .storage import ResponseStore
from .translate import Translation, translate

log = structlog.get_logger("millm.responses")


@dataclass
class ResponsesState:
    """The plugin's per-server state: the stored responses and the reasoning sealer."""

    store: ResponseStore
    sealer: Sealer


STATE = StashKey[ResponsesState]("responses.state")


class ResponseNotFound(NotFound):
    """404: no stored response has this id."""

    code = "response_not_found"


def _not_found(response_id: str, param: str | None) -> ResponseNotFound:
    return ResponseNotFound(
        f"no stored response has the id {response_id!r} (it was never stored, was sent with store: false, was deleted, or was evicted)",
        param=param,
    )


def _refusal(reply: Dispatched) -> MillmError:
    """Chat's error reply as this request's error: the same status, type, code, message
    and param (already in this API's names), and headers such as ``Retry-After``."""
    error = reply.json().get("error") or {}
    headers = {k: v for k, v in reply.headers.items() if k not in ("content-type", "content-length")}
    exc = MillmError(str(error.get("message", "")), code=error.get("code"), param=error.get("param"), status=reply.status, headers=headers)
    exc.type = str(error.get("type") or exc.type)
    return exc


async def _stored_history(state: ResponsesState, raw: dict[str, Any]) -> list[dict[str, Any]]:
    previous = raw.get("previous_response_id")
    if not isinstance(previous, str):
        return []
    stored = await asyncio.to_thread(state.store.get, previous)
    if stored is None:
        raise _not_found(previous, "previous_response_id")
    return stored.conversation


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    state = app_context(request).stash[STATE]
    raw = await read_json(request, dict[str, Any])
    translation = translate(raw, await _stored_history(state, raw), state.sealer)
    translation.store = translation.store and state.store.enabled
    reply = await dispatch(
        request, "chat.completions", translation.chat, reported=translation.reported, rename=translation.rename, unreported=translation.unreported
    )
    if reply.status == CLIENT_CLOSED:
        return Response(status_code=CLIENT_CLOSED)
    if reply.status != 200:
        raise _refusal(reply)
    headers = reply.millm_headers()
    if reply.streaming:
        stream = ResponseStream(translation, started(translation, headers.get("x-millm-model", "")), state.sealer)
        return event_stream(_frames(reply, stream, translation, state), headers=headers, on_close=reply.aclose)
    body = from_completion(translation, reply.json(), state.sealer)
    await _keep(state, translation, body)
    return json_response(body, headers=headers)


async def _keep(state: ResponsesState, translation: Translation, response: dict[str, Any]) -> None:
    """Store a finished response (unless ``store: false``). When it is not kept — the
    database failed, or it alone is larger than the byte bound — it says ``store: false``:
    the client is answered all the same (its tokens are spent), and never told that a
    follow-up could name it."""
    if not translation.store:
        return
    try:
        kept = await asyncio.to_thread(state.store.put, response, translation.history)
    except (MillmError, sqlite3.Error) as exc:
        log.warning("response_not_stored", response_id=response.get("id"), error=str(exc))
        kept = False
    if not kept:
        response["store"] = False


async def _frames(reply: Dispatched, stream: ResponseStream, translation: Translation, state: ResponsesState) -> AsyncIterator[bytes]:
    """The event stream; the finished response is stored (unless ``store: false``) before
    its final event. If this response's client leaves, the chat stream is closed with it. A
    chat stream that ends without its end (no ``[DONE]``) ends this one with ``error`` and
    ``response.failed``."""
    async with reply:
        for event in stream.start():
            yield sse(event)
        async for chunk in reply.events():
            for event in stream.feed(chunk):
                yield sse(event)
            if stream.response.status == "failed":
                return
        if not reply.finished:
            log.warning("dispatched_stream_cut", request_id=reply.request_id)
            for event in stream.fail({"code": "internal_error", "message": "the response ended before it was complete"}):
                yield sse(event)
            return
        closing = stream.end()
        if stream.final is not None:  # stored before the client hears it is done
            await _keep(state, translation, stream.final)
        for event in closing:
            yield sse(event)


# OpenAI's query parameters of GET /v1/responses/{id} that ask for something not served here.
_UNSERVED_QUERY = {
    "stream": "streaming a stored response again is not served; leave stream out",
    "starting_after": "streaming a stored response again is not served, so starting_after has nothing to start after",
    "include_obfuscation": "streaming a stored response again is not served, so there is nothing to pad",
    "include": "a stored response is returned as it was answered; include adds nothing to it here",
    "include[]": "a stored response is returned as it was answered; include adds nothing to it here",
}


def _check_query(request: Request, served: tuple[str, ...]) -> None:
    """Refuse, by name, a query parameter this route does not serve: one of OpenAI's that
    asks for something not served (400 ``field_not_honoured``; ``stream=false`` asks for
    nothing) or an unknown one (400 ``unknown_parameter``)."""
    for name, value in request.query_params.multi_items():
        if name in served or (name == "stream" and value.lower() == "false"):
            continue
        if name in _UNSERVED_QUERY:
            raise FieldNotHonoured(_UNSERVED_QUERY[name], param=name)
        raise InvalidRequest(f"unknown query parameter {name!r}", code="unknown_parameter", param=name)


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response, as it was answered."""
    _check_query(request, ())
    response_id = request.path_params["response_id"]
    stored = await asyncio.to_thread(app_context(request).stash[STATE].store.get, response_id)
    if stored is None:
        raise _not_found(response_id, None)
    return json_response(stored.response)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``."""
    _check_query(request, ())
    response_id = request.path_params["response_id"]
    if not await asyncio.to_thread(app_context(request).stash[STATE].store.delete, response_id):
        raise _not_found(response_id, None)
    return json_response(DeletedResponse(id=response_id))
