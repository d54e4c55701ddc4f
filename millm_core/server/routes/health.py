"""Liveness, readiness and scheduler counters."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ...builtin import STRUCTURAL_FIELDS
from ...codec import encode
from ...engine import backend_of
from ...errors import ModelNotLoaded, ServiceUnavailable
from ...fields import policy_table
from ..state import app_state


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = app_state(request)
    if not state.scheduler.healthy:
        # The model thread stopped: every request would fail, so the server is not ready.
        raise ServiceUnavailable(f"The model thread stopped: {state.scheduler.failure}", code="scheduler_unavailable")
    if not len(state.models):
        if state.load_error:
            # Readiness is open to anyone (no key): name the error's class only. Its text
            # (paths, library internals) is in the server's log, logged once with its
            # traceback when the load failed (``model_load_failed``).
            kind = state.load_error.split(":", 1)[0]
            raise ModelNotLoaded(f"No model is loaded: the model failed to load ({kind}); the server's log says why")
        raise ModelNotLoaded(f"No model is loaded ({'loading' if state.loading else 'no model'})")
    return JSONResponse({"status": "ready", "models": [m.info.served_name for m in state.models]})


async def policy(request: Request) -> Response:
    """The field policy table for the engines installed and the plugins enabled."""
    state = app_state(request)
    engines = [(f.name, f.capabilities) for f in state.host.engines()]
    served = {endpoint: type_ for endpoint, type_ in state.request_types.items() if endpoint != "embeddings" or state.serves_embeddings}
    cells = policy_table(state.policy, served, engines, STRUCTURAL_FIELDS)
    return Response(encode({"object": "list", "data": cells}), media_type="application/json")


async def openapi(request: Request) -> Response:
    return Response(app_state(request).openapi_json, media_type="application/json")


async def api_docs(request: Request) -> Response:
    return HTMLResponse(app_state(request).docs_html)


async def inference(request: Request) -> Response:
    state = app_state(request)
    # Per model, what actually runs: "batched" when concurrent requests share its decode
    # steps (a Joinable engine that joins as loaded), else "serial". "backend" is the
    # server's: batched when any model batches (invariantly or not: "batched;invariant=?0").
    models = {m.info.served_name: backend_of(m.engine) for m in state.models}
    backend = "batched" if any(v.split(";")[0] == "batched" for v in models.values()) else "serial"
    scheduler = state.scheduler
    body = {
        "backend": backend,
        "models": models,
        "healthy": scheduler.healthy,
        "failure": scheduler.failure,
        "scheduler": scheduler.snapshot(),
    }
    return Response(encode(body), media_type="application/json")
