"""Same answer under load, over HTTP: a greedy request's text alone equals its text when 7
others share its batch — identical or different requests, arriving a few steps apart so
that rows join a running batch — on the tiny model in float32 and in bfloat16 (the
measurement in issue #15, as a test). Sharing is shown by the scheduler's step count."""

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

from .helpers import scheduler_stats

PROMPTS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain your reasoning step by step.", "Write a haiku.",
           "List three colours.", "Why is the sky blue?", "Say hello in French and in German.", "ok"]  # fmt: skip
TOKENS = 24


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype_server(request: pytest.FixtureRequest, tiny_dir: str, make_server: Any) -> Iterator[Any]:
    settings = load_settings({"dtype": request.param}, environ={})
    engine = load_engine(ModelLocation(path=tiny_dir, served_name="tiny"), settings)
    assert engine.info.dtype == request.param and engine.fast is not None
    with make_server(models=[ServedModel(info=engine.info, engine=engine)]) as srv:
        yield srv


def complete(srv: Any, prompt: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def at_once(srv: Any, prompts: list[str]) -> tuple[list[str], int]:
    """Send ``prompts`` from threads 30 ms apart (later ones join a running batch); their
    texts, and the scheduler steps they took."""
    out = [""] * len(prompts)
    before = scheduler_stats(srv.base_url)["steps"]

    def run(i: int) -> None:
        out[i] = complete(srv, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
        time.sleep(0.03)
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
