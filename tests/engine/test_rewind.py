"""Rewinding rows (``Capability.REWIND``) on every engine path: the transformers engine's lean
decode step in float32 and bfloat16, its generic HF forward in both, and the GGUF engine
with one sequence and with eight sharing llama.cpp's decode calls.

A rewound row must go on exactly as if the tokens taken back had never been drawn: with the
same biases it draws them again; with a bias against the token it would draw again it
continues like a fresh run biased at that token; the rows beside it keep their own tokens.
Every test that compares tokens also checks that a rewind that did nothing would fail it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from millm_core.api import Capability, Joinable, Readout, Rewinding, RowSpec, SamplingParams, ServedModel, Tap
from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_engines.gguf import engine as gguf_module
from millm_engines.transformers import engine as transformers_module
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.settings import FAST_DECODE

from ..gguf.helpers import load_gguf
from .test_steering_rows import delta
from .test_taps import assert_close, hooked_reference

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=4321)
STEPS = 12
BAN = -1e9
KINDS = ["fast-float32", "fast-bfloat16", "hf-float32", "hf-bfloat16", "gguf-1", "gguf-8"]
# (tokens drawn, tokens taken back): part of them, all of them (back to the prompt), one.
CUTS = [(6, 2), (6, 6), (1, 1), (5, 1)]


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(kind: str, tiny_dir: str, gguf_model: ServedModel, gguf_path: str) -> Iterator[Any]:
    if kind == "gguf-8":  # the session's GGUF model: eight sequences share each decode call
        assert gguf_model.engine.parallel == 8
        yield gguf_model.engine
        return
    if kind == "gguf-1":
        served = load_gguf(gguf_path, gguf_parallel=1)
        assert served.engine.parallel == 1
        yield served.engine
        served.engine.llm.close()
        return
    path, dtype = kind.split("-")
    settings = load_settings({"dtype": dtype, "fast_decode": path == "fast"}, environ={}, plugin_settings=[FAST_DECODE])
    loaded = load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)
    assert (loaded.fast is not None) == (path == "fast") and loaded.info.dtype == dtype
    yield loaded


def ids(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.encode(text, add_special_tokens=True))


def spec(engine: Any, text: str, sampling: SamplingParams = GREEDY, **extra: Any) -> RowSpec:
    return RowSpec(prompt_ids=ids(engine, text), sampling=sampling, max_new_tokens=64, **extra)


def drive(
    engine: Any,
    rows: Sequence[RowSpec],
    steps: int,
    *,
    joins: Mapping[int, Sequence[RowSpec]] | None = None,
    leave: Mapping[int, Sequence[int]] | None = None,
    rewinds: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    bans: Mapping[tuple[int, int], int] | None = None,
    call: bool = True,
    reads: dict[int, list[Readout]] | None = None,
) -> dict[int, list[int]]:
    """Step ``rows`` (ids 0..) ``steps`` times and return each row's tokens, those taken
    back removed. ``joins[s]``: rows joining before step s (the next ids); ``leave[s]``: ids
    retained away after step s; ``rewinds[s]``: ``(id, k)`` rewound after step s, after
    that retain (as the core does); ``bans[(s, id)]``: a token row ``id`` gets a -1e9 bias
    against at step s. ``call=False`` leaves the engine out of the rewinds (what a rewind
    that did nothing would give). ``reads`` collects each row's readouts."""
    out: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    live = list(out)
    batch = engine.open_batch(list(rows))
    try:
        for step in range(steps):
            for joining in (joins or {}).get(step, ()):
                engine.join(batch, [joining])
                live.append(len(out))
                out[len(out)] = []
            biases = [{bans[step, i]: BAN} if (step, i) in (bans or {}) else None for i in live]
            for i, token in zip(live, engine.step(batch, biases), strict=True):
                out[i].append(token)
            if reads is not None:
                for i, readout in zip(live, engine.readouts(batch), strict=True):
                    if readout is not None:
                        reads.setdefault(i, []).append(readout)
            gone = set((leave or {}).get(step, ()))
            if gone:
                keep = [p for p, i in enumerate(live) if i not in gone]
                engine.retain(batch, keep)
                live = [live[p] for p in keep]
            for i, k in (rewinds or {}).get(step, ()):
                if call:
                    engine.rewind(batch, live.index(i), k)
                del out[i][-k:]
    finally:
        engine.close(batch)
    return out


def solo(engine: Any, row: RowSpec, steps: int, bans: Mapping[int, int] | None = None) -> list[int]:
    """The row alone, with a -1e9 bias against ``bans[j]`` when it draws its token j."""
    return drive(engine, [row], steps, bans={(j, 0): t for j, t in (bans or {}).items()})[0]


def test_the_engine_declares_rewind(engine: Any) -> None:
    assert Capability.REWIND in engine.capabilities and isinstance(engine, Rewinding)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("n", "k"), CUTS)
def test_a_rewound_row_draws_its_tokens_again(engine: Any, sampling: SamplingParams, n: int, k: int) -> None:
    row = spec(engine, "The capital of France is", sampling)
    fresh = solo(engine, row, STEPS + n)
    ignored = fresh[: n - k] + fresh[n : n + STEPS - (n - k)]  # had the rewind done nothing
    assert ignored != fresh[:STEPS]
    assert drive(engine, [row], STEPS + k, rewinds={n - 1: [(0, k)]})[0] == fresh[:STEPS]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("n", "k"), CUTS)
def test_a_bias_after_a_rewind_continues_like_a_fresh_run(engine: Any, sampling: SamplingParams, n: int, k: int) -> None:
    row = spec(engine, "def main():\n    return", sampling)
    fresh = solo(engine, row, STEPS)
    banned = fresh[n - k]  # what the rewound row would draw again
    reference = solo(engine, row, STEPS, bans={n - k: banned})  # drew n - k tokens, then the bias
    assert reference[n - k] != banned
    script: dict[str, Any] = {"rewinds": {n - 1: [(0, k)]}, "bans": {(n, 0): banned}}
    assert drive(engine, [row], STEPS + k, **script)[0] == reference
    assert drive(engine, [row], STEPS + k, **script, call=False)[0] != reference  # a rewind that did nothing fails


def test_rewinds_in_a_row_and_back_to_the_prompt_twice(engine: Any) -> None:
    """Two rewinds with no step between them add up; a row taken back to its prompt, stepped
    and taken back to its prompt again still draws its own tokens."""
    row = spec(engine, "Once upon a time there was", SEEDED)
    fresh = solo(engine, row, STEPS)
    # after step 4: 5 drawn, -2 -1 -> 2; step 5..7 -> 5, back to the prompt; 8..10 -> 3, back again.
    script = {4: [(0, 2), (0, 1)], 7: [(0, 5)], 10: [(0, 3)]}
    steps = 11 + STEPS
    assert drive(engine, [row], steps, rewinds=script)[0] == fresh
    assert drive(engine, [row], steps, rewinds=script, call=False)[0] != fresh


def test_a_one_token_prompt_taken_back_entirely(engine: Any) -> None:
    """Back to a one-token prompt the row keeps no cache entry at all, then runs on."""
    row = RowSpec(prompt_ids=ids(engine, "hello")[-1:], sampling=SEEDED, max_new_tokens=64)
    fresh = solo(engine, row, STEPS)
    assert fresh[:3] != fresh[3:6]  # had the rewind done nothing
    assert drive(engine, [row], STEPS + 3, rewinds={2: [(0, 3)]})[0] == fresh


def test_out_of_range_rewinds_are_refused_and_change_nothing(engine: Any) -> None:
    row = spec(engine, "import json\nimport os\n")
    fresh = solo(engine, row, 6)
    batch = engine.open_batch([row])
    try:
        with pytest.raises(ValueError):
            engine.rewind(batch, 0, 1)  # nothing drawn yet
        got = [engine.step(batch, [None])[0] for _ in range(3)]
        for row_index, k in ((0, 0), (0, 4), (0, -1), (1, 1), (-1, 1)):
            with pytest.raises(ValueError):
                engine.rewind(batch, row_index, k)
        if isinstance(engine, Joinable) and engine.can_join([row]):
            engine.join(batch, [row])
            with pytest.raises(ValueError):
                engine.rewind(batch, 1, 1)  # joined, not stepped yet: nothing to take back
            got += [engine.step(batch, [None, None])[0] for _ in range(3)]
        else:
            got += [engine.step(batch, [None])[0] for _ in range(3)]
    finally:
        engine.close(batch)
    assert got == fresh


# Engines whose rows share batches token-exactly: not GGUF with one sequence (rows never
# share a batch) nor the generic HF forward in bfloat16 (not batch-invariant: it says so).
SHARING = pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("gguf-1", "hf-bfloat16")], indirect=True)
TRANSFORMERS = pytest.mark.parametrize("kind", [k for k in KINDS if not k.startswith("gguf")], indirect=True)
# Taps are compared with a float32 reference on the transformers engine.
FLOAT32_TAPS = pytest.mark.parametrize("kind", ["fast-float32", "hf-float32"], indirect=True)


@SHARING
def test_rewound_rows_share_a_batch_with_rows_that_are_not(engine: Any, kind: str) -> None:
    """Rows rewound (one partway and again later, with a bias; one back to its prompt; a
    joined one) beside a row never rewound and one retained away at a rewind's step: every
    row gets, token for token, what it gets alone with the same biases."""
    gone = spec(engine, "Once upon a time")
    longest = spec(engine, "The capital of France is Paris, and the capital of Spain is")  # its rewind frees columns
    seeded = spec(engine, "def main():\n    return", SEEDED)
    plain = spec(engine, "x")
    joiner = spec(engine, "import json\nimport os\n", SEEDED)
    joins = isinstance(engine, Joinable) and engine.can_join([joiner])
    alone = {i: solo(engine, r, 16) for i, r in enumerate([gone, longest, seeded, plain, joiner])}
    banned = alone[1][4]
    # ids: 0 gone, 1 longest, 2 seeded, 3 plain, 4 joiner (joins before step 2).
    rewinds = {5: [(1, 2), (2, 6)], 10: [(1, 1)], **({8: [(4, 3)]} if joins else {})}
    script: dict[str, Any] = {
        "joins": {2: [joiner]} if joins else {},
        "leave": {5: [0]},
        "rewinds": rewinds,
        "bans": {(6, 1): banned},
    }
    got = drive(engine, [gone, longest, seeded, plain], 16, **script)
    expected = {
        0: alone[0][:6],
        1: solo(engine, longest, 13, bans={4: banned}),
        2: alone[2][:10],
        3: alone[3],
        **({4: alone[4][:11]} if joins else {}),
    }
    assert expected[1][4] != banned
    assert got == expected
    idle = drive(engine, [gone, longest, seeded, plain], 16, **script, call=False)
    assert all(idle[i] != expected[i] for i in (1, 2, *((4,) if joins else ())))  # rewinds that did nothing fail


@SHARING
def test_a_retain_between_a_rewind_and_the_next_step_keeps_the_rewinds(engine: Any, kind: str) -> None:
    """The engine API lets a retain come between a rewind and the next step: the rows
    kept move up, their rewinds with them (one back to its prompt, one partway)."""
    rows = [spec(engine, "hello"), spec(engine, "Once upon a time there was", SEEDED), spec(engine, "def f(x):")]
    alone = [solo(engine, r, STEPS + 2) for r in rows]
    batch = engine.open_batch(rows)
    got: list[list[int]] = [[], [], []]
    try:
        for _ in range(4):
            for tokens, token in zip(got, engine.step(batch, [None] * 3), strict=True):
                tokens.append(token)
        engine.rewind(batch, 1, 4)
        engine.rewind(batch, 2, 2)
        del got[1][-4:], got[2][-2:]
        engine.retain(batch, [1, 2])
        got = got[1:]
        while len(got[0]) < STEPS:
            for tokens, token in zip(got, engine.step(batch, [None, None]), strict=True):
                tokens.append(token)
    finally:
        engine.close(batch)
    assert got == [alone[1][:STEPS], alone[2]]


@SHARING
def test_a_rewind_in_a_batch_of_equal_rows(engine: Any, kind: str) -> None:
    """Rows of one length share their cache columns unpadded: a rewind must not move the
    row that stays."""
    prompt = "The weather today"
    rows = [spec(engine, prompt), spec(engine, prompt, SEEDED)]
    alone = solo(engine, rows[0], STEPS)
    got = drive(engine, rows, STEPS + 3, rewinds={4: [(0, 3)]})
    assert got == {0: alone, 1: solo(engine, rows[1], STEPS + 3)}
    assert drive(engine, rows, STEPS + 3, rewinds={4: [(0, 3)]}, call=False)[0] != alone


def width(batch: Any) -> int:
    """The transformers engine's cache columns (the lean step's cache or HF's)."""
    return int(batch.kv.length if batch.kv is not None else batch.cache.get_seq_length())


@TRANSFORMERS
def test_a_rewind_gives_back_its_cache_columns(engine: Any, kind: str) -> None:
    """The cache stays as wide as its longest row (what admission's memory estimate counts),
    however often rows are rewound; a row alone goes back to the unmasked path. (The GGUF
    engine's cells: tests/gguf/test_gguf_engine.py.)"""
    long, short = spec(engine, "The capital of France is Paris, and the capital of Spain is"), spec(engine, "x")
    grown, small = len(long.prompt_ids), len(short.prompt_ids)
    batch = engine.open_batch([long])
    try:
        for _ in range(8):
            engine.step(batch, [None])
        assert width(batch) == grown + 7  # the last draw is not fed yet
        engine.rewind(batch, 0, 5)
        assert (width(batch), batch.mask) == (grown + 2, None)
        engine.rewind(batch, 0, 3)  # back to the prompt: its last token is fed again
        assert (width(batch), batch.mask) == (grown - 1, None)
    finally:
        engine.close(batch)
    batch = engine.open_batch([long, short])
    try:
        for _ in range(8):
            engine.step(batch, [None, None])
        engine.rewind(batch, 0, 6)
        assert width(batch) == max(grown + 1, small + 7)
        engine.rewind(batch, 1, 8)
        assert width(batch) == max(grown + 1, small - 1)
    finally:
        engine.close(batch)


def test_a_sliding_window_model_on_the_hf_forward_does_not_declare_rewind(tiny_dir: str) -> None:
    """HF's sliding-window cache layers forget a row's start, which a rewind would need:
    the engine leaves the capability out and says why (a random two-layer Mistral)."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from millm_core.api import ModelInfo
    from millm_engines.transformers.engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, sliding_window=8
    )
    info = ModelInfo(served_name="sw", engine="transformers", context_length=64, d_model=32, n_layers=2, vocab_size=len(tokenizer))
    engine = TransformersEngine(MistralForCausalLM(config).eval(), tokenizer, info, frozenset({0}))
    assert Capability.REWIND not in engine.capabilities and "DynamicSlidingWindowLayer" in engine.refusals[Capability.REWIND]
    assert Capability.TAPS in engine.capabilities


# ---------------------------------------------------------------- exactness, taps


def test_a_rewound_row_samples_from_the_very_logits_of_a_fresh_run(engine: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit, not only token for token: the logits each step samples from (read by
    wrapping the engine's own sampler, which still samples) after a rewind equal a fresh
    run's at the same positions, also back to the prompt, whose last token a decode step
    would otherwise compute only to rounding."""
    seen: list[Any] = []
    if kind.startswith("gguf"):
        real_row = gguf_module.sample_row

        def sample_row(logits: np.ndarray, *args: Any) -> int:
            seen.append(logits.copy())
            return real_row(logits, *args)

        monkeypatch.setattr(gguf_module, "sample_row", sample_row)
        same: Any = np.array_equal
    else:
        real = transformers_module.sample

        def sample(logits: torch.Tensor, *args: Any) -> list[int]:
            seen.append(logits[0].clone())
            return real(logits, *args)

        monkeypatch.setattr(transformers_module, "sample", sample)
        same = torch.equal
    row = spec(engine, "Once upon a time there was", SEEDED)
    solo(engine, row, STEPS)
    fresh, seen[:] = list(seen), []
    for n, k in ((5, 2), (5, 5), (3, 3)):
        drive(engine, [row], STEPS + k, rewinds={n - 1: [(0, k)]})
        again, seen[:] = seen[n:], []
        assert len(again) == STEPS - (n - k)
        assert all(same(a, b) for a, b in zip(again, fresh[n - k :], strict=True)), f"n={n}, k={k}"


TAPS = (Tap(0, "pre_steering"), Tap(1, "post_steering"))


@FLOAT32_TAPS
def test_taps_after_a_rewind_start_at_the_refed_token(engine: Any, kind: str) -> None:
    """A tapped, steered row: after a rewind each readout starts at the re-fed token's
    position (the last prompt token's after a rewind to the prompt), and the vectors last
    read at each position the row keeps equal a hook's on its final tokens run alone."""
    row = spec(engine, "The capital of France is", deltas={1: delta(engine, 3)}, taps=TAPS)
    plain = spec(engine, "hello")
    prompt = len(row.prompt_ids)
    reads: dict[int, list[Readout]] = {}
    # 6 drawn, back to 4; 4 more steps -> 8 drawn, back to the prompt; 3 more steps.
    got = drive(engine, [row, plain], 13, rewinds={5: [(0, 2)], 9: [(0, 8)]}, reads=reads)
    starts = [r.start for r in reads[0]]
    assert starts == [0, *range(prompt, prompt + 5), *range(prompt + 3, prompt + 7), *range(prompt - 1, prompt + 2)]
    assert 1 not in reads
    fed = list(row.prompt_ids) + got[0][:-1]
    for tap in TAPS:
        latest: dict[int, np.ndarray] = {}
        for readout in reads[0]:
            for offset, vector in enumerate(readout.vectors[tap]):
                latest[readout.start + offset] = vector
        latest = {p: v for p, v in latest.items() if p < len(fed)}  # positions since taken back go
        assert sorted(latest) == list(range(len(fed)))
        reference = hooked_reference(engine, fed, tap.layer, row.deltas.get(tap.layer))[tap.point]
        assert_close(np.stack([latest[p] for p in range(len(fed))]), reference)
