"""Per-row steering deltas in the engine: applied at the block's output, to that row only."""

from __future__ import annotations

import pytest
import torch

from millm_core.config import load_settings
from millm_core.engine import ModelLocation, RowSpec, SamplingParams
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.settings import FAST_DECODE

GREEDY = SamplingParams(temperature=0.0)
LAYER = 1


def delta(engine, seed: int = 0, scale: float = 4.0) -> tuple[float, ...]:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(engine.info.d_model, generator=g) * scale).tolist())


def run(engine, rows: list[RowSpec], steps: int = 16) -> list[list[int]]:  # type: ignore[no-untyped-def]
    batch = engine.open_batch(rows)
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        for i, tok in enumerate(engine.step(batch, [None] * len(rows))):
            out[i].append(tok)
    engine.close(batch)
    return out


def hf_steered_greedy(engine, prompt: list[int], vector: tuple[float, ...], steps: int = 16, layer: int = LAYER) -> list[int]:  # type: ignore[no-untyped-def]
    """The reference: HF generate with a forward hook written here, independently."""
    add = torch.tensor(vector, dtype=next(engine.model.parameters()).dtype)
    handle = engine.model.model.layers[layer].register_forward_hook(lambda m, a, out: out + add)
    try:
        with torch.no_grad():
            out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        handle.remove()
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=[True, False], ids=["fast-decode", "hf-forward"])
def engine(request, tiny_dir: str):  # type: ignore[no-untyped-def]
    return load_engine(ModelLocation(path=tiny_dir, served_name="t"), load_settings({"fast_decode": request.param}, environ={}, plugin_settings=[FAST_DECODE]))


# The lean step runs its layers in stretches that end at steered layers: a delta on the
# first layer splits the step, one on the last ends its only stretch.
@pytest.mark.parametrize("where", ["first", "last"])
def test_steered_row_matches_an_independent_hooked_reference(engine, where: str) -> None:  # type: ignore[no-untyped-def]
    layers = len(engine.model.model.layers)
    layer = {"first": 0, "last": layers - 1}[where]
    prompt = engine.encode("The capital of France is", add_special_tokens=True)
    vector = delta(engine)
    steered = run(engine, [RowSpec(prompt_ids=tuple(prompt), sampling=GREEDY, deltas={layer: vector})])[0]
    plain = run(engine, [RowSpec(prompt_ids=tuple(prompt), sampling=GREEDY)])[0]
    assert steered == hf_steered_greedy(engine, prompt, vector, layer=layer)
    assert steered != plain  # the delta is large enough to change the text


def test_steered_and_unsteered_rows_share_a_batch(engine) -> None:  # type: ignore[no-untyped-def]
    a = tuple(engine.encode("import json", add_special_tokens=True))
    b = tuple(engine.encode("def parse(value):", add_special_tokens=True))
    steered_a = RowSpec(prompt_ids=a, sampling=GREEDY, deltas={LAYER: delta(engine, 1)})
    plain_b = RowSpec(prompt_ids=b, sampling=GREEDY)
    steered_b = RowSpec(prompt_ids=b, sampling=GREEDY, deltas={0: delta(engine, 2)})
    together = run(engine, [steered_a, plain_b, steered_b])
    assert together == [run(engine, [row])[0] for row in (steered_a, plain_b, steered_b)]


def test_no_hook_outlives_a_step(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(engine.encode("x", add_special_tokens=True))
    run(engine, [RowSpec(prompt_ids=prompt, sampling=GREEDY, deltas={LAYER: delta(engine)})], steps=3)
    assert all(not layer._forward_hooks for layer in engine.model.model.layers)


def test_bad_layer_is_refused(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="outside"):
        engine.open_batch([RowSpec(prompt_ids=(1, 2), sampling=GREEDY, deltas={99: delta(engine)})])
