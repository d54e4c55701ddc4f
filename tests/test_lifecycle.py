"""Plugin lifecycle: start-up, model loaded and shutdown hooks with the typed application
context, and a start-up failure (a bad database) that stops the server before it is ready."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from millm_core.api import AppContext, Finalization, Outcome, RequestContext, ServedModel, StashKey, hookimpl
from millm_core.config import load_settings
from millm_core.server.app import build_host

EVENTS = StashKey[list[str]]("test.events")


class Recorder:
    """Records its lifecycle in the app's stash (and in ``seen``, which outlives the app)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl
    def millm_startup(self, app: AppContext) -> None:
        app.stash[EVENTS] = self.seen
        self.seen.append(f"startup:{sorted(m.info.served_name for m in app.models)}")

    @hookimpl
    def millm_model_loaded(self, app: AppContext, model: ServedModel) -> None:
        app.stash[EVENTS].append(f"loaded:{model.info.served_name}")

    @hookimpl
    def millm_finalize(self, ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
        out.headers["X-Events"] = str(len(ctx.app.stash[EVENTS]))  # the request reaches the same app context

    @hookimpl
    def millm_shutdown(self, app: AppContext) -> None:
        app.stash[EVENTS].append("shutdown")


class Broken:
    @hookimpl
    def millm_shutdown(self, app: AppContext) -> None:
        raise RuntimeError("shutdown failed on purpose")


def test_lifecycle_hooks_run_in_order_around_requests(make_server) -> None:  # type: ignore[no-untyped-def]
    recorder = Recorder()
    host = build_host(load_settings(environ={}))
    host.register(Broken(), "broken")  # its failure must not keep other plugins from shutting down
    host.register(recorder, "recorder")
    with make_server(host=host) as srv:
        resp = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert resp.status_code == 200 and resp.headers["x-events"] == "3"
        assert recorder.seen == ["startup:['tiny', 'tiny-no-template']", "loaded:tiny", "loaded:tiny-no-template"]
    assert recorder.seen[-1] == "shutdown"


class FailingStartup:
    @hookimpl
    def millm_startup(self, app: AppContext) -> None:
        raise RuntimeError("the plugin's schema is broken")


def test_a_failing_startup_stops_the_server_before_it_answers(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(FailingStartup(), "failing")
    with pytest.raises(RuntimeError, match="failed to start|did not answer"):
        with make_server(host=host):
            pass  # pragma: no cover - must not be reached


def test_millm_serve_with_a_bad_database_exits_with_its_message(tiny_dir: str, tmp_path: Any) -> None:
    """Not a SQLite file: the steering plugin's migrations fail at start-up, so the server
    stops with a clear message and a non-zero status instead of answering 500s."""
    bad = tmp_path / "millm.db"
    bad.write_bytes(b"this is not a database" * 100)
    env = {**os.environ, "MILLM_LOG_LEVEL": "error"}
    proc = subprocess.run(
        [sys.executable, "-m", "millm_core.cli", "serve", "--model", tiny_dir, "--port", "0", "--db", str(bad)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "millm.db" in proc.stderr and "database" in proc.stderr.lower(), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


