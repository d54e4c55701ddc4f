"""Blocked bf16 weight copies for the lean decode step (millm_engines.transformers.packed).

Where this CPU has oneDNN's bf16 kernels, the step with blocked copies must compute what it
computes without them, bit for bit, for one row and for rows sharing a step, and a row's
logits must not depend on the rows beside it. Elsewhere the copies are refused with the
reason, and the step is the plain one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from millm_core.api import ModelLocation
from millm_core.config import load_settings
from millm_engines.transformers.fastpath import KVCache, LlamaDecoder
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.packed import PackedWeights, _packs_exactly, packing_refusal
from millm_engines.transformers.preflight import native_bf16, packing_plan, preflight
from millm_engines.transformers.settings import FAST_DECODE, PACKED_WEIGHTS


def _kernels() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _decoders(model: Any) -> tuple[LlamaDecoder, LlamaDecoder]:
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    return LlamaDecoder(bf16), LlamaDecoder(copy.deepcopy(bf16), packing=None)


def _steps(model: Any, fast: LlamaDecoder, prompts: list[list[int]], steps: int = 6) -> list[torch.Tensor]:
    """Greedy lean steps of ``prompts`` (equal lengths) prefilled by ``model``; each step's logits."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        hf_cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=hf_cache, use_cache=True)
        cache = KVCache.from_hf(hf_cache)
        token, pos = out.logits[:, -1].argmax(-1), torch.full((len(prompts),), ids.shape[1])
        logits = []
        for _ in range(steps):
            step = fast.step(token, pos, cache, None)
            logits.append(step)
            token, pos = step.argmax(-1), pos + 1
    return logits


def test_the_step_uses_blocked_copies_exactly_where_the_cpu_has_bf16_kernels(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    plain, packed = _decoders(tiny_engine.model)
    assert plain.packing_refusal == "not asked for" and plain.packed_bytes == 0
    if _kernels():
        assert packed.packing_refusal is None
        weights = sum(w.numel() for layer in packed.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
        assert packed.packed_bytes == 2 * (weights + packed.lm_head.numel())
    else:
        assert packed.packing_refusal == "this CPU has no native bf16 matrix kernels in oneDNN" and packed.packed_bytes == 0


def test_blocked_copies_give_the_plain_steps_logits_bit_for_bit(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    plain, packed = _decoders(tiny_engine.model)
    model = copy.deepcopy(tiny_engine.model).to(torch.bfloat16)
    one = [tiny_engine.encode("import json and more", add_special_tokens=True)]
    for got, want in zip(_steps(model, packed, one), _steps(model, plain, one), strict=True):
        assert torch.equal(got, want)


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    _plain, packed = _decoders(tiny_engine.model)
    model = copy.deepcopy(tiny_engine.model).to(torch.bfloat16)
    prompts = [tiny_engine.encode(f"def f{i}(x): return x *", add_special_tokens=True) for i in range(8)]
    assert len({len(p) for p in prompts}) == 1
    together = _steps(model, packed, prompts)
    for r, prompt in enumerate(prompts):
        alone = _steps(model, packed, [prompt])
        for step_together, step_alone in zip(together, alone, strict=True):
            assert torch.equal(step_together[r], step_alone[0])


def test_the_check_refuses_copies_that_compute_something_else() -> None:
    weight = torch.randn(48, 32).to(torch.bfloat16)
    other = weight.clone()
    other[0, 0] += 1
    if _kernels():
        wrong = PackedWeights([other])._packed[other.data_ptr()]
        assert "differs from F.linear" in str(_packs_exactly(weight, wrong))
        assert _packs_exactly(weight, PackedWeights([weight])._packed[weight.data_ptr()]) is None
    assert packing_refusal([weight.float()]) == "weights are float32, not bfloat16"
    assert packing_refusal([]) == "no weights"


def test_the_load_logs_and_plans_what_the_copies_take(tiny_dir: str, tmp_path: Path) -> None:
    location = ModelLocation(path=tiny_dir, served_name="m")
    on = load_settings({"dtype": "bfloat16"}, environ={}, plugin_settings=[FAST_DECODE, PACKED_WEIGHTS])
    off = load_settings({"dtype": "bfloat16", "packed_weights": False}, environ={}, plugin_settings=[FAST_DECODE, PACKED_WEIGHTS])
    engine = load_engine(location, on)
    plan = packing_plan(engine.model.config, "bfloat16", on)
    assert (plan is None) == native_bf16()
    assert (engine.fast.packed_bytes > 0) == (plan is None and _kernels())
    assert load_engine(location, off).fast.packing_refusal == "disabled by --packed-weights false"
    assert packing_plan(engine.model.config, "float32", on) == "served in float32, not bfloat16"
    assert preflight(location, on).need["cpu"] - preflight(location, off).need["cpu"] == (engine.fast.packed_bytes if plan is None else 0)


def test_native_bf16_reads_the_cpu_flags(tmp_path: Path) -> None:
    for flags, native in [("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True)]:
        info = tmp_path / f"cpuinfo-{native}-{len(flags)}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert native_bf16(str(info)) is native
    assert native_bf16(str(tmp_path / "missing")) is False
