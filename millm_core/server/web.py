"""Helpers for plugins' own routes (``millm_register_routes``): the application context of
a request, its JSON body decoded into a Struct (size-limited, errors in the API's shape),
and a JSON response."""

from __future__ import annotations

from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from ..codec import convert, decode_json, encode
from ..context import AppContext
from .routes.common import app_state, read_body

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


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` (a Struct or plain data) as a JSON response."""
    return Response(encode(obj), status_code=status, media_type="application/json")
