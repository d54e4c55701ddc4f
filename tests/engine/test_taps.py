"""The taps capability on the transformers engine: each tapped row's residual vectors,
read in the batch's own forward passes, equal what a hook on the model reads for that row
run alone (fp32, 1e-5), before and after its steering delta, with rows that asked for
nothing and rows that join mid-batch beside it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from millm_core.config import load_settings
from millm_core.engine import Capability, ModelLocation, Readout, RowSpec, SamplingParams, Tap, Tapping
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.settings import FAST_DECODE

from .test_steering_rows import delta

GREEDY = SamplingParams(temperature=0.0)
STEPS = 6
PRE, POST = "pre_steering", "post_steering"


@pytest.fixture(scope="module", params=[True, False], ids=["fast-decode", "hf-forward"])
def engine(request, tiny_dir: str):  # type: ignore[no-untyped-def]
    settings = load_settings({"fast_decode": request.param}, environ={}, plugin_settings=[FAST_DECODE])
    return load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)


class Recorder:
    """What the scheduler does with readouts, for one engine: per row, the vectors of
    every tap by absolute position, and the tokens drawn."""

    def __init__(self) -> None:
        self.reads: list[list[Readout]] = []
        self.tokens: list[list[int]] = []

    def add_rows(self, count: int) -> None:
        self.reads += [[] for _ in range(count)]
        self.tokens += [[] for _ in range(count)]

    def vectors(self, row: int, tap: Tap) -> np.ndarray:
        parts = [r for r in self.reads[row] if tap in r.vectors]
        starts = [r.start for r in parts]
        assert starts == sorted(starts)
        stacked = np.concatenate([r.vectors[tap] for r in parts])
        assert starts[0] == 0 and len(stacked) == starts[-1] + len(parts[-1].vectors[tap])  # contiguous from 0
        return stacked


def run(
    engine: Any, rows: list[RowSpec], steps: int = STEPS, joins: dict[int, list[RowSpec]] | None = None, eager: bool = False
) -> Recorder:
    """Step ``rows`` (and ``joins[k]`` joined before step k) for ``steps`` steps; rows are
    never retired, so row positions stay stable. With ``eager``, joined rows draw their
    first token at once (``first_tokens``), as the scheduler has them do."""
    rec = Recorder()
    rec.add_rows(len(rows))
    batch = engine.open_batch(rows)
    live = list(rows)

    def record(tokens: list[int], first: int = 0) -> None:
        readouts = engine.readouts(batch)
        assert len(readouts) == len(live)
        assert all(r is None for r in readouts[:first]), "rows that drew nothing were handed readouts"
        for i, (tok, readout) in enumerate(zip(tokens, readouts[first:], strict=True), start=first):
            rec.tokens[i].append(tok)
            if readout is not None:
                rec.reads[i].append(readout)

    for k in range(steps):
        joining = (joins or {}).get(k, [])
        if joining:
            engine.join(batch, joining)
            live += joining
            rec.add_rows(len(joining))
            if eager and k > 0:
                record(engine.first_tokens(batch, [None] * len(joining)), len(live) - len(joining))
        record(engine.step(batch, [None] * len(live)))
    engine.close(batch)
    return rec


def hooked_reference(engine: Any, ids: list[int], layer: int, vector: tuple[float, ...] | None) -> dict[str, np.ndarray]:
    """The reference: one HF forward over the row's fed tokens alone, with a forward hook
    written here that adds the row's delta and records the block's output around it."""
    seen: dict[str, np.ndarray] = {}
    add = torch.tensor(vector, dtype=torch.float32) if vector is not None else None

    def hook(module: Any, args: Any, out: Any) -> Any:
        hidden = out[0] if isinstance(out, tuple) else out
        seen[PRE] = hidden[0].float().numpy().copy()
        steered = hidden + add if add is not None else hidden
        seen[POST] = steered[0].float().numpy().copy()
        return (steered, *out[1:]) if isinstance(out, tuple) else steered

    handle = engine.model.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            engine.model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return seen


def check_row(engine: Any, rec: Recorder, row: int, spec: RowSpec) -> None:
    fed = list(spec.prompt_ids) + rec.tokens[row][:-1]  # the last draw is never fed
    for tap in spec.taps:
        ref = hooked_reference(engine, fed, tap.layer, spec.deltas.get(tap.layer))
        got = rec.vectors(row, tap)
        assert got.shape == ref[tap.point].shape
        assert_close(got, ref[tap.point])


def assert_close(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal to 1e-5 of the vectors' scale: the decode step's one-column products round
    differently from the reference's whole-sequence ones (fp32, not bit-identical), and
    this tiny model's residual entries reach ~50."""
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=0)


def test_the_engine_declares_taps(engine) -> None:  # type: ignore[no-untyped-def]
    assert Capability.TAPS in engine.capabilities and isinstance(engine, Tapping)


def test_a_tapped_row_alone_reads_what_a_hook_reads(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(engine.encode("The capital of France is", add_special_tokens=True))
    spec = RowSpec(prompt_ids=prompt, sampling=GREEDY, taps=(Tap(0, POST), Tap(1, PRE), Tap(1, POST)))
    rec = run(engine, [spec])
    check_row(engine, rec, 0, spec)
    assert [r.start for r in rec.reads[0]] == [0, *range(len(prompt), len(prompt) + STEPS - 1)]


def test_pre_and_post_steering_differ_by_the_rows_delta(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(engine.encode("import json", add_special_tokens=True))
    vector = delta(engine, 3)
    spec = RowSpec(prompt_ids=prompt, sampling=GREEDY, deltas={1: vector}, taps=(Tap(1, PRE), Tap(1, POST)))
    rec = run(engine, [spec])
    check_row(engine, rec, 0, spec)
    diff = rec.vectors(0, Tap(1, POST)) - rec.vectors(0, Tap(1, PRE))
    assert_close(diff, np.broadcast_to(np.array(vector, dtype=np.float32), diff.shape))


def test_tapped_rows_share_a_batch_with_rows_that_asked_nothing(engine) -> None:  # type: ignore[no-untyped-def]
    a = tuple(engine.encode("def parse(value):", add_special_tokens=True))
    b = tuple(engine.encode("x", add_special_tokens=True))
    c = tuple(engine.encode("The weather today is sunny and", add_special_tokens=True))
    rows = [
        RowSpec(prompt_ids=a, sampling=GREEDY, taps=(Tap(1, POST),)),
        RowSpec(prompt_ids=b, sampling=GREEDY, deltas={0: delta(engine, 1)}),
        RowSpec(prompt_ids=c, sampling=GREEDY, deltas={1: delta(engine, 2)}, taps=(Tap(0, PRE), Tap(1, PRE))),
    ]
    rec = run(engine, rows)
    assert rec.reads[1] == []  # a row without taps reads nothing
    for row, spec in enumerate(rows):
        if spec.taps:
            check_row(engine, rec, row, spec)
        assert rec.tokens[row] == run(engine, [spec]).tokens[0]  # the tokens are each row's solo tokens


@pytest.fixture(scope="module")
def fast_engine(tiny_dir: str):  # type: ignore[no-untyped-def]
    """Rows join a running batch only on the lean decode step."""
    settings = load_settings({"fast_decode": True}, environ={}, plugin_settings=[FAST_DECODE])
    return load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)


def test_rows_joining_mid_batch_read_their_prompt_then_their_steps(fast_engine) -> None:  # type: ignore[no-untyped-def]
    engine = fast_engine
    assert engine.can_join([])
    first = RowSpec(prompt_ids=tuple(engine.encode("Once upon a time", add_special_tokens=True)), sampling=GREEDY, taps=(Tap(1, POST),))
    joiner = RowSpec(
        prompt_ids=tuple(engine.encode("The capital of France is Paris, and", add_special_tokens=True)),
        sampling=GREEDY,
        deltas={1: delta(engine, 5)},
        taps=(Tap(1, PRE), Tap(0, POST)),
    )
    plain = RowSpec(prompt_ids=tuple(engine.encode("hello", add_special_tokens=True)), sampling=GREEDY)
    for eager in (False, True):  # joined rows drawn with the next step, or at once
        rec = run(engine, [first], steps=STEPS + 3, joins={2: [plain, joiner]}, eager=eager)
        check_row(engine, rec, 0, first)
        check_row(engine, rec, 2, joiner)
        assert rec.reads[1] == []
        assert len(rec.tokens[2]) == STEPS + 1 + eager


def test_a_tap_outside_the_model_is_refused(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="outside"):
        engine.open_batch([RowSpec(prompt_ids=(1, 2), sampling=GREEDY, taps=(Tap(99, POST),))])
