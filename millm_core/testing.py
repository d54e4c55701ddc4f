"""Test helpers that plugin authors can reuse: a real server for an app, in a thread, and
pytest fixtures that start one over models and extra plugins.

This module is a pytest plugin (entry point ``millm = "millm_core.testing"`` in the
``pytest11`` group), so its fixtures are available in any project that installs millm;
their names start with ``millm_``. Model builders and model fixtures live with their
engine (for the transformers engine: :mod:`millm_engines.transformers.testing`); the
core imports no engine here. The engine conformance suite is :mod:`millm_core.conformance`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .registry import ServedModel


class RunningServer:
    """A real hypercorn server for an app, on 127.0.0.1 and a free port, in a thread,
    served as ``millm serve`` serves it (the same hypercorn settings and connection cap).

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:<port>``.
    ``max_connections`` caps the open client connections (0: no cap); None takes the
    app's own ``--max-connections`` setting.
    """

    def __init__(self, app: object, host: str = "127.0.0.1", *, max_connections: int | None = None) -> None:
        import socket
        import threading

        self.app = app
        self.host = host
        self.max_connections = max_connections
        with socket.socket() as sock:
            sock.bind((host, 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._run, name="millm-test-server", daemon=True)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        from .cli import hypercorn_config, serve_app
        from .config import Settings

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            stop = self._stop = asyncio.Event()
            config = hypercorn_config(Settings(), bind=f"{self.host}:{self.port}", errorlog=None)
            config.graceful_timeout = 1.0
            await serve_app(self.app, config, shutdown_trigger=stop.wait, max_connections=self.max_connections)

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced by __enter__
            self._error = exc
            self._ready.set()

    def __enter__(self) -> RunningServer:
        import time
        import urllib.request

        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("test server failed to start") from self._error
            try:
                with urllib.request.urlopen(self.base_url + "/api/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("test server did not answer /api/health within 30 s")

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


ServerFactory = Callable[..., contextlib.AbstractContextManager[RunningServer]]
"""``factory(models, plugins=(), **setting_overrides)``, a context manager yielding a
:class:`RunningServer` (the type of :func:`millm_server_factory`'s value)."""


@contextlib.contextmanager
def serve_models(
    models: Sequence[ServedModel], plugins: Sequence[tuple[str, object]] = (), **setting_overrides: Any
) -> Iterator[RunningServer]:
    """A real server over already loaded ``models`` with the installed plugins (found
    through the ``millm`` entry points, as ``millm serve`` finds them) plus ``plugins``, given
    as ``(name, plugin object)`` and always registered. ``setting_overrides`` are settings
    by name (core ones such as ``max_queue`` or ``plugins``, the allow-list of discovered
    feature plugins, and plugin-declared ones); ``MILLM_*`` environment variables are
    ignored, logs are at ``warning`` and the database is SQLite ``:memory:`` unless
    overridden. The server stops when the block exits."""
    from .config import Settings, load_settings
    from .plugins import PluginHost
    from .registry import ModelRegistry
    from .server.app import create_app

    values: dict[str, Any] = {"log_level": "warning", "db": ":memory:", **setting_overrides}
    # The host is built from the core settings (the allow- and block-lists); plugin-declared
    # settings are known only once the plugins, extra ones included, are registered.
    core = {k: v for k, v in values.items() if k in Settings.__struct_fields__}
    host = PluginHost.build(load_settings(core, environ={}))
    for name, plugin in plugins:
        host.register(plugin, name, origin="millm_server_factory")
    settings = load_settings(values, environ={}, plugin_settings=host.plugin_settings())
    registry = ModelRegistry()
    for model in models:
        registry.add(model)
    app = create_app(settings, host=host, models=registry)
    with RunningServer(app, max_connections=settings.max_connections) as server:
        yield server


@pytest.fixture
def millm_server_factory() -> ServerFactory:
    """A factory of real servers: ``with millm_server_factory([model], plugins=[("mine",
    my_plugin)], max_queue=2) as server:`` serves ``model`` (a loaded
    :class:`~millm_core.api.ServedModel`, for example the ``millm_tiny_model`` fixture of
    :mod:`millm_engines.transformers.testing`) on ``server.base_url`` with your plugin
    registered beside the installed ones. Each ``with`` starts a fresh server and plugin host
    and stops it on exit; see :func:`serve_models` for the arguments."""
    return serve_models
