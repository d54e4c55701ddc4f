"""Batch invariance of the GGUF engine on a real quantized file, SmolLM2-135M's packaged
Q4_1, under churn: 24 requests (greedy and seeded sampled, budgets of 6 to 40 tokens)
join a running batch of up to 8 sequences one every other step and leave as they finish,
so joining prompts share calls with other rows' decode tokens and sequences are reused.
Every request's tokens must equal its run alone on the same engine.

This is the test that catches llama.cpp's numerics depending on the batch: with one KV
cache shared by all sequences (``kv_unified``) 18 of these 24 requests changed.

A file whose kernels are not invariant is found at load and says so: the same weights
quantized to Q4_K_M by llama.cpp, where a row's logits change when a second row's logits
are computed in the same call."""

from __future__ import annotations

import random

import pytest

from millm_core.api import RowSpec, SamplingParams
from millm_engines.gguf.testing import requantized
from millm_plugins.smollm2.convert import packaged_gguf

from .helpers import load_gguf

PROMPTS = ["The capital of France is", "Once upon a time there was", "def fibonacci(n):", "My favourite colour is",
           "Water boils at", "The quick brown fox", "In 1492 Columbus sailed", "To make a cake you need",
           "Hello, my name is", "Dear diary, today"]  # fmt: skip


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    model = load_gguf(packaged_gguf())
    assert model.engine.parallel == 8 and model.engine.batch_invariant
    return model.engine


def spec(engine, prompt: int, budget: int, seed: int | None) -> RowSpec:  # type: ignore[no-untyped-def]
    sampling = SamplingParams(temperature=0.0) if seed is None else SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    return RowSpec(prompt_ids=tuple(engine.encode(PROMPTS[prompt], add_special_tokens=True)), sampling=sampling, max_new_tokens=budget)


def alone(engine, row: RowSpec) -> list[int]:  # type: ignore[no-untyped-def]
    batch = engine.open_batch([row])
    try:
        return [engine.step(batch, [None])[0] for _ in range(row.max_new_tokens)]
    finally:
        engine.close(batch)


def test_rows_under_churn_keep_their_solo_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(15)
    requests = [spec(engine, rng.randrange(len(PROMPTS)), rng.randrange(6, 41), rng.choice([None, None, 7, 8])) for _ in range(24)]
    queue = list(range(len(requests)))
    batch = engine.open_batch([requests[queue.pop(0)]])
    owners = [0]
    got: dict[int, list[int]] = {0: []}
    most = 1
    step = 0
    while owners:
        if queue and step % 2 == 1 and engine.can_join([requests[queue[0]]]):
            index = queue.pop(0)
            engine.join(batch, [requests[index]])
            owners.append(index)
            got[index] = []
        most = max(most, len(owners))
        for owner, token in zip(owners, engine.step(batch, [None] * len(owners)), strict=True):
            got[owner].append(token)
        keep = [i for i, owner in enumerate(owners) if len(got[owner]) < requests[owner].max_new_tokens]
        engine.retain(batch, keep)
        owners = [owners[i] for i in keep]
        if not owners and queue:  # the batch emptied before the next join: start another
            index = queue.pop(0)
            batch = engine.open_batch([requests[index]])
            owners, got[index] = [index], []
        step += 1
    engine.close(batch)
    assert most == 8  # the batch was full at times: sequences were shared and reused
    changed = [i for i, row in enumerate(requests) if got[i] != alone(engine, row)]
    assert changed == [], f"{len(changed)} of {len(requests)} requests changed under load"


def test_a_file_whose_kernels_depend_on_the_batch_says_so() -> None:
    """Q4_K_M: the load-time check finds shared calls change a row's logits, so the engine
    reports itself not invariant (X-miLLM-Backend: batched;invariant=?0) and, under
    --batch-invariant, decodes one sequence at a time."""
    path = requantized(packaged_gguf(), "Q4_K_M")
    shared = load_gguf(path)
    assert shared.info.quantization == "Q4_K_M"
    assert shared.engine.parallel == 8 and not shared.engine.batch_invariant
    assert not shared.engine.llm.shares_exactly()  # the check answers the same again
    shared.engine.llm.close()
    serial = load_gguf(path, batch_invariant=True)
    assert serial.engine.parallel == 1 and serial.engine.batch_invariant and not serial.engine.batches_requests
    serial.engine.llm.close()
