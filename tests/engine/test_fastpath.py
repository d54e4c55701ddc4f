"""The lean decode path computes what HF's forward computes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from millm_core.config import load_settings
from millm_core.engine import ModelLocation, RowSpec, SamplingParams
from millm_engines.transformers import leanlayers
from millm_engines.transformers.fastpath import KVCache, LlamaDecoder, column_groups, grouping_refusal, unsupported_reason
from millm_engines.transformers.leanlayers import run_layers, scripted
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.settings import FAST_DECODE

from .lean import prefilled


# A padded batch of two rows may take other matrix-kernel blockings than HF's separate
# projections: the bound is a few units in the last place at the logits' magnitude (|logit|
# below 16 here: float32 ulp ~1e-6, bfloat16 ulp 0.0625).
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.125)])
def test_fast_step_logits_match_hf_forward_padded_batch(tiny_engine, dtype: torch.dtype, atol: float) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(tiny_engine.model).to(dtype)
    fast = LlamaDecoder(model)
    prompts = [tiny_engine.encode(t, add_special_tokens=True) for t in ("import json", "a much longer prompt here")]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        hf_cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=hf_cache, use_cache=True, logits_to_keep=1)
        fast_cache = KVCache.from_hf(hf_cache, extra=3)  # small, so the cache must grow mid-test
        token = out.logits[:, -1].argmax(-1)
        next_pos = pos[:, -1] + 1
        for _ in range(8):
            mask = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
            ref = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos[:, None], cache=hf_cache, use_cache=True).logits[:, -1]
            got = fast.step(token, next_pos, fast_cache, mask.bool())
            assert ref.float().abs().max() < 16
            assert torch.allclose(got.float(), ref.float(), atol=atol, rtol=0), (got.float() - ref.float()).abs().max()
            token = ref.argmax(-1)
            next_pos = next_pos + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_step_is_bit_identical_for_one_row(tiny_engine, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(tiny_engine.model).to(dtype)
    fast = LlamaDecoder(model)
    ids = torch.tensor([tiny_engine.encode("import json and more", add_special_tokens=True)])
    with torch.inference_mode():
        hf_cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, cache=hf_cache, use_cache=True)
        fast_cache = KVCache.from_hf(hf_cache)
        token, pos = out.logits[:, -1].argmax(-1), torch.tensor([ids.shape[1]])
        for _ in range(8):
            ref = model(input_ids=token[:, None], position_ids=pos[:, None], cache=hf_cache, use_cache=True).logits[:, -1]
            assert torch.equal(fast.step(token, pos, fast_cache, None), ref)
            token, pos = ref.argmax(-1), pos + 1


def test_fast_decode_off_gives_the_same_text(tiny_dir: str, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    slow = load_engine(ModelLocation(path=tiny_dir, served_name="slow"), load_settings({"fast_decode": False}, environ={}, plugin_settings=[FAST_DECODE]))
    assert slow.fast is None and tiny_engine.fast is not None
    prompt = tiny_engine.encode("for key in", add_special_tokens=True)

    def greedy(engine) -> list[int]:  # type: ignore[no-untyped-def]
        batch = engine.open_batch([RowSpec(prompt_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0))])
        return [engine.step(batch, [None])[0] for _ in range(30)]

    assert greedy(slow) == greedy(tiny_engine)


def test_unsupported_architectures_are_named(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(tiny_engine.model)
    assert unsupported_reason(model) is None
    model.config.hidden_act = "gelu"
    assert unsupported_reason(model) == "activation is not silu"
    model.config.model_type = "gpt2"
    assert "no fast decode path" in str(unsupported_reason(model))


def _cache(rows: int, length: int, seed: int) -> KVCache:
    """Two layers of ``rows`` rows filled over ``length`` columns with random values, then
    a few columns of headroom that hold NaN (what merging must never copy as data)."""
    g = torch.Generator().manual_seed(seed)
    stores = [torch.full((rows, 2, length + 3, 4), float("nan")) for _ in range(4)]
    for t in stores:
        t[:, :, :length] = torch.randn((rows, 2, length, 4), generator=g)
    return KVCache(stores[:2], stores[2:], length)


def _right_aligned(caches: list[KVCache]) -> list[torch.Tensor]:
    """The merge as plain concatenation: every cache's rows right-aligned to the longest,
    zeros on the left (keys of each layer, then values)."""
    length = max(c.length for c in caches)
    out = []
    for store in ("keys", "values"):
        for layer in range(2):
            parts = [torch.nn.functional.pad(getattr(c, store)[layer][:, :, : c.length], (0, 0, length - c.length, 0)) for c in caches]
            out.append(torch.cat(parts))
    return out


@torch.inference_mode()
def test_merging_joined_rows_right_aligns_them_and_copies_the_running_rows_only_when_it_must() -> None:
    running, first, second, longer = _cache(2, 9, 0), _cache(1, 5, 1), _cache(2, 9, 2), _cache(1, 12, 3)
    merged = KVCache.merge(running, first)
    again = KVCache.merge(merged, second)  # no longer than the batch: into the rows the first merge left free
    assert again.length == 9 and again.keys[0].shape[0] == 5
    assert again.keys[0].data_ptr() == merged.keys[0].data_ptr() and again.values[1].data_ptr() == merged.values[1].data_ptr()
    got = [t[:, :, : again.length] for t in (*again.keys, *again.values)]
    assert all(torch.equal(a, b) for a, b in zip(got, _right_aligned([running, first, second]), strict=True))
    over = KVCache.merge(again, second)  # two more rows than the first merge left free: new tensors
    assert over.keys[0].shape[0] == 7 and over.keys[0].data_ptr() != again.keys[0].data_ptr()
    got = [t[:, :, : over.length] for t in (*over.keys, *over.values)]
    assert all(torch.equal(a, b) for a, b in zip(got, _right_aligned([running, first, second, second]), strict=True))
    grown = KVCache.merge(again, longer)  # longer than the batch: every row moves right, into new tensors
    assert grown.length == 12 and grown.keys[0].data_ptr() != again.keys[0].data_ptr()
    got = [t[:, :, : grown.length] for t in (*grown.keys, *grown.values)]
    assert all(torch.equal(a, b) for a, b in zip(got, _right_aligned([running, first, second, longer]), strict=True))
    kept = _right_aligned([running, first, second, longer])
    joined = [torch.nn.functional.pad(t[:, :, :5], (0, 0, 12 - 5, 0)) for t in (*first.keys, *first.values)]
    # Rows leave: kept in place when in order (the freed rows spare); copied when out of
    # order, or when a quarter or less of the tensors' 12 rows stays in use (memory given back).
    for order, in_place, grow in (([0, 2, 4, 5], True, False), ([2, 0, 4, 5], False, False), ([0, 2, 5], False, False), ([0, 2, 4, 5], False, True)):
        cache = KVCache.merge(again, longer)
        cache.select(torch.tensor(order))
        if grow:  # grown: new tensors without spare rows
            cache.reserve(cache.keys[0].shape[2])
        after = KVCache.merge(cache, first)
        assert (after.keys[0].data_ptr() == cache.keys[0].data_ptr()) is in_place
        expected = [torch.cat([t[order], j]) for t, j in zip(kept, joined, strict=True)]
        assert all(torch.equal(t[:, :, :12], e) for t, e in zip((*after.keys, *after.values), expected, strict=True))


def test_rows_group_by_runs_of_one_start_column() -> None:
    assert column_groups([3, 3, 3, 0, 5, 5, 3], grouped=True) == [(0, 3, 3), (3, 4, 0), (4, 6, 5), (6, 7, 3)]
    assert column_groups([3, 3, 0], grouped=False) == [(0, 1, 3), (1, 2, 3), (2, 3, 0)]
    assert column_groups([], grouped=True) == []


def test_the_grouping_check_refuses_attention_that_depends_on_the_rows_beside(monkeypatch: pytest.MonkeyPatch) -> None:
    assert grouping_refusal(torch.float32, torch.device("cpu"), 4, 2, 8, 0.35) is None  # what the CPU kernel does here
    real = torch.nn.functional.scaled_dot_product_attention

    def rows_dependent(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(q, *args, **kwargs)
        return out + q.shape[0] * 1e-3  # a value that moves with the rows in the call

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", rows_dependent)
    assert "differs from one call per row" in str(grouping_refusal(torch.float32, torch.device("cpu"), 4, 2, 8, 0.35))


def _rows_logits(model: Any, fast: LlamaDecoder, prompts: list[list[int]], steps: int = 6) -> list[torch.Tensor]:
    """Greedy lean steps of ``prompts`` (each prefilled alone, right-aligned in one cache,
    each row attending over its own columns); each step's logits."""
    length = max(len(p) for p in prompts)
    cache, token = prefilled(model, prompts)
    pos = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        starts = [length - len(p) for p in prompts]
        logits = []
        for _ in range(steps):
            step = fast.step(token, pos, cache, None, starts=starts)
            logits.append(step)
            token, pos = step.argmax(-1), pos + 1
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_sharing_a_start_column_compute_as_with_a_call_per_row(tiny_engine, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """Consecutive rows that start at one cache column attend in one call: every row's
    logits are bit for bit those of one attention call per row, beside rows of other
    lengths. (That a row computes as alone is test_batch_invariance's; in float32 the
    matrix products' rounding moves with the row count, which this comparison keeps out.)"""
    model = copy.deepcopy(tiny_engine.model).to(dtype)
    fast = LlamaDecoder(model)
    assert fast.grouping_refusal is None  # exact here (the check runs at load)
    texts = ["for key in", "for key in", "import json", "for key in", "def main(argv):", "def main(argv):"]
    prompts = [tiny_engine.encode(t, add_special_tokens=True) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    grouped = _rows_logits(model, fast, prompts)
    fast.grouping_refusal = "a call per row, for comparison"
    per_row = _rows_logits(model, fast, prompts)
    assert all(torch.equal(a, b) for a, b in zip(grouped, per_row, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layers_run_through_torchscript_with_the_python_functions_numbers(tiny_engine, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The step hands its layers to TorchScript's interpreter (the load-time check passes
    here), and every logit is the Python function's, rows of three lengths together."""
    model = copy.deepcopy(tiny_engine.model).to(dtype)
    fast = LlamaDecoder(model)
    assert fast.scripting_refusal is None
    assert fast._layers is not run_layers
    prompts = [tiny_engine.encode(t, add_special_tokens=True) for t in ("for key in", "import json", "def main(argv):")]
    assert len({len(p) for p in prompts}) == 3
    compiled = _rows_logits(model, fast, prompts)
    fast._layers = run_layers
    python = _rows_logits(model, fast, prompts)
    assert all(torch.equal(a, b) for a, b in zip(compiled, python, strict=True))


def test_the_scripting_check_keeps_python_where_the_compiled_layers_differ(tiny_engine, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fast = LlamaDecoder(copy.deepcopy(tiny_engine.model))
    args = (fast._weights, fast._blocked, fast._shape, fast.eps, fast.scaling)

    def off_by_a_little(*layer_args: Any) -> torch.Tensor:
        return run_layers(*layer_args) + 1e-6

    def writes_other_keys(*layer_args: Any) -> torch.Tensor:
        out = run_layers(*layer_args)
        layer_args[3][0].mul_(2)  # the keys of the first layer
        return out

    def mask_path_differs(*layer_args: Any) -> torch.Tensor:
        out = run_layers(*layer_args)
        return out + 1e-6 if layer_args[11] is not None else out

    def fails(*layer_args: Any) -> torch.Tensor:
        raise RuntimeError("no kernel for this")

    for stand_in in (off_by_a_little, writes_other_keys, mask_path_differs):
        monkeypatch.setattr(leanlayers, "_compiled", lambda stand_in=stand_in: (stand_in, None))
        chosen, reason = scripted(*args)
        assert chosen is run_layers and "differ from the Python function" in str(reason), stand_in.__name__
    monkeypatch.setattr(leanlayers, "_compiled", lambda: (fails, None))
    assert scripted(*args) == (run_layers, "TorchScript's layers failed their check: RuntimeError: no kernel for this")
    monkeypatch.setattr(leanlayers, "_compiled", lambda: (None, "TorchScript could not compile the layers: test"))
    assert scripted(*args) == (run_layers, "TorchScript could not compile the layers: test")


def test_steered_layers_split_the_step_into_stretches_that_each_run_once() -> None:
    """A 4-layer model steered at layers 1 and 2 runs its layers as [0, 2), [2, 3), [3, 4),
    each delta added once after its layer: a lone row's logits are, bit for bit, HF's
    forward with hooks that add the same deltas."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
    )
    model = LlamaForCausalLM(config).eval()
    fast = LlamaDecoder(model)
    assert fast.scripting_refusal is None
    deltas = {layer: torch.randn(1, 64) * 2 for layer in (1, 2)}
    hooks = [model.model.layers[layer].register_forward_hook(lambda m, a, out, d=d: out + d[0]) for layer, d in deltas.items()]
    try:
        ids = torch.tensor([[5, 17, 42, 8, 3]])
        with torch.inference_mode():
            hf_cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, cache=hf_cache, use_cache=True)
            fast_cache = KVCache.from_hf(hf_cache)
            token, pos = out.logits[:, -1].argmax(-1), torch.tensor([ids.shape[1]])
            plain_cache = KVCache.from_hf(hf_cache)
            for _ in range(4):
                ref = model(input_ids=token[:, None], position_ids=pos[:, None], cache=hf_cache, use_cache=True).logits[:, -1]
                assert torch.equal(fast.step(token, pos, fast_cache, None, deltas=deltas), ref)
                assert not torch.equal(fast.step(token, pos, plain_cache, None), ref)  # the deltas matter
                token, pos = ref.argmax(-1), pos + 1
    finally:
        for hook in hooks:
            hook.remove()
