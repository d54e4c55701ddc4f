"""``millm serve --ray``: deploy the app as Ray Serve replicas behind one HTTP route, on a
local Ray cluster started for it or an existing one (``--ray-address``), until SIGINT or
SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from types import FrameType

import structlog

from millm_core.api import ConfigError, Settings

log = structlog.get_logger("millm.ray")


def configure(parser: argparse.ArgumentParser) -> None:
    """``millm serve``'s arguments for ``--ray``."""
    group = parser.add_argument_group("Ray Serve (with --ray)")
    group.add_argument("--replicas", type=int, default=1, help="replicas of the app, each with the model loaded (default 1)")
    group.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster to deploy on ('auto': the one this machine belongs to; default: start one here)",
    )
    group.add_argument("--ray-cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)")
    group.add_argument(
        "--ray-gpus-per-replica", type=float, default=0.0, help="GPUs Ray reserves for each replica (default 0; 1: a GPU each)"
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Deploy, serve until a signal, then take the application down (and the local cluster
    if this command started it)."""
    if args.replicas < 1:
        raise ConfigError(f"--replicas {args.replicas}: must be 1 or more")
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve: pip install 'millm[ray]' ({exc})") from None
    from .deployment import APP_NAME, build_app

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    ray.init(address=args.ray_address)  # the replicas' logs come to this terminal
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        options = {"num_cpus": args.ray_cpus_per_replica, "num_gpus": args.ray_gpus_per_replica}
        serve.run(build_app(settings, num_replicas=args.replicas, ray_actor_options=options), name=APP_NAME, route_prefix="/")
        log.info(
            "listening", url=f"http://{settings.host}:{settings.port}/v1", replicas=args.replicas, ray=ray.get_runtime_context().gcs_address
        )
        stop.wait()
    finally:
        with contextlib.suppress(Exception):  # nothing to delete when the deployment failed
            serve.delete(APP_NAME)
        if args.ray_address is None:  # the cluster is this command's own
            serve.shutdown()
        ray.shutdown()
    return 0
