"""Helpers for the Batch API tests: JSONL files, uploads through the openai SDK, waiting
for a batch to finish, and reading its output files."""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time
from collections.abc import Iterable
from typing import Any

import httpx
import openai
from openai.types import Batch

from millm_core.api import ForwardPlan, RequestContext, hookimpl
from millm_core.config import load_settings
from millm_core.server.app import build_host, create_app
from millm_core.testing import RunningServer

FINISHED = {"completed", "failed", "cancelled", "expired"}
# What two answers to the same request may differ in: minted per response.
MINTED = ("id", "created")


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="not-needed", max_retries=0)


def jsonl(lines: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions", **extra: Any) -> Batch:
    uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)  # type: ignore[arg-type]


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 180.0, until: set[str] = FINISHED) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout} s: {batch.request_counts}"
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for item in lines:
        assert item["custom_id"] not in found, f"{item['custom_id']} appears twice"
        found[item["custom_id"]] = item
    return found


def unminted(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in MINTED}


class Hold:
    """A test plugin: while ``armed``, every generated row waits at its first token (on the
    model thread) until ``opened`` is set; ``entered`` says a row is waiting. It records
    the prompts of the completions it sees."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.prompts: list[str] = []  # the completions' prompts, in the order they started

    @hookimpl
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, str):
            self.prompts.append(prompt)
        if self.armed:
            plan.add_processor(lambda _row: _Held(self))


class _Held:
    def __init__(self, hold: Hold) -> None:
        self.hold = hold

    def logit_bias(self) -> dict[int, float] | None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.hold.entered.set()
        self.hold.opened.wait(60)
        return text, False

    def flush(self) -> str:
        return ""


class Slow:
    """A test plugin: the completions whose prompt starts with ``marker`` take ``pause``
    seconds a token (on the model thread), so a batch of them is still running however
    fast the machine is."""

    def __init__(self, marker: str, pause: float) -> None:
        self.marker, self.pause = marker, pause

    @hookimpl
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, str) and prompt.startswith(self.marker):
            plan.add_processor(lambda _row: _Paused(self.pause))


class _Paused:
    def __init__(self, pause: float) -> None:
        self.pause = pause

    def logit_bias(self) -> dict[int, float] | None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        time.sleep(self.pause)
        return text, False

    def flush(self) -> str:
        return ""


def roots_server(tiny_dir: str, tmp_path: pathlib.Path, *plugins: object, **overrides: Any) -> RunningServer:
    """A server with no model loaded and the tiny model loadable as ``tiny`` (``POST
    /api/models/tiny/load``), with ``plugins`` registered."""
    root = tmp_path / "roots"
    root.mkdir(exist_ok=True)
    if not (root / "tiny").exists():
        os.symlink(tiny_dir, root / "tiny")
    host = build_host(load_settings(environ={}))
    for index, plugin in enumerate(plugins):
        host.register(plugin, f"test-batches-{index}")
    settings = load_settings(
        {"log_level": "critical", "db": ":memory:", "model_roots": (str(root),), **overrides},
        environ={},
        plugin_settings=host.plugin_settings(),
    )
    return RunningServer(create_app(settings, host=host))


def api(srv: RunningServer, path: str) -> httpx.Response:
    """``POST /api/...`` with an empty JSON body."""
    return httpx.post(srv.base_url + path, json={}, timeout=120)
