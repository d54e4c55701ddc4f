"""Same answer under load on the real model, by default: SmolLM2-135M in bfloat16 on the
transformers engine, and the packaged Q4_1 GGUF on llama.cpp (a KV stream per sequence,
flash attention, checked at load). 8 identical and 8 different greedy requests sent 50 ms
apart (so later ones join a running batch) each get their solo text, and so do 8 different
ones sent at once (on the transformers engine their prompts then share prefill passes) and
8 seeded sampled ones on the GGUF file."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import ServeProcess

pytestmark = pytest.mark.e2e

PROMPTS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain step by step.", "Write a haiku.",
           "List three colours.", "Why is the sky blue?", "Say hello in French and in German.", "ok"]  # fmt: skip
TOKENS = 24


def complete(srv: ServeProcess, model: str, prompt: str, **sampling: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0, **sampling}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def text(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


def under_load(srv: ServeProcess, model: str, prompts: list[str], gap: float = 0.05, **sampling: Any) -> list[str]:
    out = [""] * len(prompts)

    def run(i: int) -> None:
        out[i] = text(complete(srv, model, prompts[i], **sampling))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(gap)
    for thread in threads:
        thread.join()
    return out


def check(srv: ServeProcess, model: str, **sampling: Any) -> None:
    solo = [text(complete(srv, model, p, **sampling)) for p in PROMPTS]
    assert under_load(srv, model, [PROMPTS[0]] * 8, **sampling) == [solo[0]] * 8
    assert under_load(srv, model, PROMPTS, **sampling) == solo
    assert under_load(srv, model, PROMPTS, gap=0.0, **sampling) == solo


@pytest.fixture(scope="module")
def bf16_server() -> Iterator[ServeProcess]:
    server = ServeProcess(["--dtype", "bfloat16"])
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gguf_server(gguf_default_server: ServeProcess) -> ServeProcess:
    """The session's ``millm serve --engine gguf`` (shared with test_gguf_default): the
    solo answers are taken on it here, before the loaded ones they are compared with."""
    return gguf_default_server


def test_smollm2_bf16_answers_the_same_under_load(bf16_server: ServeProcess) -> None:
    resp = complete(bf16_server, "SmolLM2-135M-Instruct", PROMPTS[0])
    assert resp.headers["x-millm-backend"] == "batched" and ":bfloat16/" in resp.json()["system_fingerprint"]
    check(bf16_server, "SmolLM2-135M-Instruct")


def test_q4_1_gguf_answers_the_same_under_load(gguf_server: ServeProcess) -> None:
    model = "SmolLM2-135M-Instruct-GGUF:Q4_1"
    resp = complete(gguf_server, model, "hi", seed=3)
    assert resp.headers["x-millm-backend"] == "batched" and resp.headers["x-millm-seed"] == '3;scope="request"'
    check(gguf_server, model)
    check(gguf_server, model, temperature=0.8, seed=3)
