"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import msgspec


class ErrorBody(msgspec.Struct, kw_only=True):
    """The inner error object; ``param`` and ``code`` are null when they do not apply."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every non-2xx answer of the API, and the in-stream error event of an SSE stream."""

    error: ErrorBody
