"""Prefix reuse on the transformers engine — its lean decode step and its generic HF forward
— in float32 and bfloat16.

A row whose prompt shares a prefix with an earlier one resumes its prefill from the cached
keys and values of that prefix's whole chunks. It must compute exactly what a full prefill
computes: the logits it draws its first token from are compared bit for bit, and its tokens
token for token, with the same row on an engine whose cache is off — alone, in a batch with
other rows, joining a running batch, steered, and after the cache evicted part of its
prefix. Rows with different steering deltas never share cached state.

Each comparison can fail: in float32 a prefill cut into other passes than the engine's
chunks gives other logits (checked below), so an inexact resume would."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from millm_core.api import PrefixReusing, RowSpec, SamplingParams, Tap
from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.prefix import CHUNK, PrefixCache, chunks, rope_refusal
from millm_engines.transformers.settings import FAST_DECODE, PREFIX_CACHE_MB
from millm_engines.transformers.testing import tiny_model_dir

from .test_steering_rows import delta

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=99)
STEPS = 12
STEER_LAYER = 0  # the keys and values of the layers after it depend on its delta


def _load(path: str, dtype: str, mb: int, fast: bool = True) -> Any:
    settings = load_settings(
        {"dtype": dtype, "prefix_cache_mb": mb, "fast_decode": fast}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB]
    )
    engine = load_engine(ModelLocation(path=path, served_name="t"), settings)
    assert (engine.fast is not None) == fast and engine.info.dtype == dtype
    assert (engine.prefix is not None) == (mb > 0)
    return engine


@pytest.fixture(scope="module")
def long_dir() -> str:
    """The tiny model with a 2,048-token window (prompts here are several chunks long)."""
    return tiny_model_dir(context=2048)


@pytest.fixture(
    scope="module",
    params=[("float32", True), ("bfloat16", True), ("float32", False), ("bfloat16", False)],
    ids=["float32", "bfloat16", "float32-generic", "bfloat16-generic"],
)
def pair(request: pytest.FixtureRequest, long_dir: str) -> tuple[Any, Any]:
    """(an engine with the prefix cache, the same model and dtype without it), on the lean
    decode step or on the generic HF forward (``--fast-decode false``)."""
    dtype, fast = request.param
    return _load(long_dir, dtype, 256, fast), _load(long_dir, dtype, 0, fast)


@pytest.fixture
def on(pair: tuple[Any, Any]) -> Iterator[Any]:
    engine = pair[0]
    engine.prefix.clear()
    yield engine


@pytest.fixture
def off(pair: tuple[Any, Any]) -> Any:
    return pair[1]


def _source(name: str) -> str:
    with open(f"{sysconfig.get_paths()['stdlib']}/{name}", encoding="utf-8") as fh:
        return fh.read()


def ids(engine: Any, text: str, *, bos: bool = False) -> tuple[int, ...]:
    return tuple(engine.encode(text, add_special_tokens=bos))


def system(engine: Any, length: int = 300, name: str = "textwrap.py") -> tuple[int, ...]:
    """A long shared beginning: ``length`` tokens of a standard-library source."""
    return ids(engine, _source(name), bos=True)[:length]


def row(prompt: Sequence[int], sampling: SamplingParams = GREEDY, **extra: Any) -> RowSpec:
    return RowSpec(prompt_ids=tuple(prompt), sampling=sampling, max_new_tokens=64, **extra)


def resumable(prompt: Sequence[int], shared: int) -> int:
    """What a prompt can resume when ``shared`` of its tokens are cached: whole chunks, and
    at least its last token left to compute."""
    return min(shared, len(prompt) - 1) // CHUNK * CHUNK


def drive(engine: Any, rows: Sequence[RowSpec], steps: int = STEPS, joins: Mapping[int, RowSpec] | None = None) -> list[dict[str, Any]]:
    """Step ``rows`` (and ``joins[s]`` joining before step s); per row: its tokens, the
    logits its first token was drawn from, and the prompt tokens it resumed."""
    batch = engine.open_batch(list(rows))
    tokens: list[list[int]] = [[] for _ in rows]
    try:
        for step in range(steps):
            if joins and step in joins:
                engine.join(batch, [joins[step]])
                tokens.append([])
            for out, token in zip(tokens, engine.step(batch, [None] * len(tokens)), strict=True):
                out.append(token)
        return [{"tokens": t, "first": batch.first_logits[r].clone(), "resumed": engine.resumed(batch)[r]} for r, t in enumerate(tokens)]
    finally:
        engine.close(batch)


def solo(engine: Any, spec: RowSpec, steps: int = STEPS) -> dict[str, Any]:
    return drive(engine, [spec], steps)[0]


def same(got: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    return bool(got["tokens"] == want["tokens"] and torch.equal(got["first"], want["first"]))


def test_the_engine_reports_what_it_resumed(on: Any, off: Any) -> None:
    assert isinstance(on, PrefixReusing) and isinstance(off, PrefixReusing)
    prompt = system(on)
    assert solo(off, row(prompt))["resumed"] == solo(off, row(prompt))["resumed"] == 0  # no cache, nothing resumed


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_prefill_computes_exactly_what_a_full_one_does(on: Any, off: Any, sampling: SamplingParams) -> None:
    head = system(on)
    first = head + ids(on, "\n# first question: " + "what does dedent do? " * 16)
    second = head + ids(on, "\n# and another one, about fill")
    cold = solo(on, row(first, sampling))
    warm = solo(on, row(second, sampling))
    again = solo(on, row(first, sampling))
    assert (cold["resumed"], warm["resumed"], again["resumed"]) == (0, resumable(second, len(head)), resumable(first, len(first)))
    assert warm["resumed"] >= 2 * CHUNK and again["resumed"] > warm["resumed"]
    reference = solo(off, row(first, sampling))
    assert same(cold, reference) and same(again, reference)
    assert same(warm, solo(off, row(second, sampling)))


def test_a_prefill_resumed_early_runs_its_remaining_chunks_as_a_full_one_does(on: Any, off: Any) -> None:
    """One cached chunk under a 500-token prompt: the remaining 372 positions run in the
    same three chunks as in a full prefill (one pass over them would differ in float32,
    see below), so the first logits and tokens are the full prefill's."""
    solo(on, row(system(on, 200)))  # caches the first chunk only
    long = system(on, 500)
    warm = solo(on, row(long))
    assert warm["resumed"] == CHUNK and len(list(chunks(CHUNK, len(long)))) == 3
    assert same(warm, solo(off, row(long)))


def test_rotary_scalings_with_state_turn_reuse_off() -> None:
    """Dynamic (NTK) and longrope scaling depend on the lengths a module has seen, so a
    resumed prefill would not be a full one: such models keep the cache off."""
    from transformers import LlamaConfig

    assert rope_refusal(LlamaConfig()) is None
    assert rope_refusal(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})) is None
    assert "dynamic" in str(rope_refusal(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})))
    nested = type("Config", (), {"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding": {"rope_type": "longrope"}}})()
    assert "longrope" in str(rope_refusal(nested))


def test_bitwise_comparisons_here_can_fail(long_dir: str) -> None:
    """In float32 a prefill cut into other passes than the engine's chunks gives other
    logits in the last bits: so a resumed prefill that did not compute exactly what the
    full one does would fail the comparisons above. Which cut shows it depends on the CPU's
    matrix kernels (on an AVX2 machine one pass over the whole prompt already differs; on an
    AVX-512 one it equals the 128-token chunks, and passes of 100 tokens differ)."""
    from transformers import DynamicCache

    engine = _load(long_dir, "float32", 0)
    prompt = system(engine)
    assert len(list(chunks(0, len(prompt)))) > 1
    first = solo(engine, row(prompt))["first"][None]

    def cut(size: int) -> torch.Tensor:
        cache = DynamicCache()
        with torch.inference_mode():
            for start in range(0, len(prompt), size):
                out = engine.model(input_ids=torch.tensor([prompt[start : start + size]]), cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    others = [cut(len(prompt)), cut(100), cut(64)]
    assert all(torch.allclose(other, first, atol=1e-3) for other in others)  # the same prefill, up to rounding
    assert not all(torch.equal(other, first) for other in others)


def test_resumed_rows_in_a_shared_batch_keep_their_tokens(on: Any, off: Any) -> None:
    """Rows that resume, rows that do not (short, or a long prompt never seen) and a
    joining row that resumes, in one batch: each row's tokens and first logits are its own
    on an engine without the cache, alone."""
    head = system(on)
    solo(on, row(head + ids(on, "\n# warm the cache")))
    rows = [
        row(head + ids(on, "\n# one"), SEEDED),
        row(ids(on, "hello", bos=True)),
        row(system(on, 280, "string.py")),
        row(head + ids(on, "\n# two, greedy")),
    ]
    joiner = row(head + ids(on, "\n# three, joining"), SEEDED)
    got = drive(on, rows, joins={3: joiner})
    assert [g["resumed"] for g in got] == [resumable(rows[0].prompt_ids, len(head)), 0, 0, 2 * CHUNK, 2 * CHUNK]
    for spec, result in zip([*rows, joiner], got, strict=True):
        reference = solo(off, spec, STEPS if spec is not joiner else STEPS - 3)
        assert same(result, reference)


def test_rows_with_different_steering_never_share_state(on: Any, off: Any) -> None:
    """Cached state is keyed by the row's deltas: a steered row does not resume an
    unsteered prompt's state nor one steered differently, and gets its own steered tokens;
    rows with equal deltas share, in separate requests and in one batch."""
    prompt = system(on) + ids(on, "\n# steer me")
    a = {STEER_LAYER: delta(on, 1)}
    b = {STEER_LAYER: delta(on, 2)}
    plain_ref, a_ref, b_ref = (solo(off, row(prompt, deltas=d)) for d in ({}, a, b))
    assert plain_ref["tokens"] != a_ref["tokens"] != b_ref["tokens"]  # the deltas change the tokens
    full = resumable(prompt, len(prompt))
    plain = solo(on, row(prompt))
    steered = solo(on, row(prompt, deltas=a))
    other = solo(on, row(prompt, deltas=b))
    assert [plain["resumed"], steered["resumed"], other["resumed"]] == [0, 0, 0]
    assert same(plain, plain_ref) and same(steered, a_ref) and same(other, b_ref)
    together = drive(on, [row(prompt, deltas=b), row(prompt), row(prompt, deltas=a)])
    assert [g["resumed"] for g in together] == [full, full, full]
    assert same(together[0], b_ref) and same(together[1], plain_ref) and same(together[2], a_ref)


def test_a_tapped_row_prefills_every_position_and_is_read_whole(on: Any, off: Any) -> None:
    """A row reading its residual stream reads every prompt position from its prefill, so
    it does not resume; what it computes still goes into the cache for others."""
    prompt = system(on) + ids(on, "\n# tapped")
    solo(on, row(prompt))
    tap = Tap(1, "post_steering")
    batch = on.open_batch([row(prompt, taps=(tap,))])
    try:
        on.step(batch, [None])
        (readout,) = on.readouts(batch)
        assert on.resumed(batch) == [0]
    finally:
        on.close(batch)
    assert readout.start == 0 and readout.vectors[tap].shape == (len(prompt), on.info.d_model)
    assert solo(on, row(prompt))["resumed"] == resumable(prompt, len(prompt))


def test_a_resumed_row_rewound_to_its_prompt_draws_its_tokens_again(on: Any, off: Any) -> None:
    prompt = system(on) + ids(on, "\n# rewind")
    solo(on, row(prompt))
    reference = solo(off, row(prompt, SEEDED))
    batch = on.open_batch([row(prompt, SEEDED)])
    tokens: list[int] = []
    try:
        for step in range(STEPS + 4):
            tokens.append(on.step(batch, [None])[0])
            if step == 3:
                on.rewind(batch, 0, 4)
                del tokens[-4:]
        assert on.resumed(batch) == [resumable(prompt, len(prompt))]
    finally:
        on.close(batch)
    assert tokens == reference["tokens"]


def test_the_cache_keeps_to_its_bound_and_evicts_the_least_recently_used(long_dir: str) -> None:
    """1 MiB holds 16 float32 blocks of the tiny model. Four prompts of 5 whole chunks
    each: the fourth evicts the least recently used prompt's last 4 blocks — the ends of a
    prompt go before its beginning — and the prompt used again in between stays whole. A
    prompt resumed from what eviction left of it still computes exactly."""
    engine = _load(long_dir, "float32", 1)
    reference = _load(long_dir, "float32", 0)
    cache: PrefixCache = engine.prefix
    prompts = [system(engine, 5 * CHUNK + 1, name) for name in ("textwrap.py", "string.py", "difflib.py", "argparse.py")]
    assert len({p[:CHUNK] for p in prompts}) == 4 and all(len(p) == 5 * CHUNK + 1 for p in prompts)
    for p in prompts[:3]:
        solo(engine, row(p), 2)
    block = cache.stats.bytes // 15
    assert cache.stats.blocks == 15 and 16 * block <= cache.max_bytes < 17 * block
    assert solo(engine, row(prompts[0]), 2)["resumed"] == 5 * CHUNK  # used again: now the most recent
    solo(engine, row(prompts[3]), 2)
    assert cache.stats.blocks == 16 and cache.stats.evicted_blocks == 4 and cache.stats.bytes <= cache.max_bytes
    got = [solo(engine, row(p))["resumed"] for p in (prompts[0], prompts[2], prompts[3])]
    assert got == [5 * CHUNK] * 3
    partial = solo(engine, row(prompts[1]))
    assert partial["resumed"] == CHUNK  # its first block was the most recent of its five
    assert same(partial, solo(reference, row(prompts[1])))


# ---------------------------------------------------------------- the cache alone


def _kv(prompt: Sequence[int], length: int, steer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values (one layer, one head) that encode their own tokens, positions and
    steering key, so a lookup can be checked against what it should have found."""
    column = torch.tensor([[t * 1000 + p + steer / 2 for p, t in enumerate(prompt[:length])]], dtype=torch.float32)
    return [column[None, :, :, None]], [-column[None, :, :, None]]


@settings(max_examples=60, deadline=None)
@given(
    script=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.integers(0, 1)), min_size=1, max_size=24),
    budget=st.integers(1, 12),
)
def test_lookups_return_cached_prefixes_of_their_own_prompt_and_steering(script: list[tuple[list[int], int]], budget: int) -> None:
    """Random prompts over three tokens (so they share prefixes), chunks of 2, two steering
    keys, a bound of a few blocks: the bytes never pass the bound, a lookup returns the
    keys and values stored for exactly its own prefix and steering key, and a prompt just
    stored resumes all its whole chunks when they fit."""
    chunk, block = 2, 2 * 2 * 4
    cache = PrefixCache(budget * block, "state", chunk=chunk)
    roots = [cache.root(None), cache.root({0: torch.ones(3)})]
    assert roots[0] == cache.root({0: torch.zeros(3)}) != roots[1]  # an all-zero delta is no delta
    for prompt, steer in script:
        found = cache.lookup(roots[steer], prompt)
        if found is not None:
            assert 0 < found.length <= len(prompt) - 1 and found.length % chunk == 0
            keys, values = _kv(prompt, found.length, steer)
            assert torch.equal(found.keys[0], keys[0]) and torch.equal(found.values[0], values[0])
        cache.store(roots[steer], prompt, *_kv(prompt, len(prompt), steer))
        assert cache.stats.bytes <= cache.max_bytes and cache.stats.bytes == cache.stats.blocks * block
        again = cache.lookup(roots[steer], prompt)
        if len(prompt) // chunk <= budget and len(prompt) > chunk:
            assert again is not None and again.length == (len(prompt) - 1) // chunk * chunk
