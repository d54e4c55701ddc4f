"""The app ``millm serve`` serves, for any ASGI host: the in-process server
(:mod:`millm_core.cli`) and deployments that run millm elsewhere (the Ray Serve plugin's
replicas) build it the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from starlette.applications import Starlette

from .config import Settings, blocked_plugins, load_settings
from .loading import load, locate
from .plugins import PluginHost
from .registry import ServedModel
from .server.app import build_host, create_app
from .server.state import AppState

LOAD_POLL_S = 0.05


def serving_settings(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings as ``millm serve`` builds them: ``MILLM_*`` environment variables (or
    ``environ``), then ``overrides`` (flag names with underscores), with the settings of
    every installed plugin declared. Raises ``ConfigError`` for a bad value."""
    blocked = blocked_plugins(environ=environ, overrides=overrides)
    return load_settings(overrides, environ=environ, plugin_settings=PluginHost.declared_settings(blocked))


async def startup_load(app: Starlette) -> str | None:
    """Once ``app`` (a :func:`serving_app`) has started its lifespan: wait until the model
    it loads at start-up is loaded; None then, or what failed the load. An ASGI host may
    hold its own readiness on this, as the Ray Serve replicas do."""
    state: AppState = app.state.millm
    while state.loading:
        await asyncio.sleep(LOAD_POLL_S)
    return state.load_error


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

    return create_app(settings, host=host, loader=loader, loading=location.served_name)
