"""Same answer under load on the real model: SmolLM2-135M in bfloat16 on the transformers
engine (invariant by default), and the packaged Q4_1 GGUF with --batch-invariant (one
sequence per decode call). 8 identical and 8 different greedy requests sent 50 ms apart
(so later ones join a running batch) each get their solo text. The GGUF engine's shared
batches are not invariant — llama.cpp's kernels change with the sequences a call carries
— and its responses say so (X-miLLM-Backend: batched;invariant=?0)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import ServeProcess

pytestmark = pytest.mark.e2e

PROMPTS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain step by step.", "Write a haiku.",
           "List three colours.", "Why is the sky blue?", "Say hello in French and in German.", "ok"]  # fmt: skip
TOKENS = 24


def complete(srv: ServeProcess, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def text(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


def under_load(srv: ServeProcess, model: str, prompts: list[str]) -> list[str]:
    out = [""] * len(prompts)

    def run(i: int) -> None:
        out[i] = text(complete(srv, model, prompts[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return out


def check(srv: ServeProcess, model: str) -> None:
    solo = [text(complete(srv, model, p)) for p in PROMPTS]
    assert under_load(srv, model, [PROMPTS[0]] * 8) == [solo[0]] * 8
    assert under_load(srv, model, PROMPTS) == solo


@pytest.fixture(scope="module")
def bf16_server() -> Iterator[ServeProcess]:
    server = ServeProcess(["--dtype", "bfloat16"])
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def invariant_gguf() -> Iterator[ServeProcess]:
    server = ServeProcess(["--engine", "gguf", "--batch-invariant", "true"])
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def test_smollm2_bf16_answers_the_same_under_load(bf16_server: ServeProcess) -> None:
    resp = complete(bf16_server, "SmolLM2-135M-Instruct", PROMPTS[0])
    assert resp.headers["x-millm-backend"] == "batched" and ":bfloat16/" in resp.json()["system_fingerprint"]
    check(bf16_server, "SmolLM2-135M-Instruct")


def test_q4_1_gguf_with_batch_invariant_answers_the_same_under_load(invariant_gguf: ServeProcess) -> None:
    model = "SmolLM2-135M-Instruct-GGUF:Q4_1"
    assert complete(invariant_gguf, model, "hi").headers["x-millm-backend"] == "serial"
    check(invariant_gguf, model)
