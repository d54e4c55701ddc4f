"""Prefix reuse on the GGUF engine, with one sequence at a time (``--gguf-parallel 1``, the
tiny f32 file) and with several sequences sharing batches (the tiny Q8_0 file, whose
shared batches are invariant): a prompt sharing a beginning with an earlier one restores
llama.cpp's saved state of its whole chunks and computes the rest. The logits each step
samples from (read by wrapping the engine's own sampler, which still samples) and the
tokens equal the same row's on an engine whose cache is off, bit for bit, also when the
resumed row joins beside rows that are decoding and when its state was saved from another
sequence. Where shared batches are not invariant (the f32 file with several sequences)
the engine keeps nothing. (These tiny models give the same logits however a prompt is cut
into calls, measured, so a resumed prompt cut elsewhere than a full prefill would pass
here: tests/e2e/test_prefix_e2e.py catches that on the packaged SmolLM2 Q4_1, whose logits
move with the cut.)"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from millm_core.api import PrefixReusing, RowSpec, SamplingParams
from millm_engines.gguf import engine as gguf_module
from millm_engines.gguf.llama import Piece
from millm_engines.gguf.prefix import CHUNK
from millm_engines.gguf.testing import tiny_gguf
from millm_engines.transformers.testing import tiny_model_dir

from .helpers import load_gguf

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=5)
STEPS = 10
SHARED = 4  # sequences of the shared-batch engines


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_gguf(tiny_model_dir(context=2048))


@pytest.fixture(scope="module")
def q8_path() -> str:
    return tiny_gguf(tiny_model_dir(context=2048), file_name="tiny.Q8_0.gguf", quantization="Q8_0")


@pytest.fixture(scope="module")
def one(path: str) -> Iterator[tuple[Any, Any]]:
    """(one sequence, with the prefix cache; one sequence, without it)."""
    on = load_gguf(path, gguf_parallel=1).engine
    off = load_gguf(path, gguf_parallel=1, gguf_prefix_cache_mb=0).engine
    assert on.prefix is not None and off.prefix is None
    yield on, off
    on.llm.close()
    off.llm.close()


@pytest.fixture(scope="module")
def shared(q8_path: str) -> Iterator[tuple[Any, Any]]:
    """(several sequences sharing batches, with the prefix cache; the same without it)."""
    on = load_gguf(q8_path, gguf_parallel=SHARED).engine
    off = load_gguf(q8_path, gguf_parallel=SHARED, gguf_prefix_cache_mb=0).engine
    assert on.parallel == SHARED and on.batch_invariant and on.prefix is not None and off.prefix is None
    yield on, off
    on.llm.close()
    off.llm.close()


@pytest.fixture(params=["one", "shared"])
def engines(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    return tuple(request.getfixturevalue(request.param))  # type: ignore[return-value]


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


def test_shared_batches_reuse_only_where_they_are_invariant(gguf_model: Any, shared: tuple[Any, Any]) -> None:
    """The f32 file's shared batches are not invariant (unfused f32 attention): a prefill
    there depends on its neighbours, so a saved one would not be the row's own; nothing is
    kept. The Q8_0 file's are, and keep prompts' states."""
    engine = gguf_model.engine
    assert engine.parallel > 1 and not engine.batch_invariant and engine.prefix is None and isinstance(engine, PrefixReusing)
    assert shared[0].parallel > 1 and shared[0].batch_invariant and shared[0].prefix is not None


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
    # with several sequences, beside a row that is decoding when the prompt runs again
    beside = [RowSpec(prompt_ids=text(on, "difflib.py", 30), sampling=GREEDY, max_new_tokens=STEPS + 4)] if on.parallel > 1 else []
    batch = on.open_batch([*beside, RowSpec(prompt_ids=prompt, sampling=SEEDED, max_new_tokens=STEPS + 4)])
    tokens: list[int] = []
    try:
        for step in range(STEPS + 4):
            tokens.append(on.step(batch, [None] * len(batch.rows))[-1])
            if step == 3:
                on.rewind(batch, len(batch.rows) - 1, 4)  # back to the prompt: restored again, then its last chunk
                del tokens[-4:]
    finally:
        on.close(batch)
    assert tokens == reference and on.prefix.stats.hits == hits + 2  # the prefill, and again after the rewind


def test_a_row_joining_beside_decoding_rows_resumes_exactly(shared: tuple[Any, Any], seen: list[np.ndarray]) -> None:
    """Rows join a running batch and resume from a state another sequence saved: their
    first call carries the running rows' tokens beside the rest of their prompt, and every
    row's tokens and logits equal its run alone without the cache."""
    on, off = shared
    on.prefix.clear()
    head = text(on, "textwrap.py", 300)
    first = head + text(on, "string.py", 60)[1:]
    second = head + tuple(on.encode("\n# another", add_special_tokens=False))
    third = head + tuple(on.encode("\n# and a third", add_special_tokens=False))
    runner = text(on, "difflib.py", 40)
    run(on, first, GREEDY, seen)  # alone, on sequence 0: keeps its 2 whole chunks
    assert on.prefix.stats.entries == 1
    hits = on.prefix.stats.hits
    joins = {3: ("second", second, GREEDY), 5: ("third", third, SEEDED)}
    total = 2 * STEPS
    batch = on.open_batch([RowSpec(prompt_ids=runner, sampling=SEEDED, max_new_tokens=total)])
    labels = ["runner"]
    got: dict[str, dict[str, Any]] = {"runner": {"tokens": [], "logits": []}}
    try:
        for step in range(total):
            if step in joins:
                label, prompt, sampling = joins[step]
                on.join(batch, [RowSpec(prompt_ids=prompt, sampling=sampling, max_new_tokens=total)])
                labels.append(label)
                got[label] = {"tokens": [], "logits": []}
            seen.clear()
            tokens = on.step(batch, [None] * len(batch.rows))
            if step in joins:
                assert on.resumed(batch)[-1] == 2 * CHUNK and batch.rows[-1].seq != 0  # restored into another sequence
            for label, token, logits in zip(labels, tokens, seen, strict=True):
                got[label]["tokens"].append(token)
                got[label]["logits"].append(logits)
    finally:
        on.close(batch)
    assert on.prefix.stats.hits == hits + 2
    assert same(got["runner"], run(off, runner, SEEDED, seen, total))
    assert same(got["second"], run(off, second, GREEDY, seen, total - 3))
    assert same(got["third"], run(off, third, SEEDED, seen, total - 5))


def test_rows_of_one_step_resume_what_an_earlier_row_saved(shared: tuple[Any, Any], seen: list[np.ndarray]) -> None:
    """Two prompts with one beginning joining together (a request's ``n`` rows, say): the
    second restores the state the first saved in the same step."""
    on, off = shared
    on.prefix.clear()
    head = text(on, "textwrap.py", 2 * CHUNK + 30)
    prompts = [head, head + tuple(on.encode("\n# more", add_special_tokens=False))]
    batch = on.open_batch([RowSpec(prompt_ids=p, sampling=GREEDY, max_new_tokens=STEPS) for p in prompts])
    rows: list[dict[str, Any]] = [{"tokens": [], "logits": []} for _ in prompts]
    try:
        for step in range(STEPS):
            seen.clear()
            tokens = on.step(batch, [None, None])
            if step == 0:
                assert on.resumed(batch) == [0, 2 * CHUNK]
            for row, token, logits in zip(rows, tokens, seen, strict=True):
                row["tokens"].append(token)
                row["logits"].append(logits)
    finally:
        on.close(batch)
    assert all(same(row, run(off, p, GREEDY, seen)) for row, p in zip(rows, prompts, strict=True))


def test_a_state_saved_from_one_sequence_restores_into_another(shared: tuple[Any, Any]) -> None:
    """``llama_state_seq_set_data`` into another sequence's stream: the rest of the prompt
    computed there gives the saving sequence's logits, bit for bit."""
    on = shared[0]
    llm = on.llm
    prompt = text(on, "textwrap.py", CHUNK + 70)

    def prefill(seq: int, start: int) -> np.ndarray:
        out: list[np.ndarray] = []
        for begin in range(start, len(prompt), CHUNK):
            end = min(begin + CHUNK, len(prompt))
            out = llm.decode([Piece(prompt[p], seq, p, p == end - 1) for p in range(begin, end)])
        return out[-1]

    try:
        alone = prefill(0, 0)
        state = llm.save(0)
        for seq in range(1, SHARED):
            assert llm.restore(seq, state, CHUNK)
            assert np.array_equal(prefill(seq, CHUNK), alone)
    finally:
        for seq in range(SHARED):
            llm.forget(seq)


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
