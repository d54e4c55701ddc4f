"""Helpers for plugins' own routes (``millm_register_routes``): the application context of
a request, its JSON body decoded into a Struct (size-limited, errors in the API's shape),
a JSON response, and an event stream that stops its producer when it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..codec import convert, decode_json, encode
from ..context import AppContext
from .routes.common import read_body
from .state import app_state

T = TypeVar("T")


def app_context(request: Request) -> AppContext:
    """The application context of the server answering ``request``."""
    return app_state(request).app


async def read_json(request: Request, type_: type[T]) -> T:
    """The body decoded into ``type_`` (an empty body is ``{}``); over ``--max-body-bytes``
    it is 413, invalid JSON or a wrong value 400 naming the path."""
    settings = app_state(request).settings
    raw = await read_body(request, settings.max_body_bytes, settings.read_timeout)
    return convert(decode_json(raw or b"{}"), type_)


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """``obj`` (a Struct or plain data) as a JSON response, with ``headers`` if given."""
    return Response(encode(obj), status_code=status, media_type="application/json", headers=dict(headers or {}))


class _ClosingStream(StreamingResponse):
    """Closes its body iterator however the response ends: a client that left while the
    iterator waited at a ``yield`` would otherwise leave it suspended until collected. Then
    awaits ``on_close``: the work behind a body that never started (its client left before
    the first frame) is stopped too, with nothing left to the garbage collector."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            for step in (close, self._on_close):
                if step is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):  # cancelled (shutdown), or failed: the response is over
                        await step()


def event_stream(
    frames: AsyncIterator[bytes], headers: Mapping[str, str] | None = None, on_close: Callable[[], Awaitable[None]] | None = None
) -> Response:
    """A ``text/event-stream`` response of ``frames`` (each already framed as SSE). When it
    ends — its last frame sent, or its client gone — ``frames`` is closed, so the work
    behind it stops (a dispatched stream read inside it frees its rows), and then
    ``on_close`` is awaited: pass the dispatched reply's ``aclose`` so that it is closed
    even when the client left before ``frames`` started."""
    return _ClosingStream(frames, on_close, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
