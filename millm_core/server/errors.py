"""The one place where exceptions become OpenAI-shaped error responses."""

from __future__ import annotations

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..codec import encode
from ..contracts.errors import ErrorBody, ErrorResponse
from ..errors import MillmError

log = structlog.get_logger("millm.errors")
# Set on an exception the unexpected-error handler has logged (with its request id).
LOGGED = "_millm_logged"

_HTTP_CODES = {404: ("not_found", "invalid_request_error"), 405: ("method_not_allowed", "invalid_request_error")}


def error_body(exc: MillmError) -> ErrorResponse:
    return ErrorResponse(error=ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code))


def error_response(exc: MillmError) -> Response:
    return Response(encode(error_body(exc)), status_code=exc.status, media_type="application/json", headers=exc.headers)


def internal_error() -> MillmError:
    return MillmError("The server failed to process the request; see its log for the request id.")


def retry_after(request: Request) -> str:
    """Seconds a refused client should wait, estimated by the scheduler from recent
    service times and the queue (1 when nothing is known)."""
    state = getattr(request.app.state, "millm", None)
    estimate = getattr(getattr(state, "scheduler", None), "retry_after_s", None)
    return str(max(1, int(estimate()))) if callable(estimate) else "1"


def _note_code(request: Request, code: str | None) -> None:
    """The error code, for the access log and the requests metric."""
    request.scope.setdefault("state", {})["error_code"] = code or ""


async def handle_millm_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, MillmError)
    log.info("request_refused", status=exc.status, code=exc.code, param=exc.param)
    _note_code(request, exc.code)
    if exc.status == 503 and not any(k.lower() == "retry-after" for k in exc.headers):
        exc.headers["Retry-After"] = retry_after(request)
    return error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code, type_ = _HTTP_CODES.get(exc.status_code, ("http_error", "invalid_request_error"))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    # Keep the exception's own headers: a 405 must say which methods are allowed (Allow).
    err = MillmError(message, code=code, status=exc.status_code, headers=dict(exc.headers or {}))
    err.type = type_
    _note_code(request, code)
    return error_response(err)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # This handler runs outside the request-id middleware (Starlette's outermost error
    # layer), so the id is read from the scope and set here, in the log and the header.
    request_id = str(request.scope.get("state", {}).get("request_id", ""))
    state = getattr(request.app.state, "millm", None)
    try:
        culprit = state.host.culprit(exc) if state is not None else None
    except Exception:  # noqa: BLE001 - naming the plugin is a courtesy; the 500 must go out
        culprit = None
    log.exception("unhandled_error", exc_type=type(exc).__name__, request_id=request_id, **({"plugin": culprit} if culprit else {}))
    setattr(exc, LOGGED, True)  # the app does not hand it on to the server to be logged again
    err = internal_error()
    _note_code(request, err.code)
    if request_id:
        err.headers["X-Request-Id"] = request_id
    return error_response(err)
