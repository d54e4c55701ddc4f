"""The lean prefill (millm_engines.transformers.leanprefill) and the transformers engine's
``join_together``: prompts prefilled in shared passes get, bit for bit, what they get
alone; the pass computes HF's forward (float32, to rounding); the load-time check refuses
products that depend on the row count; a request that fails in a shared pass fails alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from millm_core.api import JoinTogether, RowSpec, SamplingParams, Tap
from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_engines.transformers.fastpath import LlamaDecoder
from millm_engines.transformers.leanprefill import BLOCKS, LeanPrefill, Prompt, build, rows_refusal
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.packed import ops_available
from millm_engines.transformers.prefix import CHUNK
from millm_engines.transformers.settings import FAST_DECODE, PREFIX_CACHE_MB
from millm_engines.transformers.testing import tiny_model_dir

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=7)
PRE, POST = "pre_steering", "post_steering"
LENGTHS = (3, 21, CHUNK + 12, 2 * CHUNK + 44)  # one chunk, one, two, three


@pytest.fixture(scope="module")
def long_dir() -> str:
    return tiny_model_dir(context=2048)


def _decoder(path: str, dtype: torch.dtype) -> LlamaDecoder:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return LlamaDecoder(model, packing=None)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _delta(d_model: int, seed: int) -> torch.Tensor:
    return torch.randn(d_model, generator=torch.Generator().manual_seed(seed)) * 4.0


def _exact_block(decoder: LlamaDecoder) -> int:
    """The largest row block whose products this machine computes per row as alone, for
    every weight (1 always is): the test then holds the pass, not the kernels, to account."""
    weights = [w for layer in decoder.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
    return next((b for b in BLOCKS if all(rows_refusal(decoder._linear, w, b) is None for w in weights)), 1)


def _hf_reference(
    model: Any, prompt: Sequence[int], deltas: dict[int, torch.Tensor], taps: Sequence[Tap]
) -> tuple[torch.Tensor, Any, dict[Tap, torch.Tensor]]:
    """HF's forward over the whole prompt at once, the deltas added and the taps read by
    forward hooks: its last logits, its cache and what the taps read."""
    captured: dict[Tap, torch.Tensor] = {}

    def hook(layer: int) -> Any:
        def run(module: Any, args: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            if Tap(layer, PRE) in taps:
                captured[Tap(layer, PRE)] = hidden.clone()
            if layer in deltas:
                hidden = hidden + deltas[layer]
            if Tap(layer, POST) in taps:
                captured[Tap(layer, POST)] = hidden.clone()
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return run

    handles = [block.register_forward_hook(hook(i)) for i, block in enumerate(model.model.layers)]
    try:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([list(prompt)]), cache=cache, use_cache=True).logits[:, -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits, cache, captured


def test_the_pass_computes_hf_forward_to_rounding(long_dir: str) -> None:
    """float32, four prompts of one to three chunks in shared passes, one steered, one
    tapped: logits, keys, values and reads equal HF's forward over each whole prompt to
    float32 rounding (and the steered prompt differs from its unsteered self)."""
    decoder = _decoder(long_dir, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(long_dir, dtype=torch.float32).eval()
    prompts = _prompts(decoder.embed.shape[0])
    steer = {1: _delta(decoder.embed.shape[1], 3)}
    taps = (Tap(0, POST), Tap(1, PRE), Tap(1, POST))
    lean = [
        Prompt(prompts[0]),
        Prompt(prompts[1], deltas=steer),
        Prompt(prompts[2], taps=taps),
        Prompt(prompts[3], deltas=steer, taps=taps),
    ]
    LeanPrefill(decoder, BLOCKS[0]).run(lean)
    for p in lean:
        deltas = dict(p.deltas or {})
        logits, cache, reads = _hf_reference(model, p.tokens, deltas, p.taps)
        assert p.logits is not None and torch.allclose(p.logits, logits, atol=1e-4, rtol=1e-4)
        for i, layer in enumerate(cache.layers):
            assert torch.allclose(p.keys[i], layer.keys, atol=1e-4) and torch.allclose(p.values[i], layer.values, atol=1e-4)
        for tap in p.taps:
            read = torch.cat([c[tap] for c in p.captured], dim=1)
            assert torch.allclose(read, reads[tap], atol=1e-4), tap
    plain, _, _ = _hf_reference(model, prompts[1], {}, ())
    assert lean[1].logits is not None and (lean[1].logits - plain).abs().max() > 1e-2


def test_prompts_in_shared_passes_get_their_numbers_alone(long_dir: str) -> None:
    """bfloat16: every prompt's logits, keys, values and reads in one set of passes with
    the others equal its own run bit for bit: prompts of one to three chunks, a steered
    one, a tapped one, one resumed after its first chunk (in blocks of rows this machine
    multiplies exactly; float32's logits product depends on its row count here, which is
    why the engine never prefills float32 prompts together)."""
    dtype = torch.bfloat16
    decoder = _decoder(long_dir, dtype)
    prefill = LeanPrefill(decoder, _exact_block(decoder))
    prompts = _prompts(decoder.embed.shape[0], seed=1)
    steer = {0: _delta(decoder.embed.shape[1], 4).to(dtype)}
    taps = (Tap(0, PRE), Tap(1, POST))

    def fresh() -> list[Prompt]:
        return [Prompt(prompts[0], deltas=steer), Prompt(prompts[1], taps=taps), Prompt(prompts[2]), Prompt(prompts[3], deltas=steer)]

    alone = fresh()
    for p in alone:
        prefill.run([p])
    together = fresh()
    resumed = together[2]  # resumed from its own first chunk, as the prefix cache would
    resumed.done, resumed.keys, resumed.values = CHUNK, [k[:, :, :CHUNK] for k in alone[2].keys], [v[:, :, :CHUNK] for v in alone[2].values]
    prefill.run(together)
    for a, b in zip(alone, together, strict=True):
        assert a.logits is not None and b.logits is not None and torch.equal(a.logits, b.logits)
        assert all(torch.equal(x, y) for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values], strict=True))
        for tap in a.taps:
            assert torch.equal(torch.cat([c[tap] for c in a.captured], 1), torch.cat([c[tap] for c in b.captured], 1))


def test_the_check_refuses_products_that_depend_on_the_row_count(long_dir: str) -> None:
    decoder = _decoder(long_dir, torch.bfloat16)
    exact = decoder._linear
    decoder._linear = lambda x, w: exact(x, w) + (0.5 if x.shape[0] > 16 else 0.0)
    prefill, reason = build(decoder)
    assert prefill is None and reason is not None and "differs from its rows' products alone" in reason
    decoder._linear = lambda x, w: exact(x, w) + (0.5 if x.shape[0] > 2 and w is decoder.lm_head else 0.0)
    prefill, reason = build(decoder)
    assert prefill is None and reason is not None and "the logits" in reason
    prefill, reason = build(_decoder(long_dir, torch.float32))
    assert prefill is None and reason is not None and "float32" in reason


def _engine(path: str, dtype: str) -> Any:
    settings = load_settings({"dtype": dtype, "prefix_cache_mb": 0}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB])
    return load_engine(ModelLocation(path=path, served_name="t"), settings)


@pytest.fixture(scope="module")
def bf16(long_dir: str) -> Any:
    return _engine(long_dir, "bfloat16")


def test_the_engine_prefills_together_where_the_check_passes(bf16: Any, long_dir: str) -> None:
    """On a CPU with bf16 matrix kernels (oneDNN's; the machines CI runs on), bf16 prompts
    share passes; float32 prompts never do."""
    assert isinstance(bf16, JoinTogether)
    if ops_available():
        assert bf16.lean is not None and bf16.lean_refusal is None and bf16.lean.block in BLOCKS
    else:
        assert (bf16.lean is None) == (bf16.lean_refusal is not None)
    assert bf16.joins_together == (bf16.lean is not None)
    fp32 = _engine(long_dir, "float32")
    assert fp32.lean is None and "float32" in fp32.lean_refusal and not fp32.joins_together


def _spec(prompt: Sequence[int], sampling: SamplingParams = GREEDY, **extra: Any) -> RowSpec:
    return RowSpec(prompt_ids=tuple(prompt), sampling=sampling, max_new_tokens=64, **extra)


def _solo(engine: Any, rows: list[RowSpec], steps: int = 8) -> tuple[list[list[int]], list[torch.Tensor]]:
    batch = engine.open_batch(rows)
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        for r, token in enumerate(engine.step(batch, [None] * len(rows))):
            out[r].append(token)
    first = [t.clone() for t in batch.first_logits]
    engine.close(batch)
    return out, first


def test_requests_joining_together_keep_their_solo_tokens(bf16: Any) -> None:
    """A running request, then four joining in one call (two rows of one request, seeded;
    a steered one; one of three chunks; a tapped one): each row's first logits and tokens
    equal its request's run alone."""
    vocab, d_model = bf16.info.vocab_size, bf16.info.d_model
    prompts = _prompts(vocab, seed=2)
    steer = {1: tuple(_delta(d_model, 5).tolist())}
    requests = [
        [_spec(prompts[1], SEEDED), _spec(prompts[0], SEEDED)],
        [_spec(prompts[0], deltas=steer)],
        [_spec(prompts[3])],
        [_spec(prompts[1], taps=(Tap(1, POST),))],
    ]
    want = [_solo(bf16, rows) for rows in requests]
    batch = bf16.open_batch([_spec(prompts[2])])
    bf16.step(batch, [None])
    assert bf16.join_together(batch, requests) == [None] * 4
    got: list[list[int]] = [[t] for t in bf16.first_tokens(batch, [None] * 5)]
    first = [t.clone() for t in batch.first_logits[1:]]
    for _ in range(7):
        tokens = bf16.step(batch, [None] * 6)
        for r in range(5):
            got[r].append(tokens[r + 1])
    bf16.close(batch)
    flat_tokens = [row for tokens, _ in want for row in tokens]
    flat_first = [row for _, logits in want for row in logits]
    assert got == flat_tokens
    assert all(torch.equal(a, b) for a, b in zip(first, flat_first, strict=True))


def test_a_request_that_fails_in_a_shared_pass_fails_alone(bf16: Any) -> None:
    """A prompt with a token outside the vocabulary fails the shared pass; each request is
    then prefilled alone: that one fails, a bad tap layer fails at once, the others join
    with their solo tokens."""
    vocab = bf16.info.vocab_size
    prompts = _prompts(vocab, seed=3)
    good = [[_spec(prompts[0])], [_spec(prompts[2])]]
    want = [_solo(bf16, rows)[0][0] for rows in good]
    bad_token = [_spec([*prompts[1][:5], vocab + 7])]
    bad_tap = [_spec(prompts[1], taps=(Tap(99, POST),))]
    batch = bf16.open_batch([_spec(prompts[3])])
    bf16.step(batch, [None])
    outcome = bf16.join_together(batch, [good[0], bad_token, bad_tap, good[1]])
    assert outcome[0] is None and outcome[3] is None
    assert isinstance(outcome[1], (IndexError, RuntimeError)) and isinstance(outcome[2], ValueError)
    got: list[list[int]] = [[t] for t in bf16.first_tokens(batch, [None] * 2)]
    for _ in range(7):
        tokens = bf16.step(batch, [None] * 3)
        for r in range(2):
            got[r].append(tokens[r + 1])
    bf16.close(batch)
    assert got == want


def test_the_rows_check_can_fail() -> None:
    """rows_refusal itself: a product computed row by row passes; one that adds the row
    count fails at two rows."""
    weight = torch.randn((8, 4))

    def by_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x[r : r + 1], w) for r in range(x.shape[0])])

    assert rows_refusal(by_row, weight, 4) is None
    failed = rows_refusal(lambda x, w: by_row(x, w) + x.shape[0], weight, 4)
    assert failed is not None and "of 2 rows" in failed


def test_a_request_s_rows_with_one_long_prompt_resume_from_the_first(long_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three seeded rows of one prompt of three chunks, the prefix cache on: the first row
    computes it, the others resume its whole chunks (together, in a second pass), and
    every row's tokens equal those it gets with the cache off."""
    settings = load_settings({"dtype": "bfloat16", "prefix_cache_mb": 64}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB])
    cached = load_engine(ModelLocation(path=long_dir, served_name="t"), settings)
    off = _engine(long_dir, "bfloat16")
    prompt = _prompts(cached.info.vocab_size, seed=4)[3]
    rows = [_spec(prompt, SamplingParams(temperature=1.0, seed=s)) for s in (1, 2, 3)]
    passes: list[list[int]] = []  # each pass's prompts' resumed positions
    if cached.lean is not None:
        run = cached.lean.run
        monkeypatch.setattr(cached.lean, "run", lambda prompts: (passes.append([p.done for p in prompts]), run(prompts))[1])
    else:  # each row alone through HF's forward, one after another
        assert not ops_available()
    batch = cached.open_batch(rows)
    got: list[list[int]] = [[t] for t in cached.step(batch, [None] * 3)]
    assert cached.resumed(batch) == [0, 2 * CHUNK, 2 * CHUNK]
    assert passes == ([[0], [2 * CHUNK, 2 * CHUNK]] if cached.lean is not None else [])
    for _ in range(5):
        for r, token in enumerate(cached.step(batch, [None] * 3)):
            got[r].append(token)
    cached.close(batch)
    assert got == _solo(off, rows, steps=6)[0]


def test_requests_sharing_a_long_prefix_resume_it_from_the_first(long_dir: str) -> None:
    """Three requests whose prompts share two chunks and end differently join in one call,
    the prefix cache on: the first computes the shared part, the others resume it in a
    second pass, and every one's tokens equal those it gets with the cache off."""
    settings = load_settings({"dtype": "bfloat16", "prefix_cache_mb": 64}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB])
    cached = load_engine(ModelLocation(path=long_dir, served_name="t"), settings)
    off = _engine(long_dir, "bfloat16")
    shared = _prompts(cached.info.vocab_size, seed=5)[3][: 2 * CHUNK + 7]
    tails = _prompts(cached.info.vocab_size, seed=6)
    requests = [[_spec(shared + tail)] for tail in (tails[0], tails[1], tails[0][:1])]
    want = [_solo(off, rows, steps=6)[0][0] for rows in requests]
    batch = cached.open_batch([_spec(tails[2])])
    cached.step(batch, [None])
    assert cached.join_together(batch, requests) == [None] * 3
    got: list[list[int]] = [[t] for t in cached.first_tokens(batch, [None] * 3)]
    assert cached.resumed(batch)[1:] == [0, 2 * CHUNK, 2 * CHUNK]
    for _ in range(5):
        for r, token in enumerate(cached.step(batch, [None] * 4)[1:]):
            got[r].append(token)
    cached.close(batch)
    assert got == want
