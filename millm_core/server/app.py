"""``create_app(settings)`` → a Starlette app whose lifespan owns the plugin host, the
model registry, the scheduler, the database, the plugins' lifecycle and (when given a
loader) the model load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ..config import Settings
from ..context import AppContext, Endpoint
from ..contracts import ENDPOINT_CONTRACTS
from ..dbdialect import is_postgres_url, redact
from ..errors import ConfigError, MillmError
from ..fields import FieldPolicy
from ..metrics import AccessMiddleware, Metrics
from ..openapi import html_page, openapi_document, render
from ..plugins import PluginHost
from ..registry import ModelRegistry, ServedModel
from ..requestfields import build_request_types
from ..scheduler import Scheduler
from ..store import Store, default_db_path
from .dispatch import bind_dispatch
from .errors import LOGGED, handle_http_exception, handle_millm_error, handle_unexpected
from .guard import GuardMiddleware, host_allow_list
from .middleware import RequestIdMiddleware
from .routes.common import chat_completions, completions
from .routes.health import api_docs, health, inference, openapi, ready
from .routes.health import policy as policy_route
from .routes.metrics import metrics as metrics_route
from .routes.models import get_model, list_models
from .state import AppState

log = structlog.get_logger("millm.app")

Loader = Callable[[], ServedModel]


def build_host(settings: Settings) -> PluginHost:
    """A plugin host with the core's hooks and every discovered plugin."""
    return PluginHost.build(settings)


EMBEDDINGS_PATH = "/v1/embeddings"


@dataclass(frozen=True)
class Assembly:
    """What the enabled plugins make of the server: each endpoint's request type, the
    field policy, and whether a plugin serves ``/v1/embeddings``."""

    request_types: dict[Endpoint, type[msgspec.Struct]]
    policy: FieldPolicy
    embeddings: bool


class MillmApp(Starlette):
    """Starlette, except that an unexpected error the app has answered with its 500 and
    logged (with the request id and the plugin that raised it) is not handed on to the
    server, which would log the same traceback a second time. An error the app could not
    answer in full (a stream already under way) still goes to the server."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False

        async def tracked(message: Message) -> None:
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        try:
            await super().__call__(scope, receive, tracked if scope["type"] == "http" else send)
        except Exception as exc:
            if not (finished and getattr(exc, LOGGED, False)):
                raise


def assemble(host: PluginHost) -> Assembly:
    """Join the plugins' request fields onto the core's contracts and build the policy.
    Raises :class:`ConfigError` for clashing field declarations."""
    fields = host.request_fields()
    request_types = build_request_types(ENDPOINT_CONTRACTS, fields)
    policy = FieldPolicy()
    for field in fields:
        policy.own(field)
    for rule in host.field_rules():
        policy.register(rule)
    return Assembly(request_types, policy, any(path == EMBEDDINGS_PATH for path, _, _ in host.routes()))


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
    loading: str | None = None,
) -> Starlette:
    """Build the app. Pass ``models`` already loaded (tests, embedding), or a ``loader``
    that the lifespan runs in a worker thread while the server already answers health
    checks (readiness is 503 until it finishes). ``loading`` names the model the loader
    loads: ``/api/models`` shows it ``loading`` meanwhile, and a load asked for meanwhile
    is refused with 503 ``model_busy`` (``Retry-After``), as during any load."""
    host = host or build_host(settings)
    # Settings built without the plugins' declarations get their defaults (what the CLI would give).
    missing = {d.name: d.default for d in host.plugin_settings() if d.name not in settings.plugin_values}
    if missing:
        settings = msgspec.structs.replace(settings, plugin_values={**missing, **settings.plugin_values})
    assembly = assemble(host)
    registry = models if models is not None else ModelRegistry()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler = Scheduler(settings.max_queue, observe_step=metrics.step.observe)
        db = settings.db or default_db_path()
        try:
            store = Store(db)
        except Exception as exc:
            scheduler.shutdown()
            app.state.startup_error = f"cannot open the database {redact(db) if is_postgres_url(db) else db!r}: {exc}"
            raise ConfigError(app.state.startup_error) from exc
        metrics.watch_scheduler(scheduler.snapshot)
        render_pool = ThreadPoolExecutor(1, thread_name_prefix="millm-text")
        context = AppContext(settings=settings, models=registry, store=store, model_thread=scheduler, metrics=metrics.registry, text_thread=render_pool)
        state = AppState(
            app=context, host=host, policy=assembly.policy, scheduler=scheduler, request_types=assembly.request_types,
            serves_embeddings=assembly.embeddings, metrics=metrics, render_pool=render_pool,
        )  # fmt: skip
        document = openapi_document(assembly.request_types, host.response_schemas(), host.documented_routes(), assembly.embeddings)
        state.openapi_json = render(document).encode()
        state.docs_html = html_page(document)
        app.state.millm = state
        bind_dispatch(state)  # plugins serve model requests of their own through it
        try:
            host.startup(context)
        except Exception as exc:
            app.state.startup_error = f"a plugin failed to start ({type(exc).__name__}: {exc}); database {db!r}"
            log.error("plugin_startup_failed", error=app.state.startup_error)
            host.shutdown(context)
            scheduler.shutdown()
            state.render_pool.shutdown(wait=False, cancel_futures=True)
            store.close()
            raise
        for model in registry:
            host.model_loaded(context, model)
        task: asyncio.Task[None] | None = None
        if loader is not None:
            state.loading = True
            marked = {loading} if loading else set()
            state.lifecycle.loading |= marked

            async def load() -> None:
                try:
                    # Loaded on the scheduler's thread: the one thread that runs model code.
                    model = await asyncio.wrap_future(scheduler.call(loader, counted=False))  # never refused as queue_full
                    host.model_loaded(context, model)
                    registry.add(model)
                except ConfigError as exc:  # the operator's settings: said in one line
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    log.error("model_load_failed", error=str(exc))
                except Exception as exc:  # noqa: BLE001 - reported by readiness and 503s
                    state.load_error = f"{type(exc).__name__}: {exc}"
                    log.exception("model_load_failed")
                finally:
                    state.loading = False
                    state.lifecycle.loading -= marked

            task = asyncio.create_task(load())
        log.info("server_started", plugins=host.names(), models=[m.info.served_name for m in registry])
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            host.shutdown(context)
            scheduler.shutdown()
            state.render_pool.shutdown(wait=False, cancel_futures=True)
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
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    routes.extend(_merged_routes(host.routes()))
    app = MillmApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={MillmError: handle_millm_error, HTTPException: handle_http_exception, Exception: handle_unexpected},
    )
    # Added last = outermost: every refusal the guard makes carries its X-Request-Id, and
    # every response (refusals included) is counted and logged once.
    app.add_middleware(
        GuardMiddleware, api_keys=settings.api_key, allowed_hosts=host_allow_list(settings.allowed_hosts, settings.host), max_inflight=settings.max_inflight,
        routes=lambda: app.routes,
    )  # fmt: skip
    app.add_middleware(AccessMiddleware, metrics=metrics, routes=lambda: app.routes)
    app.add_middleware(RequestIdMiddleware)
    return app
