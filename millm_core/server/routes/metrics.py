"""``GET /metrics``: Prometheus metrics in the text exposition format."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..state import app_state


async def metrics(request: Request) -> Response:
    body, content_type = app_state(request).metrics.render()
    return Response(body, media_type=content_type)
