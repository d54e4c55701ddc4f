"""End-to-end fixtures: the real ``millm serve`` command as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServeProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "millm_core.cli", "serve", "--port", str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"millm serve exited with {self.proc.returncode}: {self.proc.stdout.read() if self.proc.stdout else ''}")
            try:
                if httpx.get(self.base_url + "/api/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("millm serve did not become ready in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def smollm2_server() -> Iterator[ServeProcess]:
    """The default model, exactly as ``make serve`` starts it (first run converts it)."""
    server = ServeProcess([])
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()


EXAMPLE_TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "templates", "smollm2-hermes-tools.jinja")


@pytest.fixture(scope="session")
def smollm2_tools_server() -> Iterator[ServeProcess]:
    """The default model served with the example Hermes-style template (docs/tools.md),
    its constraint vocabulary built (see ``wait_constraint_vocabulary``)."""
    server = ServeProcess(["--chat-template", EXAMPLE_TOOLS_TEMPLATE])
    try:
        server.wait_ready(timeout=600)
        wait_constraint_vocabulary(server, "SmolLM2-135M-Instruct", timeout=300)
        yield server
    finally:
        server.stop()


def wait_constraint_vocabulary(server: ServeProcess, model: str, timeout: float) -> None:
    """Until a constrained request is served: the first one starts building the model's
    constraint vocabulary (from its disk cache when there is one) and is answered 503
    ``constraint_vocabulary_building`` meanwhile, with a Retry-After from the scheduler's
    queue estimate (11 s seen) that the SDK's retry honours. Polling here at 0.2 s costs
    the build's own time instead; the tests' requests are then served as they would be
    after a retry. A 503 with another code, or any other failure, fails here."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_object"}}  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        if resp.status_code != 503 or resp.json()["error"]["code"] != "constraint_vocabulary_building":
            assert resp.status_code == 200, resp.text
            return
        assert time.monotonic() < deadline, "the constraint vocabulary was not built in time"
        time.sleep(0.2)


@pytest.fixture(scope="session")
def gguf_default_server() -> Iterator[ServeProcess]:
    """``millm serve --engine gguf``: the packaged Q4_1 SmolLM2 GGUF, as its users start it.
    One for the session: the modules that use it only send requests (greedy or seeded),
    and their checks hold whatever was served before."""
    server = ServeProcess(["--engine", "gguf"])
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()
