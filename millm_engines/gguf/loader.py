"""Load a GGUF file into a :class:`~millm_engines.gguf.engine.GGUFEngine`."""

from __future__ import annotations

import os
import time

import structlog

from millm_core.api import Capability, ConfigError, ModelInfo, ModelLocation, Settings, operator_chat_template

from . import naming
from .engine import GGUFEngine
from .llama import LlamaModel
from .plugin import CAPABILITIES, EMBEDDINGS, ENGINE, KV_CELLS, PARALLEL, PREFIX_CACHE_MB
from .prefix import StateCache

log = structlog.get_logger("millm.gguf")
DEFAULT_MAX_CELLS = 16384


def load_engine(location: ModelLocation, settings: Settings) -> GGUFEngine:
    if settings.dtype != "auto":
        # A GGUF file's precision is its quantization; nothing here could honour --dtype.
        raise ConfigError(f"--dtype {settings.dtype} cannot apply to a GGUF model: its precision is its quantization; leave --dtype auto")
    started = time.perf_counter()
    # llama.cpp's kernels change with the number of sequences a decode call carries, so
    # only one sequence at a time is batch-invariant (measured: SmolLM2 Q4_1, 8 identical
    # greedy requests at once gave 2 different texts with 8 sequences, 1 with one).
    parallel = 1 if settings.batch_invariant else PARALLEL.get(settings) or 1
    if settings.batch_invariant and (PARALLEL.get(settings) or 1) > 1:
        log.info("gguf_batch_invariant", parallel=1, note="--batch-invariant: one sequence at a time")
    embeddings = EMBEDDINGS.get(settings)
    threads = settings.threads or os.cpu_count() or 1
    probe = LlamaModel(location.path, n_ctx=256, n_seq_max=1, threads=threads, f32_kv=False)
    try:
        file_type = probe.meta("general.file_type")
        trained = probe.n_ctx_train
    finally:
        probe.close()
    tag = location.quantization or naming.tag_of_file_type(int(file_type) if file_type else None) or naming.tag_of_filename(location.path)
    if tag is None:
        raise ConfigError(f"{location.path}: no quantization tag in its metadata or its name")
    context = min(settings.max_model_len or trained, trained)
    cells = KV_CELLS.get(settings) or min(context * parallel, max(context, DEFAULT_MAX_CELLS))
    if cells < context:
        raise ConfigError(
            f"--{KV_CELLS.name.replace('_', '-')} {cells} is smaller than the context ({context}); one sequence would not fit"
        )
    llm = LlamaModel(location.path, n_ctx=cells, n_seq_max=parallel, threads=threads, f32_kv=tag == "F32")
    if settings.served_name:
        served = settings.served_name
    else:
        served = naming.served_name(location.extra.get("gguf_name") or naming.stem(location.path), tag)
    info = ModelInfo(
        served_name=served,
        engine=ENGINE,
        context_length=context,
        d_model=llm.n_embd,
        n_layers=llm.n_layer,
        vocab_size=llm.n_vocab,
        dtype=tag.lower(),
        revision=location.revision,
        quantization=tag,
        owned_by=location.extra.get("owned_by", "millm"),
        created=int(os.path.getmtime(location.path)),
    )
    capabilities = CAPABILITIES if embeddings else CAPABILITIES - {Capability.EMBEDDINGS}
    refusals = (
        {}
        if embeddings
        else {Capability.EMBEDDINGS: f"the model was loaded with {EMBEDDINGS.name}=false (MILLM_{EMBEDDINGS.name.upper()})"}
    )
    # Prefix reuse is exact with one sequence at a time only (see .prefix).
    no_prefix = "several sequences share the cache" if parallel > 1 else llm.prefix_refusal() if PREFIX_CACHE_MB.get(settings) else "off"
    prefix = StateCache(PREFIX_CACHE_MB.get(settings) * 2**20) if no_prefix is None else None
    engine = GGUFEngine(
        llm, info, capabilities, parallel, refusals, chat_template=operator_chat_template(settings.chat_template), prefix=prefix
    )
    log.info(
        "gguf_loaded",
        model=served,
        quantization=tag,
        context=context,
        kv_cells=cells,
        parallel=parallel,
        prefix_cache=no_prefix or f"{PREFIX_CACHE_MB.get(settings)} MiB",
        threads=threads,
        seconds=round(time.perf_counter() - started, 2),
    )
    return engine
