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
    """The default model served with the example Hermes-style template (docs/tools.md)."""
    server = ServeProcess(["--chat-template", EXAMPLE_TOOLS_TEMPLATE])
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.stop()
