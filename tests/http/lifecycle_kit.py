"""What the model-lifecycle tests share: a gate that holds requests on the model thread,
a server over model roots, and small HTTP helpers."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx
from starlette.applications import Starlette

from millm_core.api import AppContext, ForwardPlan, RequestContext, ServedModel, hookimpl
from millm_core.config import load_settings
from millm_core.registry import ModelRegistry
from millm_core.server.app import build_host, create_app
from millm_core.testing import RunningServer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class Held:
    """A row that never draws EOS and, while its gate is closed, waits at its first token
    (on the model thread: the request stays running until the test opens the gate);
    ``pause`` seconds at every token."""

    def __init__(self, gate: Gate, eos: frozenset[int]) -> None:
        self.gate, self.eos = gate, eos

    def logit_bias(self) -> dict[int, float]:
        return {token: -100.0 for token in self.eos}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.gate.entered.set()
        self.gate.hold()
        time.sleep(self.gate.pause)
        return text, False

    def flush(self) -> str:
        return ""


class Gate:
    """Holds requests sent with ``X-Gate: 1``; records the lifecycle hooks it sees."""

    def __init__(self, pause: float = 0.0) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.stepped = threading.Event()  # set by ``step_for_model_thread_work``: one token passes
        self.pause = pause
        self.events: list[str] = []

    def hold(self) -> None:
        """At a held row's token: wait until the gate opens (30 s at most), or until the
        test lets this one token through (``step_for_model_thread_work``)."""
        deadline = time.monotonic() + 30
        while not self.opened.wait(0.005):
            if self.stepped.is_set():
                self.stepped.clear()
                return
            if time.monotonic() >= deadline:
                return

    def step_for_model_thread_work(self, srv: RunningServer) -> None:
        """Once some work waits for the model thread (``GET /api/health/inference`` counts
        it in ``scheduler.queued``), let the held row take one token: the scheduler runs
        that work between this step and the next, where the row is held again. A switch
        needs the model thread (to locate the engine) before it unloads the resident; the
        tests used to get it by letting ``hold`` time out, 30 s later."""
        deadline = time.monotonic() + 60
        while httpx.get(srv.base_url + "/api/health/inference", timeout=60).json()["scheduler"]["queued"] < 1:
            assert time.monotonic() < deadline, "nothing came to wait for the model thread"
            time.sleep(0.01)
        self.stepped.set()

    @hookimpl
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        if ctx.headers.get("x-gate") == "1" and ctx.model is not None:
            eos = frozenset(ctx.model.engine.eos_token_ids)
            plan.add_processor(lambda _row: self._row(eos))

    def _row(self, eos: frozenset[int]) -> Held:
        return Held(self, eos)

    @hookimpl
    def millm_model_loaded(self, app: AppContext, model: ServedModel) -> None:
        self.events.append(f"loaded:{model.info.served_name}:{len(app.models)}")

    @hookimpl
    def millm_model_unloaded(self, app: AppContext, model: ServedModel) -> None:
        self.events.append(f"unloaded:{model.info.served_name}:{len(app.models)}")




def make_roots(root: Any, tiny_dir: str, tiny_dir_no_template: str) -> str:
    """A model root with the tiny model under two names, one without a chat template, a
    GGUF-looking file nothing can read and a broken checkpoint."""
    os.symlink(tiny_dir, root / "tiny")
    os.symlink(tiny_dir, root / "tiny-b")
    os.symlink(tiny_dir_no_template, root / "tiny-no-template")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (root / "notes.txt").write_text("not a model")
    return str(root)


def roots_app(roots: str, *plugins: object, models: list[ServedModel] | None = None, **overrides: Any) -> Starlette:
    """The app of a server over ``roots`` with ``plugins`` registered (and ``models``
    already loaded)."""
    host = build_host(load_settings(environ={}))
    for index, plugin in enumerate(plugins):
        host.register(plugin, f"test-lifecycle-{index}")
    settings = load_settings(
        {"log_level": "critical", "db": ":memory:", "model_roots": (roots,), **overrides},
        environ={},
        plugin_settings=host.plugin_settings(),
    )
    registry = None
    if models is not None:
        registry = ModelRegistry()
        for model in models:
            registry.add(model)
    return create_app(settings, host=host, models=registry)


def serve_roots(roots: str, *plugins: object, models: list[ServedModel] | None = None, **overrides: Any) -> RunningServer:
    return RunningServer(roots_app(roots, *plugins, models=models, **overrides))


def post(srv: RunningServer, path: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body if body is not None else {}, timeout=60, **kw)


def entries(srv: RunningServer) -> dict[str, dict[str, Any]]:
    listed = httpx.get(srv.base_url + "/api/models", timeout=60).json()  # the first look may import an engine library
    assert listed["object"] == "list"
    return {entry["id"]: entry for entry in listed["data"]}


def wait_for_state(srv: RunningServer, name: str, state: str, tries: int = 500) -> None:
    """Until ``GET /api/models`` says ``name`` is in ``state`` (about 5 s at most)."""
    for _ in range(tries):
        if entries(srv)[name]["state"] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"{name} never became {state}: {entries(srv)[name]}")
