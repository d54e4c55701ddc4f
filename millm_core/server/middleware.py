"""ASGI middleware: request id binding and echo (works for streamed responses too)."""

from __future__ import annotations

import re
import uuid

import structlog
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id(request: HTTPConnection) -> str:
    """The id of this HTTP request: the client's ``X-Request-Id`` when it was valid, else
    one minted; echoed on the response and bound to every log line of the request."""
    return str(request.scope.get("state", {}).get("request_id") or mint_request_id())


def mint_request_id() -> str:
    return "req_" + uuid.uuid4().hex


class RequestIdMiddleware:
    """Reads ``X-Request-Id`` (kept if it is 1–128 safe characters, else a new one is
    minted), binds it to the structlog context for the request, and echoes it on the
    response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = sent if _VALID_ID.match(sent) else mint_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        encoded = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER]
                headers.append((b"X-Request-Id", encoded))
                message["headers"] = headers
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)
