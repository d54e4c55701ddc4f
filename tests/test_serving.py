"""The public helpers for hosting millm's app elsewhere (the Ray Serve replicas use
them): ``serving_settings`` builds settings as ``millm serve`` does, ``startup_load``
says when the model the app loads at start-up is loaded, or why it is not."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import httpx
import pytest

from millm_core.api import ConfigError, serving_app, serving_settings, startup_load


def test_serving_settings_read_the_environment_then_overrides_with_plugin_settings() -> None:
    settings = serving_settings({"port": 9100}, environ={"MILLM_PORT": "9000", "MILLM_EMBEDDINGS_MAX_INPUTS": "7"})
    assert settings.port == 9100
    assert settings.plugin_values["embeddings_max_inputs"] == 7  # a plugin's setting, declared
    with pytest.raises(ConfigError):
        serving_settings(environ={"MILLM_LOG_LEVEL": "loud"})


async def _start(app: object) -> tuple[str | None, int]:
    """Run the app's lifespan, wait for its start-up load, then ask it for a completion
    over ASGI: (what failed the load, the completion's status)."""
    async with app.router.lifespan_context(app):  # type: ignore[attr-defined]
        failed = await startup_load(app)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat", "max_tokens": 2})
    return failed, resp.status_code


def test_startup_load_waits_for_the_model(tiny_dir: str) -> None:
    app = serving_app(serving_settings({"model": tiny_dir, "served_name": "tiny", "db": ":memory:"}, environ={}))
    assert asyncio.run(_start(app)) == (None, 200)


def test_startup_load_says_why_the_model_did_not_load(tmp_path: Path, tiny_dir: str) -> None:
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "config.json").write_text(Path(tiny_dir, "config.json").read_text())
    header = json.dumps(["not", "a", "header"]).encode()
    (garbled / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    app = serving_app(serving_settings({"model": str(garbled), "served_name": "tiny", "db": ":memory:"}, environ={}))
    failed, status = asyncio.run(_start(app))
    assert failed is not None and "header" in failed and status == 503


def test_the_start_up_model_shows_as_loading_and_a_load_meanwhile_waits_its_turn(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the start-up load runs, /api/models says "loading" and an explicit load of the
    same model is 503 model_busy (not a second load that then fails with a 500); once it is
    loaded, the load answers the loaded entry."""
    import threading

    import millm_core.serving as serving

    release = threading.Event()
    real = serving.load

    def slow(*args: object, **kwargs: object) -> object:
        release.wait(30)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(serving, "load", slow)
    app = serving_app(serving_settings({"model": tiny_dir, "served_name": "tiny", "db": ":memory:"}, environ={}))

    async def run() -> None:
        async with app.router.lifespan_context(app):  # type: ignore[attr-defined]
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=60) as client:  # type: ignore[arg-type]
                states = {e["id"]: e["state"] for e in (await client.get("/api/models")).json()["data"]}
                assert states["tiny"] == "loading"
                busy = await client.post("/api/models/tiny/load", json={})
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_busy" and busy.headers["retry-after"]
                release.set()
                assert await startup_load(app) is None  # type: ignore[arg-type]
                loaded = await client.post("/api/models/tiny/load", json={})
                assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"

    asyncio.run(run())


def test_millm_serve_stops_when_its_model_cannot_be_loaded(tiny_dir: str) -> None:
    """A setting that fails only when the model loads (a window past the model's) stops the
    server with one line and exit status 2, as any bad setting does; it does not stay up
    with nothing to serve."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "millm_core.cli", "serve", "--model", tiny_dir, "--port", str(port), "--db", ":memory:", "--max-model-len", "99999999"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MILLM_LOG_LEVEL": "warning"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("millm: the model could not be loaded at start-up: ConfigError: --max-model-len 99999999"), last
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--cluster-intensity-min", "1", "--cluster-intensity-max", "0.5"], "--cluster-intensity-min 1 is above --cluster-intensity-max 0.5"),
        (["--circuit-intensity-min", "1", "--circuit-intensity-max", "0.5"], "--circuit-intensity-min 1 is above --circuit-intensity-max 0.5"),
        (["--port", "70000"], "--port must be from 0 (any free port) to 65535"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1024"),
        (["--threads", "-2"], "--threads must be 0 (the engine library's own choice) or more"),
        (["--allowed-hosts", " , "], "holds no host"),
        (["--sae-roots", " , "], "holds no directory"),
        (["--prefix-cache-mb", "-1"], "--prefix-cache-mb '-1': must be ≥ 0"),  # a plugin's flag, in its own words
    ],
)
def test_settings_that_cannot_work_stop_start_up_in_one_line(tiny_dir: str, flags: list[str], says: str) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    run = subprocess.run(
        [sys.executable, "-m", "millm_core.cli", "serve", "--model", tiny_dir, "--port", port, "--db", ":memory:", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MILLM_LOG_LEVEL": "warning"},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert says in run.stderr.strip().splitlines()[-1] and "Traceback" not in run.stderr, run.stderr[-2000:]
