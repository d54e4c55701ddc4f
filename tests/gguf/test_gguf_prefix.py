"""Prefix reuse on the GGUF engine with one sequence at a time (``--gguf-parallel 1``): a
prompt sharing a beginning with an earlier one restores llama.cpp's saved state of its
whole chunks and computes the rest. The logits each step samples from (read by wrapping
the engine's own sampler, which still samples) and the tokens equal the same row's on an
engine whose cache is off. With several sequences the engine keeps nothing. (The packaged
SmolLM2 Q4_1, where a single call over the whole prompt gives other logits than the
chunked prefill, is in tests/e2e/test_prefix_e2e.py.)"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from millm_core.api import PrefixReusing, RowSpec, SamplingParams
from millm_engines.gguf import engine as gguf_module
from millm_engines.gguf.prefix import CHUNK
from millm_engines.gguf.testing import tiny_gguf
from millm_engines.transformers.testing import tiny_model_dir

from .helpers import load_gguf

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=5)
STEPS = 10


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_gguf(tiny_model_dir(context=2048))


@pytest.fixture(scope="module")
def engines(path: str) -> Iterator[tuple[Any, Any]]:
    """(one sequence, with the prefix cache; one sequence, without it)."""
    on = load_gguf(path, gguf_parallel=1).engine
    off = load_gguf(path, gguf_parallel=1, gguf_prefix_cache_mb=0).engine
    assert on.prefix is not None and off.prefix is None and on.chunked and off.chunked
    yield on, off
    on.llm.close()
    off.llm.close()


@pytest.fixture
def on(engines: tuple[Any, Any]) -> Any:
    engines[0].prefix.clear()
    return engines[0]


@pytest.fixture
def off(engines: tuple[Any, Any]) -> Any:
    return engines[1]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[np.ndarray]:
    """The logits of every row the engine samples, in order."""
    logits: list[np.ndarray] = []
    real = gguf_module.sample_row

    def sample_row(row_logits: np.ndarray, *args: Any) -> int:
        logits.append(row_logits.copy())
        return real(row_logits, *args)

    monkeypatch.setattr(gguf_module, "sample_row", sample_row)
    return logits


def text(engine: Any, name: str, tokens: int) -> tuple[int, ...]:
    with open(f"{sysconfig.get_paths()['stdlib']}/{name}", encoding="utf-8") as fh:
        return tuple(engine.encode(fh.read(), add_special_tokens=True)[:tokens])


def run(engine: Any, prompt: tuple[int, ...], sampling: SamplingParams, seen: list[np.ndarray], steps: int = STEPS) -> dict[str, Any]:
    seen.clear()
    batch = engine.open_batch([RowSpec(prompt_ids=prompt, sampling=sampling, max_new_tokens=steps)])
    try:
        tokens = [engine.step(batch, [None])[0] for _ in range(steps)]
        return {"tokens": tokens, "logits": list(seen), "resumed": engine.resumed(batch)[0]}
    finally:
        engine.close(batch)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["tokens"] == b["tokens"] and all(np.array_equal(x, y) for x, y in zip(a["logits"], b["logits"], strict=True)))


def test_several_sequences_keep_nothing(gguf_model: Any) -> None:
    engine = gguf_model.engine
    assert engine.parallel > 1 and engine.prefix is None and isinstance(engine, PrefixReusing)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_restored_prefix_computes_exactly_what_a_full_prefill_does(on: Any, off: Any, seen: list[np.ndarray], sampling: SamplingParams) -> None:
    head = text(on, "textwrap.py", 300)
    first = head + text(on, "string.py", 101)[1:]  # 400 tokens: its state holds 3 whole chunks
    second = head + tuple(on.encode("\n# another", add_special_tokens=False))
    cold, warm, again = run(on, first, sampling, seen), run(on, second, sampling, seen), run(on, first, sampling, seen)
    # the second shares 2 whole chunks with the first
    assert (cold["resumed"], warm["resumed"], again["resumed"]) == (0, 2 * CHUNK, 3 * CHUNK)
    assert same(cold, run(off, first, sampling, seen)) and same(again, cold)
    assert same(warm, run(off, second, sampling, seen))


def test_a_resumed_row_rewound_to_its_prompt_draws_its_tokens_again(on: Any, off: Any, seen: list[np.ndarray]) -> None:
    prompt = text(on, "string.py", 2 * CHUNK + 20)
    reference = run(off, prompt, SEEDED, seen)["tokens"]
    run(on, prompt, SEEDED, seen)
    hits = on.prefix.stats.hits
    batch = on.open_batch([RowSpec(prompt_ids=prompt, sampling=SEEDED, max_new_tokens=STEPS + 4)])
    tokens: list[int] = []
    try:
        for step in range(STEPS + 4):
            tokens.append(on.step(batch, [None])[0])
            if step == 3:
                on.rewind(batch, 0, 4)  # back to the prompt: restored again, then its last chunk
                del tokens[-4:]
    finally:
        on.close(batch)
    assert tokens == reference and on.prefix.stats.hits == hits + 2  # the prefill, and again after the rewind


def test_the_saved_states_keep_to_their_bound(path: str) -> None:
    """A bound of about two states: the least recently used goes; a state another one
    extends is replaced by it."""
    probe = load_gguf(path, gguf_parallel=1).engine
    try:
        prompts = [text(probe, name, 2 * CHUNK + 1) for name in ("textwrap.py", "string.py", "difflib.py")]
        run(probe, prompts[0], GREEDY, [], 1)
        size = probe.prefix.stats.bytes
    finally:
        probe.llm.close()
    engine = load_gguf(path, gguf_parallel=1).engine
    try:
        engine.prefix.max_bytes = int(2.5 * size)  # the operator's bound is in MiB; the tiny model's states are small
        for p in prompts[:2]:
            run(engine, p, GREEDY, [], 1)
        assert run(engine, prompts[0], GREEDY, [], 1)["resumed"] == 2 * CHUNK  # now the most recent
        run(engine, prompts[2], GREEDY, [], 1)
        stats = engine.prefix.stats
        assert (stats.entries, stats.evicted) == (2, 1) and stats.bytes <= engine.prefix.max_bytes
        assert [run(engine, p, GREEDY, [], 1)["resumed"] for p in (prompts[0], prompts[2], prompts[1])] == [2 * CHUNK, 2 * CHUNK, 0]
        longer = prompts[1] + text(engine, "argparse.py", CHUNK + 5)
        run(engine, longer, GREEDY, [], 1)  # its state extends prompts[1]'s, which it replaces
        assert engine.prefix.stats.entries == 2 and run(engine, prompts[1], GREEDY, [], 1)["resumed"] == 2 * CHUNK
    finally:
        engine.llm.close()
