"""``create_app(settings)`` → a Starlette app whose lifespan owns the plugin host, the
model registry, the scheduler and (when given a loader) the model load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import builtin
from ..config import Settings
from ..errors import MillmError
from ..fields import FieldPolicy
from ..openapi import html_page, openapi_document, render
from ..plugins import PluginHost
from ..registry import ModelRegistry, ServedModel
from ..scheduler import Scheduler
from ..store import Store, default_db_path
from .errors import handle_http_exception, handle_millm_error, handle_unexpected
from .middleware import RequestIdMiddleware
from .routes.chat import chat_completions
from .routes.completions import completions
from .routes.health import api_docs, health, inference, openapi, ready
from .routes.health import policy as policy_route
from .routes.models import get_model, list_models
from .state import AppState

log = structlog.get_logger("millm.app")

Loader = Callable[[], ServedModel]


def build_host(settings: Settings) -> PluginHost:
    """A plugin host with the core's hooks and every discovered plugin."""
    host = PluginHost()
    host.register(builtin, builtin.NAME, origin="millm_core.builtin")
    host.discover(settings)
    return host


def _merged_routes(registered: list[tuple[str, Callable[..., Any], list[str]]]) -> list[Route]:
    """One Starlette route per path, so a 405 lists every method the path supports even
    when plugins register them one at a time."""
    by_path: dict[str, dict[str, Callable[..., Any]]] = {}
    for path, endpoint, methods in registered:
        for method in methods:
            by_path.setdefault(path, {})[method.upper()] = endpoint
    merged = []
    for path, handlers in by_path.items():

        async def dispatch(request: Request, handlers: dict[str, Callable[..., Any]] = handlers) -> Response:
            return cast(Response, await handlers[request.method if request.method != "HEAD" else "GET"](request))

        merged.append(Route(path, dispatch, methods=sorted(handlers)))
    return merged


def create_app(
    settings: Settings,
    *,
    host: PluginHost | None = None,
    models: ModelRegistry | None = None,
    loader: Loader | None = None,
) -> Starlette:
    """Build the app. Pass ``models`` already loaded (tests, embedding), or a ``loader``
    that the lifespan runs in a worker thread while the server already answers health
    checks (readiness is 503 until it finishes)."""
    host = host or build_host(settings)
    # Settings built without the plugins' declarations get their defaults (what the CLI would give).
    missing = {d.name: d.default for d in host.plugin_settings() if d.name not in settings.plugin_values}
    if missing:
        settings = msgspec.structs.replace(settings, plugin_values={**missing, **settings.plugin_values})
    policy = FieldPolicy()
    for rule in host.field_rules():
        policy.register(rule)
    registry = models if models is not None else ModelRegistry()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler = Scheduler(settings.max_queue)
        store = Store(settings.db or default_db_path())
        state = AppState(settings=settings, host=host, models=registry, policy=policy, scheduler=scheduler, store=store)
        document = openapi_document(host.response_schemas(), host.documented_routes())
        state.extra["openapi"] = render(document).encode()
        state.extra["docs_html"] = html_page(document)
        app.state.millm = state
        task: asyncio.Task[None] | None = None
        if loader is not None:
            state.loading = True

            async def load() -> None:
                try:
                    # Loaded on the scheduler's thread: the one thread that runs model code.
                    registry.add(await asyncio.wrap_future(scheduler.call(loader)))
                except Exception as exc:  # noqa: BLE001 - reported by readiness and 503s
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    log.exception("model_load_failed")
                finally:
                    state.loading = False

            task = asyncio.create_task(load())
        log.info("server_started", plugins=host.names(), models=[m.info.served_name for m in registry])
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            scheduler.shutdown()
            store.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/api/health", health, methods=["GET"]),
        Route("/api/health/ready", ready, methods=["GET"]),
        Route("/api/health/inference", inference, methods=["GET"]),
        Route("/api/policy", policy_route, methods=["GET"]),
        Route("/v1/openapi.json", openapi, methods=["GET"]),
        Route("/v1/docs", api_docs, methods=["GET"]),
    ]
    routes.extend(_merged_routes(host.routes()))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={MillmError: handle_millm_error, HTTPException: handle_http_exception, Exception: handle_unexpected},
    )
    app.add_middleware(RequestIdMiddleware)
    return app
