"""Load a local Hugging Face checkpoint directory into a TransformersEngine."""

from __future__ import annotations

import json
import os

import structlog
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

from millm_core.api import ConfigError, ModelInfo, ModelLocation, Settings, operator_chat_template

from .engine import TransformersEngine
from .fastpath import LlamaDecoder, unsupported_reason
from .prefix import PrefixCache
from .preflight import auto_candidate, check_quantization, chosen_dtype, invariant_in_any_dtype, packing_plan
from .settings import FAST_DECODE, PREFIX_CACHE_MB

log = structlog.get_logger("millm.engine.transformers")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_checkpoint_dir(location: ModelLocation) -> bool:
    return os.path.isdir(location.path) and os.path.isfile(os.path.join(location.path, "config.json"))


def _choose_dtype(settings: Settings, config: object, location: ModelLocation) -> torch.dtype:
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    declared = auto_candidate(declared, location) if settings.dtype == "auto" else declared
    return _DTYPES[chosen_dtype(settings.dtype, declared, lambda: invariant_in_any_dtype(config, settings))]


def _eos_ids(tokenizer: object, path: str) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    try:
        gen = GenerationConfig.from_pretrained(path)
    except OSError:
        gen = None
    if gen is not None and gen.eos_token_id is not None:
        ids.update([gen.eos_token_id] if isinstance(gen.eos_token_id, int) else gen.eos_token_id)
    return frozenset(ids)


def stated_sampling(path: str) -> dict[str, float]:
    """The sampling values (temperature, top_p, top_k) a model's ``generation_config.json``
    states, for a model that samples by default; never the library's built-in values."""
    try:
        with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as fh:
            stated = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(stated, dict) or stated.get("do_sample") is not True:  # HF generates greedily unless told to sample
        return {}
    return {
        k: float(v) for k in ("temperature", "top_p", "top_k") if isinstance(v := stated.get(k), int | float) and not isinstance(v, bool)
    }


def load_engine(location: ModelLocation, settings: Settings) -> TransformersEngine:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    path = location.path
    config = AutoConfig.from_pretrained(path)
    check_quantization(location.served_name, getattr(config, "quantization_config", None))
    dtype = _choose_dtype(settings, config, location)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    operator_template = operator_chat_template(settings.chat_template)
    if operator_template is not None:
        tokenizer.chat_template = operator_template
    native = int(getattr(config, "max_position_embeddings", 0) or 0)
    context = native
    if settings.max_model_len is not None:
        if native and settings.max_model_len > native:
            raise ConfigError(f"--max-model-len {settings.max_model_len} exceeds the model's context window of {native} tokens")
        context = settings.max_model_len
    if not context:
        raise ConfigError("the model states no context window; pass --max-model-len")
    quant = getattr(config, "quantization_config", None)
    quantization = location.quantization or (str(quant.get("quant_method", "unrecorded")) if isinstance(quant, dict) else "none")
    info = ModelInfo(
        served_name=location.served_name,
        engine="transformers",
        context_length=context,
        d_model=int(getattr(config, "hidden_size", 0) or 0),
        n_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        vocab_size=int(getattr(config, "vocab_size", 0) or len(tokenizer)),
        dtype=str(dtype).removeprefix("torch."),
        revision=location.revision,
        quantization=quantization,
        owned_by=location.extra.get("owned_by", "millm"),
        created=int(os.path.getmtime(os.path.join(path, "config.json"))),
    )
    fast = None
    reason = unsupported_reason(model) if FAST_DECODE.get(settings) else "disabled by --fast-decode false"
    prefix = None
    if reason is None:
        fast = LlamaDecoder(model, packing=packing_plan(config, info.dtype, settings))
    if PREFIX_CACHE_MB.get(settings) > 0:  # the cache belongs to this model in this dtype (the engine drops it where unusable)
        prefix = PrefixCache(PREFIX_CACHE_MB.get(settings) * 2**20, f"{info.served_name}@{info.revision}:{info.dtype}")
    engine = TransformersEngine(model, tokenizer, info, _eos_ids(tokenizer, path), fast=fast, prefix=prefix)
    log.info(
        "model_loaded",
        model=info.served_name,
        dtype=info.dtype,
        context_length=context,
        threads=torch.get_num_threads(),
        fast_decode=fast is not None,
        fast_decode_reason=reason,
        packed_weights_mb=round(fast.packed_bytes / 2**20, 1) if fast is not None else 0,
        packed_weights_refusal=fast.packing_refusal if fast is not None else reason,
        rows_grouping_refusal=fast.grouping_refusal if fast is not None else reason,
        scripted_layers_refusal=fast.scripting_refusal if fast is not None else reason,
        prefill_rows_block=engine.lean.block if engine.lean is not None else 0,
        prefill_together_refusal=engine.lean_refusal,
        batches_requests=engine.batches_requests,
        batching_refusal=engine.join_refusal,
        batch_invariant=engine.batch_invariant,
        rows_attention_refusal=engine.rows_refusal,
        prefix_cache_mb=PREFIX_CACHE_MB.get(settings) if engine.prefix is not None else 0,
        prefix_cache_refusal=engine.prefix_refusal,
    )
    engine.generation_defaults = stated_sampling(path)
    if settings.batch_invariant and not engine.batch_invariant:
        raise ConfigError(
            f"--batch-invariant: '{info.served_name}' in {info.dtype} has no batch-invariant path here (the lean decode step "
            f"is not available: {reason}; and {engine.rows_refusal}); serve it with --dtype float32"
        )
    return engine
