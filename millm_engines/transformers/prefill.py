"""Prefilling a batch's prompts on the transformers engine.

Each row is prefilled as it would be alone, then the rows' caches are merged into the
batch's. On the lean decode step, where the lean prefill is exact (see
:mod:`.leanprefill`), the rows of every batch prefilled at one time (a request's rows,
requests joining together) share its forward passes; otherwise each row runs alone
through HF's forward. A row's prefill runs in chunks and resumes from the prefix cache
where it can (see :mod:`.prefix`). A model whose cache cannot be merged runs a request's
rows padded together, as its only batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from .batch import HFBatch
from .fastpath import KVCache
from .leanprefill import Prompt
from .prefix import Resume, prefill_chunks
from .taps import Captured, TapSet, readouts

if TYPE_CHECKING:
    from .engine import TransformersEngine


def prefill(engine: TransformersEngine, batch: HFBatch) -> torch.Tensor:
    """The prompts' forward pass (see :func:`prefill_all`)."""
    return prefill_all(engine, [batch])[0]


def prefill_all(engine: TransformersEngine, batches: Sequence[HFBatch]) -> list[torch.Tensor]:
    """Each batch's prompts' forward pass; its logits ``[rows, vocab]``. Each row is
    prefilled as it would be alone and the caches of a batch's rows merged: a row's
    prefill then never depends on the other rows, which low-precision kernels would
    otherwise show in its tokens. Where the lean prefill is exact here, the rows of all
    the batches share its passes (see :mod:`.leanprefill`); otherwise each row runs
    alone through HF's forward. Either way a row's prefill runs in chunks and may
    resume from the prefix cache."""
    if engine.fast is None and engine.join_refusal is not None:
        # A cache that cannot be merged (sliding windows, recurrent state): a
        # request's rows run padded together, as its only batch.
        return [prefill_forward(engine, batch) for batch in batches]
    split = [[batch] if batch.size == 1 else [row_batch(engine, batch, r) for r in range(batch.size)] for batch in batches]
    parts = [part for rows in split for part in rows]
    flat = prefill_lean(engine, parts) if engine.lean is not None else [prefill_row(engine, part) for part in parts]
    out = []
    for batch, rows in zip(batches, split, strict=True):
        logits, flat = flat[: len(rows)], flat[len(rows) :]
        out.append(torch.cat(logits) if len(logits) > 1 else logits[0])
        if batch.size == 1:
            continue
        batch.resumed = [part.resumed[0] for part in rows]
        merged = rows[0]
        for part in rows[1:]:
            engine._merge(merged, part)
        batch.kv, batch.cache, batch.mask = merged.kv, merged.cache, merged.mask
        batch.next_pos, batch.draw_pos = merged.next_pos, merged.draw_pos
        reads = [part.reads[0] if part.reads is not None else None for part in rows]
        batch.reads = reads if any(r is not None for r in reads) else None
    return out


def row_batch(engine: TransformersEngine, batch: HFBatch, row: int) -> HFBatch:
    """Row ``row`` of ``batch`` as a batch of its own (same delta, same taps)."""
    part = HFBatch(prompts=[batch.prompts[row]], params=[batch.params[row]], row_taps=[batch.row_taps[row]], resumed=[0])
    part.taps = TapSet.build(part.row_taps, engine.device, engine.info.n_layers)
    if batch.deltas is not None:
        part.deltas = {layer: delta[row : row + 1] for layer, delta in batch.deltas.items()}
    return part


def resume(engine: TransformersEngine, part: HFBatch) -> tuple[bytes, Resume | None]:
    """A one-row batch's prefix-cache key, and the longest prefix of its prompt held
    there (never for a tapped row: its readouts cover every prompt position)."""
    if engine.prefix is None:
        return b"", None
    deltas = _row_deltas(part)
    root = engine.prefix.root(deltas)
    return root, (engine.prefix.lookup(root, part.prompts[0]) if part.taps is None else None)


def prefilled(
    engine: TransformersEngine,
    part: HFBatch,
    root: bytes,
    start: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    captured: list[Captured],
) -> None:
    """A one-row batch after its prefill: its whole chunks into the prefix cache, its
    keys and values (per layer ``[1, kv_heads, prompt, head_dim]``) into its cache."""
    prompt = part.prompts[0]
    if engine.prefix is not None:
        engine.prefix.store(root, prompt, keys, values)
    part.mask = None
    part.next_pos = torch.tensor([len(prompt)], dtype=torch.long, device=engine.device)
    part.draw_pos = [len(prompt)]
    part.resumed = [start]
    if part.taps is not None:
        joined = {tap: torch.cat([c[tap] for c in captured], dim=1) for tap in captured[0]}
        part.reads = readouts(part.taps, joined, [0], [len(prompt)])
    else:
        part.reads = None


def _row_deltas(part: HFBatch) -> dict[int, torch.Tensor] | None:
    """A one-row batch's steering deltas, ``layer -> [d_model]``."""
    return {layer: delta[0] for layer, delta in part.deltas.items()} if part.deltas else None


def prefill_lean(engine: TransformersEngine, parts: Sequence[HFBatch]) -> list[torch.Tensor]:
    """One-row batches prefilled together by the lean prefill, each resumed from the
    prefix cache where it can. A prompt whose first chunk repeats an earlier one's in the
    same call (a request's ``n`` rows; requests with one long system prompt), with the same
    steering, waits for a second pass, after the first has stored its blocks: it then
    resumes what they share, as when rows ran one at a time."""
    out: list[torch.Tensor | None] = [None] * len(parts)
    for wave in _waves(engine, parts):
        for i, logits in zip(wave, _prefill_wave(engine, [parts[i] for i in wave]), strict=True):
            out[i] = logits
    return [logits for logits in out if logits is not None]


def _waves(engine: TransformersEngine, parts: Sequence[HFBatch]) -> list[list[int]]:
    """The parts' indices in passes: a resumable prompt (longer than a chunk, untapped,
    with the cache on) whose first chunk and steering an earlier part's share, in the
    second pass; every other part in the first."""
    waves: list[list[int]] = [[], []]
    seen: set[tuple[bytes, tuple[int, ...]]] = set()
    for i, part in enumerate(parts):
        prompt = part.prompts[0]
        later = False
        if engine.prefix is not None and part.taps is None and len(prompt) > engine.prefix.chunk:
            key = (engine.prefix.root(_row_deltas(part)), tuple(prompt[: engine.prefix.chunk]))
            later = key in seen
            seen.add(key)
        waves[1 if later else 0].append(i)
    return [wave for wave in waves if wave]


def _prefill_wave(engine: TransformersEngine, parts: Sequence[HFBatch]) -> list[torch.Tensor]:
    assert engine.lean is not None
    prompts, roots = [], []
    for part in parts:
        root, found = resume(engine, part)
        roots.append(root)
        deltas = _row_deltas(part)
        prompt = Prompt(part.prompts[0], deltas=deltas, taps=part.row_taps[0])
        if found is not None:
            prompt.done, prompt.keys, prompt.values = found.length, found.keys, found.values
        prompts.append(prompt)
    starts = [p.done for p in prompts]
    engine.lean.run(prompts)
    out = []
    for part, prompt, root, start in zip(parts, prompts, roots, starts, strict=True):
        prefilled(engine, part, root, start, prompt.keys, prompt.values, prompt.captured)
        part.kv = KVCache.from_layers(prompt.keys, prompt.values)
        assert prompt.logits is not None
        out.append(prompt.logits)
    return out


def prefill_row(engine: TransformersEngine, part: HFBatch) -> torch.Tensor:
    """One row's prefill through HF's forward, in chunks ending at the multiples of
    ``prefix.CHUNK``, resumed from the longest prefix the prefix cache holds for the
    row; the row's whole chunks then go into the cache. See :mod:`.prefix` for why this
    is exact. The lean decode step takes the keys and values over into its own cache;
    the generic HF forward keeps HF's."""
    cache = DynamicCache(config=engine.model.config)
    root, found = resume(engine, part)
    start = 0
    if found is not None:
        start = found.length
        for layer, (keys, values) in enumerate(zip(found.keys, found.values, strict=True)):
            cache.update(keys, values, layer)
    logits, captured = prefill_chunks(engine.model, part.prompts[0], start, cache, lambda into: engine._block_hooks(part, into))
    layers: list[Any] = list(cache.layers)
    prefilled(engine, part, root, start, [layer.keys for layer in layers], [layer.values for layer in layers], captured)
    if engine.fast is not None:
        part.kv = KVCache.from_hf(cache)
    else:
        part.cache = cache
    return logits


def prefill_forward(engine: TransformersEngine, batch: HFBatch) -> torch.Tensor:
    """The prompts' prefill as one generic HF forward pass, rows left-padded to the
    longest: a serial model's request (where caches can be merged, each row is
    prefilled alone, see :func:`prefill_all`)."""
    lengths = [len(p) for p in batch.prompts]
    width = max(lengths)
    ids = torch.full((len(lengths), width), engine._pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, prompt in enumerate(batch.prompts):
        ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[r, width - len(prompt) :] = 1
    ids, mask = ids.to(engine.device), mask.to(engine.device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    padded = min(lengths) != width
    batch.cache = DynamicCache(config=engine.model.config)
    captured: Captured = {}
    with engine._block_hooks(batch, captured):
        out = engine.model(
            input_ids=ids,
            attention_mask=mask if padded else None,
            position_ids=positions,
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
    batch.mask = mask if padded else None
    batch.next_pos = positions[:, -1] + 1
    batch.draw_pos = lengths
    batch.reads = readouts(batch.taps, captured, [0] * len(lengths), lengths) if batch.taps is not None else None
    return out.logits[:, -1, :]
