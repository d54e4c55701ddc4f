"""``--dtype auto``: a checkpoint's declared dtype where a row's tokens stay independent of
its batch in it (the lean decode step, and the generic HF forward with row-wise SDPA
attention, in every dtype), float32 for a model that cannot attend row by row (here: one
whose config soft-caps attention logits, which SDPA cannot do); the load plan estimates
the weights in the dtype the load picks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from millm_core.api import ModelLocation
from millm_core.config import load_settings
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.preflight import preflight
from millm_engines.transformers.settings import FAST_DECODE
from millm_engines.transformers.testing import tiny_model_dir


def _declaring(source: str, folder: Path, dtype: str, **extra: object) -> str:
    """``source``'s files under a config that declares ``dtype`` (and ``extra``)."""
    folder.mkdir()
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), folder / name)
    config = json.loads(Path(source, "config.json").read_text())
    config["dtype"] = dtype
    config.update(extra)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("architecture", "fast", "softcap", "picked"),
    [
        ("llama", True, False, "bfloat16"),
        ("llama", False, False, "bfloat16"),
        ("qwen2", True, False, "bfloat16"),
        ("qwen2", True, True, "float32"),
    ],
)
def test_auto_takes_the_declared_dtype_only_where_it_is_batch_invariant(
    tmp_path: Path, architecture: str, fast: bool, softcap: bool, picked: str
) -> None:
    extra = {"attn_logit_softcapping": 50.0} if softcap else {}
    path = _declaring(tiny_model_dir(architecture=architecture), tmp_path / "ckpt", "bfloat16", **extra)
    settings = load_settings({"fast_decode": fast}, environ={}, plugin_settings=[FAST_DECODE])
    engine = load_engine(ModelLocation(path=path, served_name="m"), settings)
    assert engine.info.dtype == picked
    assert engine.batch_invariant  # what auto picks never gives a row's tokens away to its batch
    width = {"bfloat16": 2, "float32": 4}[picked]
    parameters = sum(p.numel() for p in engine.model.parameters())
    packed = engine.fast.packed_bytes if engine.fast is not None else 0  # blocked weight copies, on a CPU with native bf16
    assert preflight(ModelLocation(path=path, served_name="m"), settings).need["cpu"] == parameters * width + packed


def test_an_explicit_dtype_is_served_as_asked(tmp_path: Path) -> None:
    path = _declaring(tiny_model_dir(architecture="qwen2"), tmp_path / "ckpt", "float32")
    settings = load_settings({"dtype": "bfloat16"}, environ={}, plugin_settings=[FAST_DECODE])
    engine = load_engine(ModelLocation(path=path, served_name="m"), settings)
    assert engine.info.dtype == "bfloat16" and engine.fast is None and engine.batch_invariant  # rows attend over their own columns


@pytest.mark.parametrize("published", [None, "bfloat16"])
def test_a_float32_conversion_of_a_bf16_model_is_served_in_bf16_where_the_cpu_has_bf16_kernels(
    tmp_path: Path, published: str | None
) -> None:
    """A float32 checkpoint whose model source says the model was published in bf16 (the
    default SmolLM2, dequantised from its GGUF) gets bf16 under ``auto`` on a CPU with bf16
    kernels, float32 elsewhere; without that word it stays float32. The load plan agrees."""
    from millm_engines.transformers.packed import ops_available

    path = _declaring(tiny_model_dir(), tmp_path / "ckpt", "float32")
    location = ModelLocation(path=path, served_name="m", extra={"published_dtype": published} if published else {})
    settings = load_settings({}, environ={}, plugin_settings=[FAST_DECODE])
    engine = load_engine(location, settings)
    picked = "bfloat16" if published and ops_available() else "float32"
    assert engine.info.dtype == picked and engine.batch_invariant
    width = {"bfloat16": 2, "float32": 4}[picked]
    packed = engine.fast.packed_bytes if engine.fast is not None else 0
    assert preflight(location, settings).need["cpu"] == sum(p.numel() for p in engine.model.parameters()) * width + packed
    explicit = load_engine(location, load_settings({"dtype": "float32"}, environ={}, plugin_settings=[FAST_DECODE]))
    assert explicit.info.dtype == "float32"  # an explicit dtype is served as asked
