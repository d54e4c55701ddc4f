"""What loading a checkpoint would take, read from its files without loading it: the
dtype it would be served in, whether its quantization can be loaded here, and the bytes
its weights will take. The core runs this before a switch unloads the resident model.
Importing this module does not import torch."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

from millm_core.api import LoadPlan, ModelLocation, Settings, UnsupportedQuantization, host_available_bytes

from .settings import FAST_DECODE, LEAN_MODEL_TYPES, PACKED_WEIGHTS

# Bytes per element of the dtypes millm serves a checkpoint in.
SERVED_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
# safetensors' floating dtypes (cast to the served dtype on load) and their widths.
_FLOATS = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
_OTHERS = {"I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on a header


def chosen_dtype(setting: str, declared: object, invariant: Callable[[], bool]) -> str:
    """The dtype a checkpoint is served in: ``--dtype`` unless ``auto``. ``auto`` takes
    the dtype its config declares (bfloat16 for most recent checkpoints) where a row's
    tokens stay independent of its batch in every dtype (``invariant()``, asked only
    then): on the lean decode step, and on the generic HF forward where each row can
    attend over its own cache columns (``rows.possible``). A model attending otherwise
    masks the columns it does not own, which only float32 leaves the tokens alone for:
    there ``auto`` is float32 (ask for ``--dtype bfloat16`` to trade that away for speed)."""
    if setting != "auto":
        return setting
    name = str(declared).removeprefix("torch.") if declared is not None else ""
    if name not in SERVED_WIDTH:
        return "float32"
    return name if name == "float32" or invariant() else "float32"


# A ModelLocation.extra key: the dtype a model was published in, where a model source
# converted it to a wider one (the default SmolLM2, dequantised from its GGUF to float32).
PUBLISHED_DTYPE = "published_dtype"


def auto_candidate(declared: object, location: ModelLocation) -> object:
    """The dtype ``--dtype auto`` weighs for a checkpoint: the one its config declares, or
    bfloat16 for a float32 checkpoint converted from a model published in bfloat16
    (``location.extra["published_dtype"]``) where oneDNN runs bf16 matrix products on this
    CPU (AVX-512; natively with AVX-512 BF16 or AMX). Elsewhere (AVX2) such a checkpoint
    stays float32: there a bf16 prefill is several times slower than a float32 one."""
    name = str(declared).removeprefix("torch.") if declared is not None else ""
    if name == "float32" and location.extra.get(PUBLISHED_DTYPE) == "bfloat16":
        from .packed import ops_available  # imports torch: only for such a checkpoint

        if ops_available():
            return "bfloat16"
    return declared


def invariant_in_any_dtype(config: object, settings: Settings) -> bool:
    """Whether a checkpoint with this config would decode batch-invariantly in every dtype:
    on the lean decode step, or on the generic HF forward with row-wise attention (which
    takes importing transformers to tell)."""
    if lean_step(config, settings):
        return True
    from .rows import possible  # imports torch: only when auto has a low-precision dtype to weigh

    return possible(config)


def lean_refusal(config: object) -> str | None:
    """Why the lean decode step cannot serve a checkpoint with this config (a
    ``config.json`` dict or a transformers config), or None when its config allows it
    (the loaded modules are checked too: :func:`.fastpath.unsupported_reason`)."""

    def get(key: str, default: object = None) -> object:
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    if get("model_type") not in LEAN_MODEL_TYPES:
        return f"model_type {get('model_type')!r} has no fast decode path"
    if get("hidden_act", "silu") != "silu":
        return "activation is not silu"
    if get("attention_bias", False) or get("mlp_bias", False):
        return "projection biases are not supported"
    if get("pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def lean_step(config: object, settings: Settings) -> bool:
    """Whether the lean decode step would serve a checkpoint with this config."""
    return bool(FAST_DECODE.get(settings)) and lean_refusal(config) is None


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX), as its kernel
    reports it; False where that cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def packing_plan(config: object, dtype: str, settings: Settings) -> str | None:
    """Why the lean step would not keep blocked copies of the weights (see :mod:`.packed`),
    or None when it would try (its load-time check may still decline them)."""
    if not PACKED_WEIGHTS.get(settings):
        return "disabled by --packed-weights false"
    if not lean_step(config, settings):
        return "no lean decode step"
    if dtype != "bfloat16":
        return f"served in {dtype}, not bfloat16"
    if not native_bf16():
        return "this CPU has no native bf16 (AVX-512 BF16 or AMX)"
    return None


def _config(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def check_quantization(name: str, quantization: object) -> None:
    """Refuse a quantization transformers cannot load on this machine (its quantizer is
    unknown, or its environment check fails: a missing package, no GPU), with
    transformers' own reason."""
    if not isinstance(quantization, dict):
        return
    method = quantization.get("quant_method", "unrecorded")
    from transformers.quantizers import AutoHfQuantizer  # the engine's own library decides

    try:
        quantizer = AutoHfQuantizer.from_config(dict(quantization))
        quantizer.validate_environment(device_map=None, dtype=None)
    except (ImportError, ValueError, RuntimeError, TypeError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UnsupportedQuantization(
            f"'{name}' is quantized with {method!r}, which the transformers engine cannot load on this server: {reason}",
            param="model",
        ) from exc


def _header(file: str) -> dict[str, Any]:
    """``file``'s safetensors header. Raises ``ValueError`` for one that is not."""
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{os.path.basename(file)}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _HEADER_LIMIT:
            raise ValueError(f"{os.path.basename(file)}: header of {length} bytes")
        header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{os.path.basename(file)}: the header is not an object")
    return header


def _safetensors_bytes(file: str, width: int | None, only: set[str] | None = None) -> int:
    """The bytes ``file``'s tensors (with ``only``, those it names) take once loaded:
    floating tensors at ``width`` bytes an element (None: as stored), others as stored.
    Raises ``ValueError`` for a header that is not a safetensors header."""
    total = 0
    for key, tensor in _header(file).items():
        if key == "__metadata__" or (only is not None and key not in only):
            continue
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        stored = tensor.get("dtype") if isinstance(tensor, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{os.path.basename(file)}: tensor {key!r} has no valid shape")
        if not isinstance(stored, str):
            raise ValueError(f"{os.path.basename(file)}: tensor {key!r} has no dtype")
        count = 1
        for dim in shape:
            count *= dim
        total += count * ((width or _FLOATS[stored]) if stored in _FLOATS else _OTHERS.get(stored, 1))
    return total


def _weight_files(path: str) -> list[str]:
    """The safetensors files a load reads: those the index names when there is one (a
    folder may also hold a consolidated copy the load never reads), else every one."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError("model.safetensors.index.json has no weight_map")
        return [os.path.join(path, name) for name in sorted({str(v) for v in weight_map.values()})]
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")]


def weights_bytes(path: str, width: int | None) -> int:
    """What the checkpoint's weights take once loaded: from its safetensors headers, else
    (pickled weights) the size of its weight files."""
    tensors = _weight_files(path)
    if tensors:
        return sum(_safetensors_bytes(f, width) for f in tensors)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth")))


def _packed(names: set[str]) -> set[str]:
    """The tensors of a Llama checkpoint the lean step keeps blocked copies of: the
    projections, and the output matrix (the embeddings where they are tied to it)."""
    projections = {n for n in names if n.endswith("_proj.weight") and (".self_attn." in n or ".mlp." in n)}
    output = {n for n in names if n == "lm_head.weight"} or {n for n in names if n.endswith("embed_tokens.weight")}
    return projections | output


def preflight(location: ModelLocation, settings: Settings) -> LoadPlan:
    """The transformers engine's :class:`~millm_core.api.LoadPlan` (weights on the CPU, in
    the dtype the load would choose); refuses an unloadable quantization."""
    config = _config(location.path)
    quantization = config.get("quantization_config")
    check_quantization(location.served_name, quantization)
    declared = config.get("dtype") or config.get("torch_dtype")
    declared = auto_candidate(declared, location) if settings.dtype == "auto" else declared
    dtype = chosen_dtype(settings.dtype, declared, lambda: invariant_in_any_dtype(config, settings))
    width = None if quantization is not None else SERVED_WIDTH[dtype]
    # Unreadable or malformed weight files raise: the core refuses the load before it
    # unloads anything (model_load_failed).
    need = weights_bytes(location.path, width)
    if quantization is None and packing_plan(config, dtype, settings) is None:
        # The blocked copies (as large as the matrices they copy, for shapes in multiples
        # of 64); pickled weights have no header to pick them from: counted as all.
        files = _weight_files(location.path)
        packed = _packed({name for f in files for name in _header(f)})
        need += sum(_safetensors_bytes(f, width, packed) for f in files) if files else need
    return LoadPlan(need={"cpu": need}, free={"cpu": host_available_bytes()})
