"""Test helpers that plugin authors can reuse: a real server for an app, in a thread.

Model builders for tests live with their engine (for the transformers engine:
:mod:`millm_engines.transformers.testing`).
"""

from __future__ import annotations

import asyncio


class RunningServer:
    """A real hypercorn server for an app, on 127.0.0.1 and a free port, in a thread.

    Use as a context manager; ``base_url`` is ``http://127.0.0.1:<port>``.
    """

    def __init__(self, app: object, host: str = "127.0.0.1") -> None:
        import socket
        import threading

        self.app = app
        self.host = host
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
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            stop = self._stop = asyncio.Event()
            config = Config()
            config.bind = [f"{self.host}:{self.port}"]
            config.accesslog = None
            config.errorlog = None
            config.graceful_timeout = 1.0
            await serve(self.app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

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
