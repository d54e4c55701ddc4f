"""Load a GGUF file into a :class:`~millm_engines.gguf.engine.GGUFEngine`."""

from __future__ import annotations

import os
import time

import structlog

from millm_core.api import Capability, ConfigError, ModelInfo, ModelLocation, Settings, operator_chat_template

from . import naming
from .engine import GGUFEngine
from .llama import LlamaModel, file_facts
from .plugin import CAPABILITIES, EMBEDDINGS, ENGINE, KV_CELLS, PARALLEL, PREFIX_CACHE_MB
from .prefix import StateCache

log = structlog.get_logger("millm.gguf")
# The KV cache's size when neither --max-model-len nor --gguf-kv-cells says: every
# sequence gets the model's context if all of them fit in this, else an equal share.
DEFAULT_KV_BYTES = 2 * 2**30
# llama.cpp gives each stream a multiple of this many cells.
CELL_PAD = 256
# Files whose shared batches were verified invariant under churn on this project's CPU
# (tests/gguf/test_gguf_invariance.py): 24 requests joining and leaving a batch of 8 each
# kept their solo tokens. A Q4_K_M file passes the load-time check and still changed 8 of
# 24, so other quantizations say they are not invariant rather than promise it.
VERIFIED_QUANTIZATIONS = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def _cells_per_sequence(settings: Settings, context: int, parallel: int, cell_bytes: int) -> int:
    """KV cells in each sequence's stream: --gguf-kv-cells shared equally, the context
    when --max-model-len asks for it (whatever the cache's size: the preflight counts
    it), else the context within DEFAULT_KV_BYTES."""
    total = KV_CELLS.get(settings)
    if total:
        per_seq = total // parallel
        if per_seq < CELL_PAD:
            raise ConfigError(
                f"--{KV_CELLS.name.replace('_', '-')} {total} leaves {per_seq} cells to each of {parallel} sequences; "
                f"llama.cpp gives a sequence at least {CELL_PAD}: give at least {CELL_PAD * parallel}"
            )
        per_seq = min(per_seq, context)
    elif settings.max_model_len:
        per_seq = context  # asked for: every sequence holds it, whatever the cache's size
    else:
        per_seq = min(context, DEFAULT_KV_BYTES // (parallel * max(cell_bytes, 1)))
    # llama.cpp rounds a stream up to a multiple of CELL_PAD: round down first, so that
    # what it allocates stays within the operator's cells or the budget.
    return max(CELL_PAD, per_seq // CELL_PAD * CELL_PAD) if per_seq < context else per_seq


def load_engine(location: ModelLocation, settings: Settings) -> GGUFEngine:
    if settings.dtype != "auto":
        # A GGUF file's precision is its quantization; nothing here could honour --dtype.
        raise ConfigError(f"--dtype {settings.dtype} cannot apply to a GGUF model: its precision is its quantization; leave --dtype auto")
    started = time.perf_counter()
    # Each sequence has a KV stream of its own with flash attention, which makes shared
    # batches invariant where the file's kernels allow (see .llama): checked bit for bit
    # here. Where they are not (f32 attention, or kernels that change with the rows a call
    # carries), --batch-invariant gives one sequence at a time; otherwise responses say so.
    threads = settings.threads or os.cpu_count() or 1
    facts = file_facts(location.path)
    trained = facts.context
    if trained <= 0:
        raise ConfigError(f"{location.path}: no context length in its metadata")
    tag = location.quantization or naming.tag_of_file_type(facts.file_type) or naming.tag_of_filename(location.path)
    if tag is None:
        raise ConfigError(f"{location.path}: no quantization tag in its metadata or its name")
    f32 = tag == "F32"
    cell_bytes = facts.cell_bytes * (2 if f32 else 1)
    embeddings = EMBEDDINGS.get(settings)
    context = min(settings.max_model_len or trained, trained)
    parallel = PARALLEL.get(settings) or 1
    llm = LlamaModel(
        location.path, n_ctx=_cells_per_sequence(settings, context, parallel, cell_bytes) * parallel, n_seq_max=parallel, threads=threads, f32_kv=f32
    )
    try:
        shares = parallel == 1 or (llm.flash_attn and tag in VERIFIED_QUANTIZATIONS and llm.shares_exactly())
    except BaseException:
        llm.close()
        raise
    if not shares:
        why = (
            "f32 attention"
            if not llm.flash_attn
            else f"shared batches are verified for {', '.join(sorted(VERIFIED_QUANTIZATIONS))} files, not {tag}"
            if tag not in VERIFIED_QUANTIZATIONS
            else "llama.cpp's kernels for this file change with the rows a call carries"
        )
        if settings.batch_invariant:
            llm.close()
            parallel = 1
            llm = LlamaModel(location.path, n_ctx=_cells_per_sequence(settings, context, 1, cell_bytes), n_seq_max=1, threads=threads, f32_kv=f32)
            log.info("gguf_batch_invariant", parallel=1, note=f"--batch-invariant: one sequence at a time ({why})")
        else:
            log.info("gguf_shared_batches_not_invariant", reason=why, note="--batch-invariant true decodes one sequence at a time")
    if llm.n_cells // parallel < context:
        log.warning(
            "gguf_context_per_sequence",
            trained=trained,
            served=llm.n_cells // parallel,
            parallel=parallel,
            note="each sequence's KV stream holds less than the model's context; --max-model-len or --gguf-kv-cells gives more",
        )
        context = llm.n_cells // parallel
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
    # Prefix reuse is exact where a row's numbers do not depend on its neighbours: one
    # sequence at a time, or shared batches that are invariant (see .prefix).
    if not PREFIX_CACHE_MB.get(settings):
        no_prefix: str | None = "off"
    elif not (parallel == 1 or shares):
        no_prefix = "shared batches are not invariant"
    else:
        no_prefix = llm.prefix_refusal()
    prefix = StateCache(PREFIX_CACHE_MB.get(settings) * 2**20) if no_prefix is None else None
    engine = GGUFEngine(
        llm,
        info,
        capabilities,
        parallel,
        refusals,
        chat_template=operator_chat_template(settings.chat_template),
        prefix=prefix,
        shares_exactly=shares,
    )
    log.info(
        "gguf_loaded",
        model=served,
        quantization=tag,
        context=context,
        kv_cells=llm.n_cells,
        flash_attention=llm.flash_attn,
        parallel=parallel,
        prefix_cache=no_prefix or f"{PREFIX_CACHE_MB.get(settings)} MiB",
        threads=threads,
        seconds=round(time.perf_counter() - started, 2),
    )
    return engine


def kv_cache_bytes(location: ModelLocation, settings: Settings) -> int:
    """The KV cache a load of ``location`` with ``settings`` would allocate (for the
    preflight's memory figure; one sequence at a time, if the load-time check sends a
    file there, needs less)."""
    facts = file_facts(location.path)
    context = min(settings.max_model_len or facts.context, facts.context)
    parallel = PARALLEL.get(settings) or 1
    f32 = (location.quantization or naming.tag_of_file_type(facts.file_type) or naming.tag_of_filename(location.path)) == "F32"
    cell_bytes = facts.cell_bytes * (2 if f32 else 1)
    return _cells_per_sequence(settings, context, parallel, cell_bytes) * parallel * cell_bytes
