"""The real default model (SmolLM2-135M-Instruct) through ``millm serve``."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from millm_engines.transformers.packed import ops_available

from .conftest import ServeProcess

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_default_model_is_listed(smollm2_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="x", max_retries=0)
    models = client.models.list().data
    # The loaded conversion first, then the packaged GGUF file under its own name (a request
    # naming it would load it on llama.cpp).
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-GGUF:Q4_1"]
    assert models[1].model_extra["millm"]["state"] == "available"
    details = models[0].model_extra["millm"]
    assert (details["d_model"], details["n_layers"], details["context_length"]) == (576, 30, 8192)


def test_paris(smollm2_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.system_fingerprint.startswith("millm:SmolLM2-135M-Instruct@")
    # Dequantised to float32, published in bf16: auto serves bf16 where the CPU has bf16 kernels.
    dtype = "bfloat16" if ops_available() else "float32"
    assert resp.system_fingerprint.endswith(f":{dtype}/Q4_1-dequantized:transformers")
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=30, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == resp.choices[0].message.content


def test_serve_a_local_checkpoint_with_flags(tiny_dir: str) -> None:
    server = ServeProcess(["--model", tiny_dir, "--served-name", "mini", "--max-model-len", "128"], env={"MILLM_MAX_QUEUE": "3"})
    try:
        server.wait_ready(timeout=120)
        card = httpx.get(server.base_url + "/v1/models/mini").json()
        assert card["millm"]["context_length"] == 128
        too_long = httpx.post(server.base_url + "/v1/completions", json={"model": "mini", "prompt": "x", "max_tokens": 200})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()


def test_json_logs_are_one_object_per_line() -> None:
    """With --log-format json, what the server writes is JSON lines only: the default
    model's GGUF check and the weights' loading draw no progress bars between them."""
    import json

    server = ServeProcess(["--log-format", "json", "--log-level", "info", "--db", ":memory:"])
    try:
        server.wait_ready(timeout=300)
        reply = httpx.post(server.base_url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200
    finally:
        server.stop()
    assert server.proc.stdout is not None
    lines = [line for line in server.proc.stdout.read().split("\n") if line.strip()]
    events = [json.loads(line)["event"] for line in lines]  # every line is one JSON object
    assert "listening" in events and "request" in events


def test_missing_model_fails_fast_with_a_clear_message(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, "-m", "millm_core.cli", "serve", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "never downloads" in out.stderr
