"""Batch invariance on the lean decode step, in float32 and bfloat16: a greedy row's tokens
are its solo tokens whatever shares its batch — rows of other lengths (left padding in the
merged cache), identical rows, rows joining at different steps, rows leaving.

bfloat16 is where this can fail: before each row was prefilled alone and attended over its
own cache columns only, a padded row's attention reduced over a longer, masked row in
another order, and its tokens changed with its neighbours."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from millm_core.config import load_settings
from millm_core.engine import ModelLocation, RowSpec, SamplingParams
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.settings import FAST_DECODE

GREEDY = SamplingParams(temperature=0.0)
STEPS = 24
TEXTS = ["The capital of France is", "import json\nimport os\n", "Once upon a time there was", "def f(x):", "hello", "A B C D E F G", "The weather today", "1, 2, 3, 4,"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, tiny_dir: str):  # type: ignore[no-untyped-def]
    settings = load_settings({"dtype": request.param, "fast_decode": True}, environ={}, plugin_settings=[FAST_DECODE])
    loaded = load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)
    assert loaded.fast is not None and loaded.info.dtype == request.param
    return loaded


def run(engine: Any, rows: list[RowSpec], joins: dict[int, RowSpec] | None = None, leave: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Step ``rows`` (row ids 0..), join ``joins[k]`` before step k (the next id), and
    retire row ``leave[k]`` after step k; returns each row's first STEPS tokens."""
    batch = engine.open_batch(rows)
    ids = list(range(len(rows)))
    out: dict[int, list[int]] = {i: [] for i in ids}
    step = 0
    while ids and (any(len(out[i]) < STEPS for i in ids) or any(k >= step for k in (joins or {}))):
        if joins and step in joins:
            engine.join(batch, [joins[step]])
            ids.append(len(out))
            out[len(out)] = []
        for i, token in zip(ids, engine.step(batch, [None] * len(ids)), strict=True):
            out[i].append(token)
        if leave and step in leave:
            keep = [p for p, i in enumerate(ids) if i != leave[step]]
            engine.retain(batch, keep)
            ids = [ids[p] for p in keep]
        step += 1
    engine.close(batch)
    return {i: tokens[:STEPS] for i, tokens in out.items()}


def test_rows_of_different_lengths_equal_their_solo_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    prompts = [tuple(engine.encode(t, add_special_tokens=True)) for t in TEXTS]
    assert len({len(p) for p in prompts}) > 3  # real padding in the batch
    solo = [run(engine, [RowSpec(prompt_ids=p, sampling=GREEDY)])[0] for p in prompts]
    together = run(engine, [RowSpec(prompt_ids=p, sampling=GREEDY) for p in prompts])
    assert [together[i] for i in range(len(prompts))] == solo


def test_rows_joining_and_leaving_keep_every_row_on_its_solo_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    prompts = [tuple(engine.encode(t, add_special_tokens=True)) for t in TEXTS[:5]]
    solo = [run(engine, [RowSpec(prompt_ids=p, sampling=GREEDY)])[0] for p in prompts]
    rows = [RowSpec(prompt_ids=p, sampling=GREEDY) for p in prompts]
    got = run(engine, rows[:2], joins={3: rows[2], 5: rows[3], 9: rows[4]}, leave={6: 0})
    assert [got[i] for i in range(1, 5)] == solo[1:]
    assert len(got[0]) == 7 and got[0] == solo[0][:7]  # the row that left had its solo tokens while it ran


def test_identical_rows_joining_at_different_steps_get_identical_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    prompt = tuple(engine.encode(TEXTS[2], add_special_tokens=True))
    row = RowSpec(prompt_ids=prompt, sampling=GREEDY)
    solo = run(engine, [row])[0]
    got = run(engine, [row], joins={k: row for k in range(1, 8)})
    assert all(tokens == solo for tokens in got.values())


def test_batch_invariant_refuses_a_model_with_no_invariant_path(tiny_dir: str, tmp_path: Path) -> None:
    """A checkpoint whose config asks for eager attention has no row-wise attention on the
    generic forward: in bf16 without the lean step it is refused; in float32 it loads."""
    from millm_core.errors import ConfigError

    eager = tmp_path / "eager"
    eager.mkdir()
    for name in os.listdir(tiny_dir):
        if name != "config.json":
            os.symlink(os.path.join(tiny_dir, name), eager / name)
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    (eager / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    no_fast = load_settings({"dtype": "bfloat16", "fast_decode": False, "batch_invariant": True}, environ={}, plugin_settings=[FAST_DECODE])
    assert load_engine(ModelLocation(path=tiny_dir, served_name="t"), no_fast).batch_invariant  # SDPA: rows attention
    with pytest.raises(ConfigError, match="no batch-invariant path"):
        load_engine(ModelLocation(path=str(eager), served_name="t"), no_fast)
    fp32 = load_settings({"dtype": "float32", "fast_decode": False, "batch_invariant": True}, environ={}, plugin_settings=[FAST_DECODE])
    assert load_engine(ModelLocation(path=str(eager), served_name="t"), fp32).batch_invariant


def test_rows_sharing_their_columns_equal_their_solo_tokens(engine) -> None:  # type: ignore[no-untyped-def]
    # Rows opened together with prompts of one length start at the same cache column and
    # attend in one call (where the load-time check found that exact); the others alone.
    prompts = [tuple(engine.encode(t, add_special_tokens=True)) for t in TEXTS[:3]]
    same = prompts[0]
    rows = [RowSpec(prompt_ids=p, sampling=GREEDY) for p in (same, same, same, prompts[1], prompts[2], prompts[1])]
    solo = {p: run(engine, [RowSpec(prompt_ids=p, sampling=GREEDY)])[0] for p in prompts}
    together = run(engine, rows)
    assert [together[i] for i in range(len(rows))] == [solo[r.prompt_ids] for r in rows]
