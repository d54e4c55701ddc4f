"""Prefix reuse on the real model, where tiny models hide rounding: SmolLM2-135M in bfloat16
on the transformers engine's lean decode step, and its packaged Q4_1 GGUF with eight
sequences sharing batches. A prompt resumed from the cached whole chunks of its earlier run gives
bit for bit the logits and token for token the greedy tokens of its full prefill; one
forward pass (one llama.cpp call) over the whole prompt would not, so the comparison can
fail."""

from __future__ import annotations

import sysconfig
from typing import Any

import numpy as np
import pytest
import torch

from millm_core.api import RowSpec, SamplingParams
from millm_core.config import cache_root, load_settings
from millm_core.engine import ModelLocation
from millm_engines.gguf import engine as gguf_module
from millm_engines.gguf.llama import Piece
from millm_engines.gguf.prefix import CHUNK as GGUF_CHUNK
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.prefix import CHUNK
from millm_engines.transformers.settings import FAST_DECODE, PREFIX_CACHE_MB
from millm_plugins.smollm2.convert import converted_dir, packaged_gguf

from ..gguf.helpers import load_gguf

pytestmark = pytest.mark.e2e


def _run(engine: Any, prompt: tuple[int, ...], steps: int = 8) -> tuple[list[int], Any, int]:
    """The row's greedy tokens, the logits of its first draw (transformers engine) and the
    prompt tokens it resumed."""
    batch = engine.open_batch([RowSpec(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0), max_new_tokens=steps)])
    try:
        tokens = [engine.step(batch, [None])[0] for _ in range(steps)]
        first = batch.first_logits[0].clone() if hasattr(batch, "first_logits") else None
        return tokens, first, engine.resumed(batch)[0]
    finally:
        engine.close(batch)


def test_a_resumed_bfloat16_prefill_on_smollm2_is_exact() -> None:
    settings = load_settings({"dtype": "bfloat16"}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB])
    path, _ = converted_dir(cache_root(settings))
    engine = load_engine(ModelLocation(path=path, served_name="smollm2"), settings)
    assert engine.fast is not None and engine.prefix is not None and engine.info.dtype == "bfloat16"
    with open(f"{sysconfig.get_paths()['stdlib']}/textwrap.py", encoding="utf-8") as fh:
        head = tuple(engine.encode(fh.read(), add_special_tokens=True)[: 2 * CHUNK])
    prompt = head + tuple(engine.encode("\n# What does this module do? Answer:", add_special_tokens=False))
    full = _run(engine, prompt)  # nothing cached yet: the full prefill, which caches the two whole chunks
    resumed = _run(engine, prompt)
    assert (full[2], resumed[2]) == (0, 2 * CHUNK)
    assert torch.equal(resumed[1], full[1]) and resumed[0] == full[0]
    with torch.inference_mode():
        whole = engine.model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    assert not torch.equal(whole, full[1])


def test_a_restored_prefix_on_the_q4_1_gguf_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default eight sequences sharing batches (one sequence at a time is checked
    on the tiny models, tests/gguf/test_gguf_prefix.py): a prompt resumed from one whole
    chunk (its remaining calls end at 256 and 296), then from two, joining beside a
    decoding row, samples from the logits of its full prefill bit for bit."""
    parallel = 8
    seen: list[np.ndarray] = []
    real = gguf_module.sample_row

    def sample_row(logits: np.ndarray, *args: Any) -> int:
        seen.append(logits.copy())
        return real(logits, *args)

    monkeypatch.setattr(gguf_module, "sample_row", sample_row)
    engine = load_gguf(packaged_gguf(), gguf_parallel=parallel).engine
    try:
        assert engine.parallel == parallel and engine.batch_invariant and engine.prefix is not None
        with open(f"{sysconfig.get_paths()['stdlib']}/textwrap.py", encoding="utf-8") as fh:
            ids = engine.encode(fh.read(), add_special_tokens=True)
        prompt = tuple(ids[: 2 * GGUF_CHUNK + 40])
        greedy = SamplingParams(temperature=0.0)
        seen.clear()
        full = _run(engine, prompt)  # nothing cached: the full prefill
        full_logits = list(seen)
        engine.prefix.clear()
        _run(engine, prompt[: GGUF_CHUNK + 1], steps=1)  # keeps one whole chunk
        seen.clear()
        from_one = _run(engine, prompt)  # resumes it, computes 128..295 and keeps two
        from_one_logits = list(seen)
        assert (full[2], from_one[2]) == (0, GGUF_CHUNK)
        assert from_one[0] == full[0] and all(np.array_equal(a, b) for a, b in zip(from_one_logits, full_logits, strict=True))
        # Resumed from two chunks; on the shared engine joining beside a row that is decoding.
        runner = tuple(ids[2000:2030])
        rows = [RowSpec(prompt_ids=runner, sampling=greedy, max_new_tokens=12)] if parallel > 1 else []
        batch = engine.open_batch(rows)
        try:
            if rows:
                engine.step(batch, [None])
            engine.join(batch, [RowSpec(prompt_ids=prompt, sampling=greedy, max_new_tokens=8)])
            seen.clear()
            tokens = [engine.step(batch, [None] * len(batch.rows))[-1] for _ in range(8)]
            joined_logits = seen[len(rows) :: len(batch.rows)]
            assert engine.resumed(batch)[-1] == 2 * GGUF_CHUNK
        finally:
            engine.close(batch)
        assert tokens == full[0] and all(np.array_equal(a, b) for a, b in zip(joined_logits, full_logits, strict=True))
        if parallel > 1:  # one call over the whole prompt computes other logits: the comparisons can fail
            pieces = [Piece(t, 0, p, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            whole = engine.llm.decode(pieces)[0]
            engine.llm.forget(0)
            assert not np.array_equal(whole, full_logits[0])
    finally:
        engine.llm.close()
