"""Prefix reuse on the transformers engine (the lean decode step, and the generic HF forward
of models whose rows join batches): the KV state of finished prefills, kept in a bounded cache, so that a prompt sharing a prefix with an earlier one starts its prefill
from that prefix instead of from its first token.

Exactness. A row's tokens must not depend on whether its prefill resumed, but a resumed
prefill feeds fewer positions at once than a full one, and the CPU kernels' rounding
changes with the shape of the products (a row of ``X[:m] @ W`` is not the same for every
``m``). So every prefill on this path runs in chunks that end at fixed absolute positions,
the multiples of :data:`CHUNK` (a prompt of up to ``CHUNK`` tokens is one forward pass,
as before), and the cache keeps and resumes whole chunks only. A chunk then always sees
the same inputs in the same shapes — its tokens, and the keys and values of the chunks
before it — whether those came from this prefill or from the cache, and computes the same
numbers bit for bit, in every dtype.

What is kept: the keys and values, per layer, of each whole chunk of a prompt, in a tree
of blocks (a block is one chunk, below the block of the chunk before it), so prompts that
share a system prompt share its blocks. The key of a block is everything its values depend
on: its tokens, those of every chunk before it (its place in the tree), the row's
steering deltas (a digest of their bytes: rows with different deltas never share a block)
and the engine state (model, revision and dtype; the cache belongs to one loaded engine).
Generated tokens are not kept: the decode step computes their keys one token at a time,
which a prefill would not reproduce exactly.

The bound is in bytes; past it the least recently used block goes first. A block is used
when a prefill resumes from it or stores it, and using a block uses every block above it
afterwards, so the least recently used block never has a block below it: eviction drops
the ends of prompts before their shared beginnings.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .taps import Captured

# The prefill's chunk length: reuse comes in multiples of it. Smaller chunks reuse more of
# a shared prefix and cost more, smaller forward passes (SmolLM2 float32, 1,030 tokens, 2
# threads, against one pass: 128 → +14-22 %, 64 → +42 %; with one thread 128 costs nothing
# measurable).
CHUNK = 128


# Rotary scalings whose keys depend on more than a position: "dynamic" (NTK) rescales by
# the longest sequence the module has seen so far, "longrope" picks its factors by the
# length of the pass. A resumed prefill would not compute what a full one does.
STATEFUL_ROPE = frozenset({"dynamic", "longrope"})


def rope_refusal(config: Any) -> str | None:
    """Why a model with ``config`` cannot resume prefills exactly because of its rotary
    scaling (None: it can). Looks through per-layer-type rotary parameters too."""
    found: set[str] = set()

    def visit(params: Any) -> None:
        if isinstance(params, Mapping):
            kind = params.get("rope_type", params.get("type"))
            if isinstance(kind, str):
                found.add(kind)
            for value in params.values():
                visit(value)

    visit(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None))
    stateful = sorted(found & STATEFUL_ROPE)
    if not stateful:
        return None
    return f"its rotary scaling ({', '.join(stateful)}) depends on the lengths seen, not only on positions"


def chunks(start: int, end: int, size: int = CHUNK) -> Iterator[tuple[int, int]]:
    """The prefill's forward passes for positions ``start .. end - 1``: ``(a, b)`` ranges
    that end at the multiples of ``size`` (and at ``end``)."""
    a = start
    while a < end:
        b = min(end, (a // size + 1) * size)
        yield a, b
        a = b


def prefill_chunks(
    model: Any, prompt: Sequence[int], start: int, cache: Any, hooks: Callable[[Captured], contextlib.AbstractContextManager[None]]
) -> tuple[torch.Tensor, list[Captured]]:
    """Feed ``prompt[start:]`` to the HF ``model`` one chunk at a time (see :func:`chunks`)
    on top of ``cache``, which holds positions ``0 .. start - 1`` and grows to the whole
    prompt. ``hooks(captured)`` wraps each forward pass (steering, taps). Returns the last
    position's logits ``[1, vocab]`` and what each chunk's taps captured."""
    device = next(model.parameters()).device
    body = getattr(model, "model", None)  # the decoder without the LM head, where the class names it so
    captured: list[Captured] = []
    logits: torch.Tensor | None = None
    for a, b in chunks(start, len(prompt)):
        captured.append({})
        ids = torch.tensor([list(prompt[a:b])], dtype=torch.long, device=device)
        positions = torch.arange(a, b, device=device)[None]
        with hooks(captured[-1]):
            if b < len(prompt) and body is not None:  # an inner chunk: its keys and values, no logits
                body(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            else:  # the last chunk (or any, without a named decoder): the last position's logits
                logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
    if logits is None:
        raise ValueError(f"nothing left to prefill: {start} of the prompt's {len(prompt)} tokens were resumed")
    return logits, captured


@dataclass(eq=False)
class _Block:
    """One chunk's keys and values, per layer ``[kv_heads, CHUNK, head_dim]``."""

    serial: int
    key: tuple[object, tuple[int, ...]]  # (the parent's serial, or the root key; the tokens)
    parent: _Block | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int
    children: int = 0


@dataclass
class PrefixStats:
    """Counters: prefills that resumed (``hits``) or found nothing (``misses``), prompt
    tokens resumed, blocks evicted, and what is held now."""

    hits: int = 0
    misses: int = 0
    resumed_tokens: int = 0
    evicted_blocks: int = 0
    blocks: int = 0
    bytes: int = 0


@dataclass
class Resume:
    """A prefix found in the cache: its length and, per layer, its keys and values
    ``[1, kv_heads, length, head_dim]`` (fresh tensors, the caller's to keep)."""

    length: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


class PrefixCache:
    """A bounded store of prompts' KV blocks for one loaded engine (model thread only)."""

    def __init__(self, max_bytes: int, state: str, chunk: int = CHUNK) -> None:
        self.max_bytes = max_bytes
        self.chunk = chunk
        self._state = state.encode()
        self._blocks: OrderedDict[tuple[object, tuple[int, ...]], _Block] = OrderedDict()
        self._serial = 0
        self.stats = PrefixStats()

    def root(self, deltas: Mapping[int, torch.Tensor] | None) -> bytes:
        """The key of a row's first block: the engine state and the row's steering deltas
        (``layer -> [d_model]``, as the forward adds them; an all-zero delta is no delta)."""
        digest = hashlib.blake2b(self._state, digest_size=16)
        for layer, vector in sorted((deltas or {}).items()):
            if not bool(vector.any()):
                continue
            digest.update(layer.to_bytes(4, "little"))
            digest.update(str(vector.dtype).encode())
            digest.update(vector.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def _path(self, root: bytes, prompt: Sequence[int], blocks: int) -> list[_Block]:
        path: list[_Block] = []
        parent: object = root
        size = self.chunk
        for b in range(blocks):
            block = self._blocks.get((parent, tuple(prompt[b * size : (b + 1) * size])))
            if block is None:
                break
            path.append(block)
            parent = block.serial
        return path

    def _touch(self, path: Sequence[_Block]) -> None:
        """Mark ``path`` used: the deepest block first, so that every block is more recent
        than the blocks below it (eviction then takes leaves only)."""
        for block in reversed(path):
            self._blocks.move_to_end(block.key)

    def lookup(self, root: bytes, prompt: Sequence[int]) -> Resume | None:
        """The longest cached prefix of ``prompt`` under ``root`` that leaves at least one
        prompt token to compute (its logits draw the first token), in whole chunks."""
        usable = (len(prompt) - 1) // self.chunk
        path = self._path(root, prompt, usable) if usable > 0 else []
        if not path:
            self.stats.misses += 1
            return None
        self._touch(path)
        self.stats.hits += 1
        self.stats.resumed_tokens += len(path) * self.chunk
        layers = len(path[0].keys)
        return Resume(
            length=len(path) * self.chunk,
            keys=[torch.cat([b.keys[i] for b in path], dim=1)[None] for i in range(layers)],
            values=[torch.cat([b.values[i] for b in path], dim=1)[None] for i in range(layers)],
        )

    def store(self, root: bytes, prompt: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Keep the whole chunks of ``prompt`` whose per-layer keys and values
        (``[1, kv_heads, >= len(prompt), head_dim]``) a prefill just computed; blocks
        already held are only marked used. Then evict down to the bound."""
        if self.max_bytes <= 0:
            return
        size = self.chunk
        whole = len(prompt) // size
        if whole == 0:
            return
        path = self._path(root, prompt, whole)
        parent: _Block | None = path[-1] if path else None
        for b in range(len(path), whole):
            a, e = b * size, (b + 1) * size
            ks = [k[0, :, a:e].clone() for k in keys]
            vs = [v[0, :, a:e].clone() for v in values]
            nbytes = sum(t.numel() * t.element_size() for t in (*ks, *vs))
            if nbytes > self.max_bytes:
                break
            self._serial += 1
            block = _Block(self._serial, (parent.serial if parent else root, tuple(prompt[a:e])), parent, ks, vs, nbytes)
            self._blocks[block.key] = block
            if parent is not None:
                parent.children += 1
            self.stats.blocks += 1
            self.stats.bytes += nbytes
            path.append(block)
            parent = block
        self._touch(path)
        self._evict()

    def _evict(self) -> None:
        while self.stats.bytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            assert block.children == 0, "the least recently used block has a block below it"
            if block.parent is not None:
                block.parent.children -= 1
            self.stats.blocks -= 1
            self.stats.bytes -= block.nbytes
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.stats.blocks = 0
        self.stats.bytes = 0
