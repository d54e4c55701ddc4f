"""Blocked bf16 weight copies for the lean decode step (millm_engines.transformers.packed).

Where this CPU's oneDNN runs bf16, the step with blocked copies must compute what it
computes without them, bit for bit, for one row and for rows sharing a step, and a row's
logits must not depend on the rows beside it; the load-time check must refuse copies that
compute anything else. Elsewhere the copies are refused with the reason, and the step is
the plain one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from millm_core.api import ModelLocation
from millm_core.config import load_settings
from millm_engines.transformers import packed as packed_module
from millm_engines.transformers.fastpath import LlamaDecoder
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.packed import CHECK_ROWS, ops_available, pack, packs_exactly
from millm_engines.transformers.preflight import _packed, native_bf16, packing_plan, preflight
from millm_engines.transformers.settings import FAST_DECODE, PACKED_WEIGHTS

from .lean import prefilled


@pytest.fixture(scope="module")
def bf16(tiny_engine: Any) -> Any:
    return copy.deepcopy(tiny_engine.model).to(torch.bfloat16)


@pytest.fixture(scope="module")
def decoders(bf16: Any) -> tuple[LlamaDecoder, LlamaDecoder]:
    """(the plain step, the step with blocked copies where this machine packs)."""
    return LlamaDecoder(copy.deepcopy(bf16)), LlamaDecoder(copy.deepcopy(bf16), packing=None)


def _steps(model: Any, fast: LlamaDecoder, prompts: list[list[int]], steps: int = 6) -> list[torch.Tensor]:
    """Greedy lean steps of ``prompts`` (equal lengths); each step's logits."""
    cache, token = prefilled(model, prompts)
    pos = torch.full((len(prompts),), len(prompts[0]))
    logits = []
    with torch.inference_mode():
        for _ in range(steps):
            step = fast.step(token, pos, cache, None)
            logits.append(step)
            token, pos = step.argmax(-1), pos + 1
    return logits


def _prompts(engine: Any, n: int) -> list[list[int]]:
    prompts = [engine.encode(f"def f{i}(x): return x *", add_special_tokens=True) for i in range(n)]
    assert len({len(p) for p in prompts}) == 1
    return prompts


def test_the_step_packs_where_the_kernels_are_and_then_computes_what_the_plain_step_does(
    tiny_engine: Any, bf16: Any, decoders: tuple[LlamaDecoder, LlamaDecoder]
) -> None:
    """Where the copies are used, the step's logits are the plain step's, bit for bit, for
    one row and for 8 rows sharing steps; elsewhere the refusal says why."""
    plain, packed = decoders
    assert plain.packing_refusal == "not asked for" and plain.packed_bytes == 0
    if not ops_available():
        assert packed.packing_refusal == "oneDNN here has no bf16 matrix kernels" and packed.packed_bytes == 0
        return
    if packed.packing_refusal is not None:  # kernels whose rows the check caught depending on each other
        assert packed.packing_refusal.startswith("a packed ") and packed.packed_bytes == 0
        return
    weights = sum(w.numel() for layer in packed.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
    assert packed.packed_bytes >= 2 * (weights + packed.lm_head.numel())  # blocked layouts may pad odd shapes
    for prompts in (_prompts(tiny_engine, 1), _prompts(tiny_engine, 8)):
        for got, want in zip(_steps(bf16, packed, prompts), _steps(bf16, plain, prompts), strict=True):
            assert torch.equal(got, want)


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tiny_engine: Any, bf16: Any, decoders: tuple[LlamaDecoder, LlamaDecoder]) -> None:
    _plain, packed = decoders
    prompts = _prompts(tiny_engine, 8)
    together = _steps(bf16, packed, prompts)
    for r, prompt in enumerate(prompts):
        for step_together, step_alone in zip(together, _steps(bf16, packed, [prompt]), strict=True):
            assert torch.equal(step_together[r], step_alone[0])


def test_the_check_refuses_copies_that_compute_something_else(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(48, 32).to(torch.bfloat16)
    assert pack([weight.float()]) == (None, "weights are float32, not bfloat16")
    assert pack([]) == (None, "no weights")
    if not ops_available():
        assert pack([weight]) == (None, "oneDNN here has no bf16 matrix kernels")
        return
    other = weight.clone()
    other[0, 0] += 1
    assert "differs from F.linear" in str(packs_exactly(weight, packed_module._pack(other)))
    assert packs_exactly(weight, packed_module._pack(weight)) is None
    real = packed_module._apply

    def rows_dependent(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:  # a kernel whose rows change past 32 of them
        out = real(x, blocked)
        return out * 1.5 if x.reshape(-1, x.shape[-1]).shape[0] > 32 else out

    monkeypatch.setattr(packed_module, "_apply", rows_dependent)
    assert pack([weight]) == (None, "a packed (48, 32) product depends on its 33 rows")
    assert max(CHECK_ROWS) == 64  # as many rows as one request may run


def test_oneDNN_errors_refuse_the_copies_instead_of_failing_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_module, "ops_available", lambda: True)  # as on a CPU with the kernels

    def fails(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(packed_module, "_pack", fails)
    packed, reason = pack([torch.randn(48, 32).to(torch.bfloat16)])
    assert packed is None and reason == "oneDNN could not pack the weights: RuntimeError: could not create a primitive descriptor"


def test_a_deep_copied_decoder_computes_with_its_own_weights(tiny_engine: Any, bf16: Any, decoders: tuple[LlamaDecoder, LlamaDecoder]) -> None:
    _plain, packed = decoders
    prompts = _prompts(tiny_engine, 1)
    before = _steps(bf16, packed, prompts)
    twin = copy.deepcopy(packed)
    for got, want in zip(_steps(bf16, twin, prompts), before, strict=True):
        assert torch.equal(got, want)  # the same values: the same logits
    with torch.no_grad():
        twin.layers[0].w_down.mul_(0.5)  # the twin's own copy changes...
    assert not torch.equal(_steps(bf16, twin, prompts)[0], before[0])  # ...and so do its logits
    for got, want in zip(_steps(bf16, packed, prompts), before, strict=True):
        assert torch.equal(got, want)  # the original is untouched


def test_the_load_logs_and_plans_what_the_copies_take(tiny_dir: str) -> None:
    location = ModelLocation(path=tiny_dir, served_name="m")
    on = load_settings({"dtype": "bfloat16"}, environ={}, plugin_settings=[FAST_DECODE, PACKED_WEIGHTS])
    off = load_settings({"dtype": "bfloat16", "packed_weights": False}, environ={}, plugin_settings=[FAST_DECODE, PACKED_WEIGHTS])
    engine = load_engine(location, on)
    assert engine.fast is not None
    plan = packing_plan(engine.model.config, "bfloat16", on)
    assert (plan is None) == native_bf16()
    if plan is not None:
        assert engine.fast.packing_refusal == plan and engine.fast.packed_bytes == 0
    unpacked = load_engine(location, off).fast
    assert unpacked is not None and unpacked.packing_refusal == "disabled by --packed-weights false"
    assert packing_plan(engine.model.config, "float32", on) == "served in float32, not bfloat16"
    extra = preflight(location, on).need["cpu"] - preflight(location, off).need["cpu"]
    assert extra == (0 if plan is not None else engine.fast.packed_bytes if engine.fast.packing_refusal is None else extra)
    if plan is None and engine.fast.packing_refusal is None:
        assert extra > 0


def test_the_plan_counts_the_projections_and_the_output_matrix() -> None:
    layer = "model.layers.0."
    names = {layer + n for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")}
    tied = names | {"model.embed_tokens.weight", "model.norm.weight"}
    assert _packed(tied) == {layer + "self_attn.q_proj.weight", layer + "self_attn.o_proj.weight", layer + "mlp.down_proj.weight", "model.embed_tokens.weight"}
    assert _packed(tied | {"lm_head.weight"}) - _packed(names) == {"lm_head.weight"}


def test_native_bf16_reads_the_cpu_flags(tmp_path: Path) -> None:
    for flags, native in [("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True)]:
        info = tmp_path / f"cpuinfo-{native}-{len(flags)}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert native_bf16(str(info)) is native
    assert native_bf16(str(tmp_path / "missing")) is False
