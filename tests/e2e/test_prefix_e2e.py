"""Prefix reuse on the real model, where tiny models hide rounding: SmolLM2-135M in bfloat16
on the transformers engine's lean decode step, and its packaged Q4_1 GGUF with one
sequence at a time. A prompt resumed from the cached whole chunks of its earlier run gives
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
    seen: list[np.ndarray] = []
    real = gguf_module.sample_row

    def sample_row(logits: np.ndarray, *args: Any) -> int:
        seen.append(logits.copy())
        return real(logits, *args)

    monkeypatch.setattr(gguf_module, "sample_row", sample_row)
    one = load_gguf(packaged_gguf(), gguf_parallel=1).engine
    shared = load_gguf(packaged_gguf(), gguf_parallel=8).engine  # prompts in calls of up to 512 tokens, no reuse
    try:
        assert one.prefix is not None and shared.prefix is None
        with open(f"{sysconfig.get_paths()['stdlib']}/textwrap.py", encoding="utf-8") as fh:
            prompt = tuple(one.encode(fh.read(), add_special_tokens=True)[: 2 * GGUF_CHUNK + 40])
        runs = []
        for engine in (one, one, shared):
            seen.clear()
            runs.append((_run(engine, prompt), list(seen)))
        (full, full_logits), (resumed, resumed_logits), (single, single_logits) = runs
        assert (full[2], resumed[2], single[2]) == (0, 2 * GGUF_CHUNK, 0)
        assert resumed[0] == full[0] and all(np.array_equal(a, b) for a, b in zip(resumed_logits, full_logits, strict=True))
        assert not np.array_equal(single_logits[0], full_logits[0])
    finally:
        one.llm.close()
        shared.llm.close()
