"""Prefix reuse on the GGUF engine: llama.cpp's saved state of a prompt's beginning,
restored into the next row whose prompt shares it, with one sequence at a time or with
several sharing batches.

Exactness, as on the transformers engine (see ``millm_engines.transformers.prefix``):
every prompt runs in ``llama_decode`` calls that end at the multiples of :data:`CHUNK`,
resumed or not, and only whole chunks are kept, so a resumed prompt's remaining calls see
the same tokens in the same shapes as a full prefill's. The state is the sequence's KV
cells, byte for byte (``llama_state_seq_get_data``); restored into an empty sequence
(``llama_state_seq_set_data``, into whichever sequence the row has: each has a KV stream
of its own) they take the cells a full prefill would have filled (measured: bit-identical
logits on the tiny f32 and Q8_0 test models, and on SmolLM2 Q4_1).

With several sequences this holds only where a row's numbers do not depend on the rows
that share its calls: where the engine is batch-invariant (a KV stream per sequence, flash
attention, a file whose quantization was verified and which passed
``LlamaModel.shares_exactly`` at load; see :mod:`.llama`). There a joining prompt's calls
carry only other rows' single tokens beside it, and its saved cells are what it computes
alone. (llama.cpp runs such a call as one token of each sequence, then the prompt's rest:
a resumed prompt joining beside decoding rows is cut there too. The load-time check
covers that cut; tests/e2e/test_prefix_e2e.py checks such a resumed row on SmolLM2 Q4_1,
whose logits do move with other cuts.) Elsewhere (f32 attention, K-quants, a file failing the check) a prefill's cells
depend on what shared its calls, so a restored state would be another batch's numbers,
not the row's own: the engine keeps nothing there.

The cut: with one sequence or several, prompts' calls end at the multiples of CHUNK (128),
where the shared-batch engine once cut them at ``n_batch`` (512), which would make reuse
come in multiples of 512. Measured on SmolLM2 Q4_1 with eight sequences, CPU time of one
thread (the shared two-core test machine swung wall times by 3x): a 512-token prefill took
7.20 s in calls of 128 against 7.51 s in one call of 512, a 1,024-token one 15.43 s
against 15.44 s. With two threads on that loaded machine calls of 128 took about 1.4x
the wall time (more calls, each waiting for two threads that other processes preempt; one
setting ranged from 6.1 s to 18.8 s), which a quiet machine should confirm. The compute
is the same, so both modes use calls of 128.

An entry is one prompt's state up to its last whole chunk, keyed by those tokens (the
model and its KV types are the engine's own); a prompt resumes from the entry sharing the
longest prefix with it, cut back to whole chunks (the cells past the cut are dropped). An
entry whose tokens begin another, longer one is dropped for it. Bounded in bytes, least
recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# A prompt's calls end at the multiples of this many positions: reuse comes in multiples of it.
CHUNK = 128


@dataclass
class StateStats:
    """Prefills that resumed (``hits``) or found nothing (``misses``), prompt tokens
    resumed, entries evicted, and what is held now."""

    hits: int = 0
    misses: int = 0
    resumed_tokens: int = 0
    evicted: int = 0
    entries: int = 0
    bytes: int = 0


def shared_chunks(a: Sequence[int], b: Sequence[int], limit: int, size: int = CHUNK) -> int:
    """How many whole chunks (up to ``limit``) ``a`` and ``b`` begin with in common."""
    n = 0
    while n < limit and a[n * size : (n + 1) * size] == b[n * size : (n + 1) * size]:
        n += 1
    return n


class StateCache:
    """Saved sequence states of prompts' beginnings, for one loaded model (model thread only)."""

    def __init__(self, max_bytes: int, chunk: int = CHUNK) -> None:
        self.max_bytes = max_bytes
        self.chunk = chunk
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self.stats = StateStats()

    def lookup(self, prompt: Sequence[int]) -> tuple[int, bytes] | None:
        """``(tokens to resume, saved state)`` for the entry sharing the longest whole-chunk
        prefix with ``prompt``, leaving at least its last token to compute; the state may
        hold more tokens than that (the caller drops the rest)."""
        usable = (len(prompt) - 1) // self.chunk
        best, found = 0, None
        prompt = list(prompt)
        for tokens, state in self._entries.items():
            n = shared_chunks(prompt, list(tokens), min(usable, len(tokens) // self.chunk), self.chunk)
            if n > best:
                best, found = n, (tokens, state)
        if found is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(found[0])
        self.stats.hits += 1
        self.stats.resumed_tokens += best * self.chunk
        return best * self.chunk, found[1]

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already begins with ``tokens`` (nothing new to save)."""
        key = tuple(tokens)
        return any(held[: len(key)] == key for held in self._entries)

    def store(self, tokens: Sequence[int], state: bytes) -> None:
        """Keep ``state``, the saved sequence of exactly ``tokens`` (whole chunks); entries
        it extends go. Then evict down to the bound."""
        key = tuple(tokens)
        if self.max_bytes <= 0 or len(state) > self.max_bytes or not key:
            return
        for held in [t for t in self._entries if key[: len(t)] == t]:
            self._drop(held)
        self._entries[key] = state
        self.stats.entries += 1
        self.stats.bytes += len(state)
        while self.stats.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: tuple[int, ...]) -> None:
        state = self._entries.pop(key)
        self.stats.entries -= 1
        self.stats.bytes -= len(state)

    def clear(self) -> None:
        """Drop every entry."""
        for key in list(self._entries):
            self._drop(key)
