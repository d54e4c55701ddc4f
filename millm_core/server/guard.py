"""ASGI middleware that guards every route before it runs: a cap on requests in flight
(``--max-inflight``: slow-body clients cannot pile up; ``--read-timeout`` drops them), the
optional API keys (``--api-key``), the Host allow-list (``--allowed-hosts``; local names by
default on a loopback address, against DNS rebinding), no
form or text/plain write from a web page of another origin, and a JSON content type on writes to ``/api`` (so
no cross-site "simple request" from a web page can change the server's state). Refusals
take the OpenAI error shape.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from ..codec import encode
from ..contracts.errors import ErrorBody, ErrorResponse

# Liveness and readiness stay open: orchestrators probe them without credentials.
OPEN_PATHS = frozenset({"/api/health", "/api/health/ready"})
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The media types a web page may send to another origin without a preflight (and none).
SIMPLE_MEDIA = frozenset({b"", b"text/plain", b"multipart/form-data", b"application/x-www-form-urlencoded"})


Refusal = tuple[int, str, list[tuple[bytes, bytes]], bytes]  # status, code, headers, body

ANY_HOST = "*"
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_allow_list(allowed: tuple[str, ...], bind: str) -> tuple[str, ...]:
    """The ``Host`` values the server answers for: ``allowed`` as given (``*``: any, the
    empty tuple); when none are given, the local names if the server listens on a loopback
    address (a browser page whose name a DNS server rebinds to 127.0.0.1 then sends its
    own name as ``Host`` and is refused, as Ollama and Jupyter do), else any."""
    if allowed:
        return () if ANY_HOST in allowed else allowed
    name = bind.strip().strip("[]").lower()
    try:
        address = ipaddress.ip_address(name)
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        loopback = address.is_loopback or bool(mapped and mapped.is_loopback)
    except ValueError:  # a host name: localhost, or one that may be any interface's
        loopback = name == "localhost"
    if not loopback:
        return ()
    return tuple(dict.fromkeys((*LOCAL_NAMES, f"[{name}]" if ":" in name else name)))


def _refusal(status: int, code: str, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> Refusal:
    body = encode(ErrorResponse(error=ErrorBody(message=message, type="invalid_request_error", param=None, code=code)))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    return status, code, headers, body


def _same_origin(origin: bytes, host: bytes) -> bool:
    """Whether a browser's ``Origin`` (``scheme://host[:port]``, or ``null``) is the server
    the request's ``Host`` names, default ports filled in."""
    parts = urlsplit(origin.decode("latin-1").strip().lower())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number
        return False
    served = urlsplit("//" + host.decode("latin-1").strip().lower())
    try:
        served_port = served.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    return (parts.hostname, port) == (served.hostname, served_port)


class GuardMiddleware:
    """Refuses, before any route runs: a missing or wrong bearer key (401
    ``invalid_api_key``), a Host outside the allow-list (400 ``host_not_allowed``), a write
    a web page of another origin can send without a preflight (403 ``cross_origin_write``), a
    write to ``/api`` without ``Content-Type: application/json`` (415
    ``unsupported_media_type``), and any request past ``max_inflight`` in flight (503
    ``server_busy``; health and readiness are never refused). Keys are compared in
    constant time and never logged."""

    def __init__(
        self, app: ASGIApp, api_keys: tuple[str, ...], allowed_hosts: tuple[str, ...], max_inflight: int = 256,
        routes: Callable[[], list[BaseRoute]] = list,
    ) -> None:  # fmt: skip
        self.app = app
        self._routes = routes
        self._keys = [key.encode() for key in api_keys]
        self._hosts = frozenset(h.lower() for h in allowed_hosts)
        self._max_inflight = max_inflight
        self._inflight = 0  # requests between their headers and their last byte (event loop only)

    def _check(self, scope: Scope) -> Refusal | None:
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        path: str = scope.get("path", "")
        if self._hosts and b"host" in headers:  # no Host at all (HTTP/1.0): no browser sends that
            host = headers[b"host"].decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self._hosts and host not in self._hosts:
                return _refusal(
                    400, "host_not_allowed",
                    "The Host header names a host this server does not answer for (--allowed-hosts sets the names, * any; "
                    "a server on a loopback address answers for localhost, 127.0.0.1 and [::1] unless told otherwise)",
                )  # fmt: skip
        if self._keys and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # Compare against every key (no early exit) so timing says nothing about which.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(token.strip(), key)
            if scheme.lower() != b"bearer" or not matched:
                message = "Missing API key: send Authorization: Bearer <key>" if not given else "Invalid API key"
                return _refusal(401, "invalid_api_key", message, [(b"www-authenticate", b'Bearer realm="millm"')])
        if (
            scope.get("method") in WRITE_METHODS
            and b"origin" in headers
            and b"authorization" not in headers
            and headers.get(b"content-type", b"").split(b";")[0].strip().lower() in SIMPLE_MEDIA
            and not _same_origin(headers[b"origin"], headers.get(b"host", b""))
        ):
            # What a page elsewhere can send without a preflight (a form, a text/plain fetch):
            # the browser names the page's origin. A JSON write or one with a key cannot come
            # from a page that way (millm answers no preflight), and the SDKs send no Origin.
            return _refusal(403, "cross_origin_write", "A web page from another origin may not write to this server (its Origin is not this Host)")
        if path.startswith("/api/") and scope.get("method") in WRITE_METHODS and self._routed(scope):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                return _refusal(415, "unsupported_media_type", "Writes to /api need Content-Type: application/json")
        return None

    def _routed(self, scope: Scope) -> bool:
        """Whether a route serves this method at this path (else the router's 404/405)."""
        return any(route.matches(scope)[0] == Match.FULL for route in self._routes())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is None and scope.get("path") not in OPEN_PATHS and self._inflight >= self._max_inflight:
            refusal = _refusal(503, "server_busy", f"{self._inflight} requests are in flight (--max-inflight); retry shortly", [(b"retry-after", b"1")])
        if refusal is None:
            self._inflight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self._inflight -= 1
            return
        status, code, headers, body = refusal
        scope.setdefault("state", {})["error_code"] = code
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
