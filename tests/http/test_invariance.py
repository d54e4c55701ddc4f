"""Same answer under load, over HTTP: a greedy request's text alone equals its text when 7
others share its batch — identical or different requests, arriving a few steps apart so
that rows join a running batch — on the tiny model in float32 and in bfloat16 on the
transformers engine (the lean decode step, and a tiny Qwen2 on the generic HF forward), and as a Q8_0 GGUF file on llama.cpp (the measurement in issue #15,
as a test). Sharing is shown by the scheduler's step count. The tiny model's greedy
choices have wide margins, so these are the contract's smoke test; the churn test on
SmolLM2's real Q4_1 file (tests/gguf/test_gguf_invariance.py) is the one that catches a
regression in llama.cpp's numerics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_core.registry import ServedModel
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.testing import tiny_model_dir

from .helpers import scheduler_stats

PROMPTS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain your reasoning step by step.", "Write a haiku.",
           "List three colours.", "Why is the sky blue?", "Say hello in French and in German.", "ok"]  # fmt: skip
TOKENS = 24


@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-generic", "gguf-q8_0"])
def dtype_server(request: pytest.FixtureRequest, tiny_dir: str, gguf_q8_path: str, make_server: Any) -> Iterator[Any]:
    if request.param == "gguf-q8_0":
        from tests.gguf.helpers import load_gguf

        model = load_gguf(gguf_q8_path, served="tiny")
        assert model.engine.batches_requests and model.engine.batch_invariant
    elif request.param == "bfloat16-generic":  # a Qwen2: the generic HF forward, rows attending over their own columns
        settings = load_settings({"dtype": "bfloat16"}, environ={})
        engine = load_engine(ModelLocation(path=tiny_model_dir(architecture="qwen2"), served_name="tiny"), settings)
        assert engine.fast is None and engine.batches_requests and engine.batch_invariant
        model = ServedModel(info=engine.info, engine=engine)
    else:
        settings = load_settings({"dtype": request.param}, environ={})
        engine = load_engine(ModelLocation(path=tiny_dir, served_name="tiny"), settings)
        assert engine.info.dtype == request.param and engine.fast is not None
        model = ServedModel(info=engine.info, engine=engine)
    with make_server(models=[model]) as srv:
        resp = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert resp.headers["x-millm-backend"] == "batched"  # shared and invariant, and says so
        yield srv


def complete(srv: Any, prompt: str, **sampling: Any) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0, **sampling}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if "seed" in sampling:
        assert resp.headers["x-millm-seed"] == f'{sampling["seed"]};scope="request"'
    return str(resp.json()["choices"][0]["message"]["content"])


def at_once(srv: Any, prompts: list[str], **sampling: Any) -> tuple[list[str], int]:
    """Send ``prompts`` from threads 10 ms apart (later ones join a running batch; at 30 ms
    the tiny GGUF could finish each before the next came); their texts, and the scheduler
    steps they took."""
    out = [""] * len(prompts)
    before = scheduler_stats(srv.base_url)["steps"]

    def run(i: int) -> None:
        out[i] = complete(srv, prompts[i], **sampling)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    return out, scheduler_stats(srv.base_url)["steps"] - before


def test_identical_requests_under_load_equal_the_solo_text(dtype_server: Any) -> None:
    solo = complete(dtype_server, PROMPTS[0])
    texts, steps = at_once(dtype_server, [PROMPTS[0]] * 8)
    assert texts == [solo] * 8
    assert steps < 8 * TOKENS  # they shared decode steps


def test_different_requests_under_load_equal_their_solo_texts(dtype_server: Any) -> None:
    solo = [complete(dtype_server, p) for p in PROMPTS]
    texts, steps = at_once(dtype_server, PROMPTS)
    assert texts == solo
    assert steps < 8 * TOKENS


def test_seeded_requests_under_load_equal_their_solo_texts(dtype_server: Any) -> None:
    """A seeded sampled row draws by (seed, position): its text alone is its text in a
    shared batch, for identical and for different requests."""
    seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    solo = [complete(dtype_server, p, **seeded) for p in PROMPTS]
    texts, _ = at_once(dtype_server, [PROMPTS[2]] * 8, **seeded)
    assert texts == [solo[2]] * 8
    texts, steps = at_once(dtype_server, PROMPTS, **seeded)
    assert texts == solo
    assert steps < 8 * TOKENS
