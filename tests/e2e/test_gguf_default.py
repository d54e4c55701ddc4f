"""The packaged SmolLM2 GGUF on the GGUF engine, through ``millm serve --engine gguf``."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import ServeProcess

pytestmark = pytest.mark.e2e

NAME = "SmolLM2-135M-Instruct-GGUF:Q4_1"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def gguf_default(gguf_default_server: ServeProcess) -> ServeProcess:
    """The session's ``millm serve --engine gguf`` (shared with test_invariance_e2e)."""
    return gguf_default_server


def test_packaged_gguf_answers_paris(gguf_default: ServeProcess) -> None:
    client = openai.OpenAI(base_url=gguf_default.base_url + "/v1", api_key="x", max_retries=0)
    listed = client.models.list().data
    assert listed[0].id == NAME and listed[0].model_extra is not None and listed[0].model_extra["millm"]["state"] == "loaded"
    assert all(m.model_extra is not None and m.model_extra["millm"]["state"] == "available" for m in listed[1:])
    # The engine is named as `--engine` names it, loaded (/v1/models) or listed (/api/models).
    assert listed[0].model_extra["millm"]["engine"] == "gguf"
    entries = {m["id"]: m for m in httpx.get(gguf_default.base_url + "/api/models", timeout=30).json()["data"]}
    assert entries[NAME]["engine"] == "gguf", entries
    # The transformers conversion is not offered on this engine (it used to load the same
    # file again under that name).
    assert "SmolLM2-135M-Instruct" not in entries
    other = httpx.post(gguf_default.base_url + "/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": QUESTION}, timeout=120)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found", other.text
    resp = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=30)  # type: ignore[arg-type]
    assert "Paris" in (resp.choices[0].message.content or "") and resp.choices[0].finish_reason == "stop"
    raw = httpx.post(gguf_default.base_url + "/v1/chat/completions", json={"model": NAME, "messages": QUESTION, "max_tokens": 2}, timeout=120)
    assert raw.headers["x-millm-backend"] == "batched"  # shared llama.cpp batches, invariant (checked at load)
    assert resp.system_fingerprint is not None and resp.system_fingerprint.endswith(":q4_1/Q4_1:gguf")
    bare = httpx.post(gguf_default.base_url + "/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct-GGUF", "messages": QUESTION}, timeout=120)
    assert bare.status_code == 404 and NAME in bare.json()["error"]["message"]
    seeded = httpx.post(gguf_default.base_url + "/v1/chat/completions", json={"model": NAME, "messages": QUESTION, "seed": 1, "max_tokens": 8}, timeout=120)
    assert seeded.status_code == 200 and seeded.headers["x-millm-seed"] == '1;scope="request"'
    embedded = client.embeddings.create(model=NAME, input="Paris")
    assert len(embedded.data[0].embedding) == 576
