"""The millm app as a Ray Serve deployment: ``build_app(settings, num_replicas=N)`` is an
application for ``serve.run``, and each of its replicas builds and serves the same app
``millm serve`` serves (the same installed plugins, the same settings), loading the model
itself. Ray Serve does the rest: one HTTP route on its proxy, routing across replicas,
restarting a replica that dies.

    import ray
    from ray import serve
    from millm_core.api import serving_settings
    from millm_plugins.rayserve.deployment import build_app

    ray.init()
    settings = serving_settings({"model": "/models/x", "db": "/data/millm.db", "host": "0.0.0.0"})
    serve.start(http_options={"host": settings.host, "port": 8000})
    serve.run(build_app(settings, num_replicas=2), route_prefix="/")

``settings.host`` is where Ray's proxy listens: the replicas' Host allow-list follows it
(local names only on a loopback address, see ``--allowed-hosts``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from ray import serve
from ray.serve import Application

from millm_core.api import ConfigError, Settings, configure_logging, serving_app

from .replica import PLUGIN, PLUGIN_NAME, ReplicaApp

log = structlog.get_logger("millm.ray")

APP_NAME = "millm"
DEPLOYMENT = "millm"


def build_replica_app(settings: Settings, replica: str) -> ReplicaApp:
    """The millm app one replica serves: built as ``millm serve`` builds it, the model
    loaded in its lifespan (on the replica's model thread), plus the replica's own plugin."""
    configure_logging(settings.log_format, settings.log_level)
    return ReplicaApp(serving_app(settings, plugins=[(PLUGIN, PLUGIN_NAME)]), replica)


@serve.ingress()
class MillmReplica:
    """One replica: the app is built when Ray initialises the replica (in its own process,
    where the model then loads), and its lifespan runs before Ray routes it anything."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __serve_build_asgi_app__(self) -> ReplicaApp:
        return build_replica_app(self.settings, serve.get_replica_context().replica_id.unique_id)


def build_app(
    settings: Settings,
    *,
    num_replicas: int = 1,
    ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
) -> Application:
    """The millm deployment with ``num_replicas`` replicas, each an actor with
    ``ray_actor_options`` (default ``{"num_cpus": 1}``; ``{"num_gpus": 1}`` puts each on a
    GPU of its own). ``max_ongoing_requests`` caps the requests Ray sends one replica at
    once (default: the app's own ``--max-inflight``, which refuses more with 503).
    Raises :class:`ConfigError` for ``--db :memory:`` with more than one replica (each
    would have a database of its own: nothing would be shared)."""
    if num_replicas > 1 and settings.db == ":memory:":
        raise ConfigError("--db :memory: gives each replica a database of its own: name a database file the replicas share")
    if settings.auto_load:
        # A request naming another model would switch only the replica that got it: the
        # replicas would then serve different models, and routing would switch them back
        # and forth. Every replica serves the model it started with.
        log.info("auto_load_off_under_ray", reason="a switch would reach one replica only")
        settings = msgspec.structs.replace(settings, auto_load=False)
    deployment = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=num_replicas,
        ray_actor_options=ray_actor_options if ray_actor_options is not None else {"num_cpus": 1},
        max_ongoing_requests=max_ongoing_requests or settings.max_inflight,
    )(MillmReplica)
    return deployment.bind(settings)
