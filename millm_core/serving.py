"""The app ``millm serve`` serves, for any ASGI host: the in-process server
(:mod:`millm_core.cli`) and deployments that run millm elsewhere (the Ray Serve plugin's
replicas) build it the same way."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette

from .config import Settings
from .loading import load, locate
from .registry import ServedModel
from .server.app import build_host, create_app


def serving_app(settings: Settings, *, plugins: Sequence[tuple[object, str]] = ()) -> Starlette:
    """The ASGI app serving the model ``settings`` name with the plugins they enable (and
    ``plugins``, ``(object, name)`` pairs registered beside them). The model is located
    now (a fast failure, and any one-time conversion, before the app is served) and loaded
    in the app's lifespan, while health checks already answer (readiness says when it
    is loaded). Raises ``ConfigError`` for a model that cannot be found."""
    host = build_host(settings)
    for plugin, name in plugins:
        host.register(plugin, name, origin="serving_app")
    location = locate(settings, host)

    def loader() -> ServedModel:
        engine = load(location, settings, host)
        return ServedModel(info=engine.info, engine=engine, location=location)

    return create_app(settings, host=host, loader=loader)
