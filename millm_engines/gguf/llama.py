"""A thin layer over llama-cpp-python's C API: one model, one generation context with a
KV stream of its own for each of up to ``n_seq_max`` sequences, an optional embeddings
context, tokenisation and metadata. ``llama_cpp`` is imported only in this package.

Three choices make a sequence's numerics independent of what shares its decode calls
(batch invariance, measured on SmolLM2-135M in Q4_0, Q4_1, Q4_K_M and Q8_0):

- **A KV stream per sequence** (``kv_unified = false``). In one unified cache a
  sequence's cells land wherever free cells are; once sequences have come and gone its
  later positions can sit in cells before its earlier ones, and attention then sums them
  in another order.
- **Flash attention** for f16 KV caches. llama.cpp's CPU kernel walks a query's own
  cells in order and skips masked ones, where the unfused path multiplies over every
  cell the call's longest sequence spans.
- **No repacked weight layouts** (``use_extra_bufts = false``). The CPU backend repacks
  some quantizations into layouts with a matrix kernel for calls of several rows and a
  vector kernel for one; for Q4_K on an AVX2 CPU the two round differently (measured:
  19 of 30 requests kept their solo tokens under churn with repacking, 30 without).

An f32 model keeps unfused f32 attention, because flash attention would compute it in
f16: its shared batches are not invariant (:attr:`LlamaModel.flash_attn` is False).

Two things still depend on what shares a call, and the engine's calls avoid both (see
``GGUFEngine._calls``): two prompts in one call change each other's numbers (0.62 in a
300-token prompt's logits on SmolLM2 Q4_1), and the CPU's flash attention splits a lone
query's keys over its threads once a call holds one sequence with 512 or more cells in
view (``use_split_kv_path``), a different order from the shared kernel. So each prompt
gets a call of its own beside other rows' single tokens, cut at the same positions as
alone, and a row past ``LONG_ROW`` positions decodes in a call of its own.
:meth:`LlamaModel.shares_exactly` checks a loaded file, bit for bit, in the ways the
engine shares calls, and the engine reports what it found.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from millm_core.api import InternalError

GGML_TYPE_F32 = 0
POOLING_MEAN = 1
FLASH_ATTN_DISABLED = 0
FLASH_ATTN_ENABLED = 1


@L.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log, dropped: it writes per-graph detail to stderr; millm logs what it
    does itself."""


L.llama_log_set(_quiet, ctypes.c_void_p(0))


class DecodeFailed(InternalError):
    code = "engine_error"


@dataclass(frozen=True)
class Piece:
    """One token of a decode call: its id, sequence, position and whether its logits
    (or embedding) are wanted."""

    token: int
    seq: int
    pos: int
    output: bool


def _meta(model: ctypes.c_void_p, key: str) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class FileFacts:
    """What a GGUF file's metadata says, read without loading its tensors: its
    ``general.file_type``, trained context, and the bytes one KV cell (one position of
    one sequence, every layer's keys and values) takes in an f16 cache (0 when the
    metadata does not say enough)."""

    file_type: int | None
    context: int
    cell_bytes: int


def file_facts(path: str) -> FileFacts:
    """Read :class:`FileFacts` from ``path`` (llama.cpp's vocab-only load: no tensors)."""
    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise InternalError(f"llama.cpp could not read {path!r}")
    try:
        arch = _meta(model, "general.architecture") or ""

        def number(key: str) -> int | None:
            value = _meta(model, f"{arch}.{key}")
            try:
                return int(value) if value is not None else None
            except ValueError:  # per-layer arrays and the like
                return None

        heads = number("attention.head_count") or 1
        kv_heads = number("attention.head_count_kv") or heads
        key_length = number("attention.key_length") or (number("embedding_length") or 0) // heads
        value_length = number("attention.value_length") or key_length
        file_type = _meta(model, "general.file_type")
        return FileFacts(
            file_type=int(file_type) if file_type and file_type.isdigit() else None,
            context=number("context_length") or 0,
            cell_bytes=(number("block_count") or 0) * kv_heads * (key_length + value_length) * 2,
        )
    finally:
        L.llama_model_free(model)


class LlamaModel:
    """The loaded GGUF file and its contexts."""

    def __init__(
        self, path: str, *, n_ctx: int, n_seq_max: int, threads: int | None, f32_kv: bool, n_batch: int = 512, flash_attn: bool = True
    ) -> None:
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.use_extra_bufts = False  # see the module docstring
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise InternalError(f"llama.cpp could not load {path!r}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_batch = n_batch  # a prompt's pieces per call
        # A call carries one prompt's n_batch pieces and, beside them, one token of each
        # other sequence.
        self.call_capacity = n_batch + n_seq_max - 1
        self.threads = threads
        self.f32_kv = f32_kv
        # f32 attention stays unfused (flash attention would run it in f16); see above.
        self.flash_attn = flash_attn and not f32_kv
        self.ctx = self._context(n_ctx=n_ctx, n_seq_max=n_seq_max, embeddings=False)
        self.memory = L.llama_get_memory(self.ctx)
        self._embed_ctx: ctypes.c_void_p | None = None
        self._batch = L.llama_batch_init(self.call_capacity, 0, 1)

    def _context(self, *, n_ctx: int, n_seq_max: int, embeddings: bool) -> ctypes.c_void_p:
        params = L.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = self.call_capacity
        params.n_ubatch = self.call_capacity
        params.n_seq_max = n_seq_max
        params.kv_unified = False  # a KV stream per sequence: n_ctx / n_seq_max cells each
        if self.threads:
            params.n_threads = self.threads
            params.n_threads_batch = self.threads
        if self.f32_kv:  # an f32 model keeps f32 attention: f16 state (or flash attention's f16 path) costs ~1e-2 in the logits
            params.type_k = GGML_TYPE_F32
            params.type_v = GGML_TYPE_F32
        params.flash_attn_type = FLASH_ATTN_ENABLED if self.flash_attn else FLASH_ATTN_DISABLED
        params.embeddings = embeddings
        if embeddings:
            params.pooling_type = POOLING_MEAN
        ctx = L.llama_init_from_model(self.model, params)
        if not ctx:
            raise InternalError("llama.cpp could not create a context")
        return ctx

    # ------------------------------------------------------------------ metadata

    def meta(self, key: str) -> str | None:
        return _meta(self.model, key)

    def chat_template(self) -> str | None:
        raw = L.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    @property
    def n_ctx_train(self) -> int:
        return int(L.llama_model_n_ctx_train(self.model))

    @property
    def n_embd(self) -> int:
        return int(L.llama_model_n_embd(self.model))

    @property
    def n_layer(self) -> int:
        return int(L.llama_model_n_layer(self.model))

    @property
    def n_cells(self) -> int:
        """KV cells over all sequences' streams."""
        return int(L.llama_n_ctx(self.ctx))

    def special(self, name: str) -> int | None:
        token = int(getattr(L, f"llama_vocab_{name}")(self.vocab))
        return token if token >= 0 else None

    def add_bos(self) -> bool:
        return bool(L.llama_vocab_get_add_bos(self.vocab))

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (L.llama_token * capacity)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (L.llama_token * capacity)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    # ------------------------------------------------------------------ compute

    def decode(self, pieces: Sequence[Piece]) -> list[np.ndarray]:
        """Run ``pieces`` (at most ``call_capacity``) and return the logits of each output piece,
        in order (float32 copies)."""
        self._fill(pieces)
        status = L.llama_decode(self.ctx, self._batch)
        if status != 0:
            raise DecodeFailed(f"llama_decode failed with status {status} ({len(pieces)} tokens)")
        out: list[np.ndarray] = []
        for index, piece in enumerate(pieces):
            if piece.output:
                pointer = L.llama_get_logits_ith(self.ctx, index)
                out.append(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy())
        return out

    def _fill(self, pieces: Sequence[Piece]) -> None:
        assert 0 < len(pieces) <= self.call_capacity
        batch = self._batch
        batch.n_tokens = len(pieces)
        for i, piece in enumerate(pieces):
            batch.token[i] = piece.token
            batch.pos[i] = piece.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = piece.seq
            batch.logits[i] = 1 if piece.output else 0

    def shares_exactly(self) -> bool:
        """Whether one sequence's logits are bit for bit the same alone and sharing decode
        calls the way the engine shares them (a prompt beside other rows' single tokens,
        cut where another row's token fills the call, several rows' logits per call),
        against the same tokens alone. Uses sequences 0 to 2 (0 and 1 with two) of an idle
        context and leaves them empty."""
        n_seq = int(L.llama_n_seq_max(self.ctx))
        if n_seq < 2:
            return True  # nothing ever shares a call
        ids = [(97 * i + 13) % self.n_vocab for i in range(60)]
        a, b, c = ids[:40], ids[40:47], ids[47:60]

        def run(tokens: list[int], seq: int, start: int = 0, output: bool = True) -> list[Piece]:
            return [Piece(t, seq, start + p, output and p == len(tokens) - 1) for p, t in enumerate(tokens)]

        try:
            alone = [self.decode(run(a, 0))[0]]
            follow = [int(np.argmax(alone[0])), int(np.argmax(alone[0][::-1]))]  # any two tokens, fixed
            for step, token in enumerate(follow):
                alone.append(self.decode([Piece(token, 0, len(a) + step, True)])[0])
            self.forget(0)
            self.decode(run(b, 1))
            self.decode([Piece(b[0], 1, len(b), False), *run(a[:9], 0, output=False)])  # a's prompt cut at 9
            shared = [self.decode([Piece(b[1], 1, len(b) + 1, True), *run(a[9:], 0, start=9)])[-1]]
            joining = run(c, 2) if n_seq > 2 else []
            shared.append(self.decode([Piece(follow[0], 0, len(a), True), *joining])[0])
            rows = [Piece(follow[1], 0, len(a) + 1, True), Piece(b[2], 1, len(b) + 2, True)]
            if joining:
                rows.append(Piece(follow[1], 2, len(c), True))
            shared.append(self.decode(rows)[0])
        finally:
            for seq in range(min(n_seq, 3)):
                self.forget(seq)
        return all(np.array_equal(x, y, equal_nan=True) for x, y in zip(alone, shared, strict=True))

    def forget(self, seq: int) -> None:
        """Free every KV cell of sequence ``seq``."""
        L.llama_memory_seq_rm(self.memory, seq, -1, -1)

    def forget_from(self, seq: int, pos: int) -> bool:
        """Free sequence ``seq``'s KV cells at positions ``pos`` and later. False when what
        is left is not the sequence's positions ``0 .. pos - 1``: a recurrent state cannot
        drop part of a sequence, and a sliding-window cache has already dropped its start
        (the caller then frees the whole sequence and runs it again)."""
        if not L.llama_memory_seq_rm(self.memory, seq, pos, -1):
            return False
        return pos == 0 or int(L.llama_memory_seq_pos_min(self.memory, seq)) == 0

    def prefix_refusal(self) -> str | None:
        """Why a saved sequence cannot stand in for a prompt's beginning on this model
        (None: it can): a recurrent state holds no per-position cells to cut back, and a
        sliding window has already dropped a long prompt's start."""
        if L.llama_model_is_recurrent(self.model):
            return "the model is recurrent"
        if int(L.llama_model_n_swa(self.model)) > 0:
            return "the model attends through a sliding window"
        return None

    def save(self, seq: int) -> bytes:
        """Sequence ``seq``'s state (its KV cells), byte for byte."""
        size = int(L.llama_state_seq_get_size(self.ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(L.llama_state_seq_get_data(self.ctx, buf, size, seq))
        return bytes(buf[:written])

    def restore(self, seq: int, state: bytes, keep: int) -> bool:
        """Load a state saved by :meth:`save` into the empty sequence ``seq`` and keep its
        positions ``0 .. keep - 1``. False (the sequence left empty) when that is not
        what the sequence then holds."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(L.llama_state_seq_set_data(self.ctx, buf, len(state), seq)) != len(state) or not self.forget_from(seq, keep):
            self.forget(seq)
            return False
        if int(L.llama_memory_seq_pos_max(self.memory, seq)) != keep - 1:
            self.forget(seq)
            return False
        return True

    def embed(self, ids: Sequence[int], n_ctx: int) -> np.ndarray:
        """The mean of the last hidden states over ``ids`` (llama.cpp's MEAN pooling), in a
        separate context whose one batch holds a whole input of up to ``n_ctx`` tokens."""
        if self._embed_ctx is None:
            saved = self.call_capacity
            self.call_capacity = n_ctx
            try:
                self._embed_ctx = self._context(n_ctx=n_ctx, n_seq_max=1, embeddings=True)
            finally:
                self.call_capacity = saved
        ctx = self._embed_ctx
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        batch = L.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for pos, token in enumerate(ids):
                batch.token[pos], batch.pos[pos], batch.n_seq_id[pos], batch.logits[pos] = token, pos, 1, 1
                batch.seq_id[pos][0] = 0
            if L.llama_decode(ctx, batch) != 0:
                raise DecodeFailed("llama_decode failed while embedding")
        finally:
            L.llama_batch_free(batch)
        pointer = L.llama_get_embeddings_seq(ctx, 0)
        return np.ctypeslib.as_array(pointer, shape=(self.n_embd,)).copy()

    def close(self) -> None:
        L.llama_batch_free(self._batch)
        if self._embed_ctx is not None:
            L.llama_free(self._embed_ctx)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
