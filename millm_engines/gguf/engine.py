"""The GGUF engine: llama.cpp through its batch API.

Every row is one llama.cpp sequence with a KV stream of its own. A step sends
one ``llama_decode`` call (more when prefill exceeds the batch size) carrying the
prompts of rows that have not run yet and the last token of every other row, reads the
logits of each row's last position and samples them in numpy. Rows of later requests can
join a running batch (:meth:`GGUFEngine.join`): the scheduler uses that to serve
concurrent streams together, which is where a batch API beats a serial server. A row's
tokens do not depend on what shares its calls where :attr:`GGUFEngine.batch_invariant`
holds (see :mod:`.llama`).

A prompt runs in calls that end at the multiples of ``prefix.CHUNK``, and where the
engine is batch-invariant (one sequence at a time, or shared batches that passed the
load-time check) its beginning can be restored from an earlier prompt's saved state, into
whichever sequence the row has (prefix reuse, see :mod:`.prefix`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from millm_core.api import (
    Capability,
    Capacity,
    CapacityExceeded,
    ChatTemplateRefused,
    InvalidRequest,
    ModelInfo,
    NonFiniteLogits,
    RowsFailed,
    RowSpec,
    SamplingParams,
    generic_chat_text,
    refuse_tools_without_template,
    render_with_continuation,
)

from .llama import LlamaModel, Piece
from .prefix import CHUNK, StateCache
from .sampler import sample_row

# From this position on a row decodes in a call of its own: with 257 cells or more, alone
# in a call, llama.cpp's CPU flash attention (``use_split_kv_path``: one query, one
# sequence, 512 keys or more in view, the view padded to 256 cells) sums its keys in
# per-thread chunks, where beside other sequences it sums them in one pass.
LONG_ROW = 256


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@dataclass
class Row:
    seq: int
    tokens: list[int]
    sampling: SamplingParams
    n_past: int = 0  # tokens already in the KV cache
    prompt_len: int = 0
    resumed: int = 0  # prompt tokens restored from the prefix cache (see .prefix)


@dataclass
class GGUFBatch:
    rows: list[Row] = field(default_factory=list)


class GGUFEngine:
    """A loaded GGUF model serving up to ``parallel`` sequences at once."""

    def __init__(
        self,
        llm: LlamaModel,
        info: ModelInfo,
        capabilities: frozenset[Capability],
        parallel: int,
        refusals: Mapping[Capability, str],
        chat_template: str | None = None,
        prefix: StateCache | None = None,
        shares_exactly: bool = True,
    ) -> None:
        self.llm = llm
        self.info = info
        self.capabilities = capabilities
        self.refusals = dict(refusals)  # why a capability is missing, for the error message
        self.parallel = parallel
        self._shares_exactly = shares_exactly  # LlamaModel.shares_exactly, checked at load
        # Every prompt runs in calls ending at the multiples of CHUNK, resumed or not, which
        # makes its whole chunks reusable exactly (see .prefix) where a row's numbers do not
        # depend on the rows beside it; elsewhere nothing is kept.
        self.prefix = prefix if self.batch_invariant else None
        self._free_seqs = list(range(parallel))
        # Each sequence's stream holds this many cells: a row's prompt and budget must fit.
        self.cells_per_seq = llm.n_cells // parallel
        eos = {t for t in (llm.special("eos"), llm.special("eot")) if t is not None}
        self.eos_token_ids = frozenset(t for t in range(llm.n_vocab) if llm.is_eog(t)) | eos
        self._bos = llm.special("bos")
        self._bos_text = llm.piece(self._bos, special=True).decode("utf-8", errors="replace") if self._bos is not None else ""
        # The operator's --chat-template, else the one the file embeds.
        self.chat_template: str | None = chat_template or llm.chat_template() or None

    # ------------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.llm.tokenize(text, add_special=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.llm.piece(t, special=False) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.llm.piece(token_id, special=True).decode("utf-8", errors="replace")

    def chat_text(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The chat rendered with the file's embedded template (the fallback format
        without one), ready for the assistant; a trailing assistant message continues.
        ``tools`` are given to the template as its ``tools`` variable, ``template_kwargs``
        (a request's ``chat_template_kwargs``) as variables of their own."""
        if not self.chat_template:
            refuse_tools_without_template(messages, tools)
        return render_with_continuation(lambda head: self._render(head, tools, template_kwargs or {}), messages)

    def _render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any]) -> str:
        if not self.chat_template:
            return generic_chat_text(messages)
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ChatTemplateRefused(f"the model's chat template refused the messages: {message}", param="messages")

        env.globals["raise_exception"] = raise_exception
        # As transformers renders templates: tojson keeps key order and non-ASCII text,
        # and takes the same keyword arguments; strftime_now gives the date.
        env.filters["tojson"] = _tojson
        env.globals["strftime_now"] = _strftime_now
        eos = self.llm.special("eos")
        try:
            extra: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools is not None else {}
            return env.from_string(self.chat_template).render(
                **template_kwargs,
                messages=[dict(m) for m in messages],
                **extra,
                add_generation_prompt=True,
                bos_token=self._bos_text,
                eos_token=self.token_text(eos) if eos is not None else "",
            )
        except TemplateError as exc:  # a template that cannot render these messages
            raise ChatTemplateRefused(f"the model's chat template refused the messages: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateRefused(
                f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from exc

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], /, *, tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any
    ) -> list[int]:
        """The BOS rule: a render that begins with the BOS text gets no second BOS;
        otherwise the model's own add-BOS rule applies."""
        text = self.chat_text(messages, tools, template_kwargs)
        own_bos = bool(self._bos_text) and text.startswith(self._bos_text)
        return self.llm.tokenize(text, add_special=not own_bos)

    # ------------------------------------------------------------------ batches

    @property
    def batches_requests(self) -> bool:
        """Whether concurrent requests share decode calls: with more than one sequence."""
        return self.parallel > 1

    @property
    def batch_invariant(self) -> bool:
        """Per-sequence KV streams with flash attention are (see :mod:`.llama`) where the
        file's kernels passed the load-time check; f32 attention, unfused, is only with
        one sequence at a time."""
        return self.parallel == 1 or (self.llm.flash_attn and self._shares_exactly)

    @staticmethod
    def _need(spec: RowSpec) -> int:
        return len(spec.prompt_ids) + max(spec.max_new_tokens, 1)

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        """Whether ``rows`` fit now: a free sequence each, whose stream holds the row's
        prompt and budget."""
        return len(rows) <= len(self._free_seqs) and all(self._need(r) <= self.cells_per_seq for r in rows)

    @property
    def capacity(self) -> Capacity:
        """Sequences and KV cells: admission refuses a request that could never fit (a
        single row longer than its stream is already past the served context length)."""
        return Capacity(max_rows=self.parallel, max_tokens=self.cells_per_seq * self.parallel)

    def open_batch(self, rows: Sequence[RowSpec]) -> GGUFBatch:
        # Admission already refused what cannot fit (before a stream's 200); kept as a guard.
        if len(rows) > self.parallel:
            raise CapacityExceeded(f"{len(rows)} sequences at once; this GGUF engine runs at most {self.parallel}", param="prompt")
        need = max((self._need(r) for r in rows), default=0)
        if need > self.cells_per_seq:
            raise CapacityExceeded(
                f"a prompt and its token budget need {need} KV cells; each sequence of this GGUF engine holds {self.cells_per_seq}",
                param="prompt",
            )
        batch = GGUFBatch()
        self.join(batch, rows)
        return batch

    def join(self, batch: GGUFBatch, rows: Sequence[RowSpec]) -> None:
        """Add rows to a running batch; their prompts run in the next step. Checked before
        anything changes, so a refused join leaves the running batch as it was."""
        if len(rows) > len(self._free_seqs):
            raise CapacityExceeded(
                f"{len(rows)} more sequences do not fit beside the running ones ({len(self._free_seqs)} free)", param="prompt"
            )
        longest = max((self._need(r) for r in rows), default=0)
        if longest > self.cells_per_seq:
            raise CapacityExceeded(f"a row needs {longest} KV cells; a sequence holds {self.cells_per_seq}", param="prompt")
        for spec in rows:
            seq = self._free_seqs.pop(0)
            self.llm.forget(seq)
            batch.rows.append(Row(seq=seq, tokens=list(spec.prompt_ids), sampling=spec.sampling, prompt_len=len(spec.prompt_ids)))

    def resumed(self, batch: GGUFBatch) -> list[int]:
        """Per row, the prompt tokens its prefill restored from the prefix cache (0: none)."""
        return [row.resumed for row in batch.rows]

    def _resume(self, row: Row) -> None:
        """Before a row's prefill: restore the longest whole-chunk beginning of its prompt
        the prefix cache holds (into the row's own sequence, whichever sequence saved it)."""
        assert self.prefix is not None
        found = self.prefix.lookup(row.tokens[: row.prompt_len])
        row.resumed = 0
        if found is not None and self.llm.restore(row.seq, found[1], found[0]):
            row.n_past = row.resumed = found[0]

    def _save(self, rows: Sequence[Row], call: Sequence[Piece]) -> None:
        """After a call: keep the state of a row whose prompt's last whole chunk it ended
        (only a prompt's own pieces end a chunk: a row's single token never does)."""
        assert self.prefix is not None
        ends = {piece.seq: piece.pos for piece in call}
        for row in rows:
            whole = row.prompt_len // CHUNK * CHUNK
            if whole and ends.get(row.seq) == whole - 1 and whole > row.resumed and not self.prefix.holds(row.tokens[:whole]):
                self.prefix.store(row.tokens[:whole], self.llm.save(row.seq))

    @staticmethod
    def _pending(row: Row) -> list[Piece]:
        """The row's tokens not yet in its KV cells; the last one's logits are wanted."""
        pending = row.tokens[row.n_past :]
        return [Piece(token=t, seq=row.seq, pos=row.n_past + i, output=i == len(pending) - 1) for i, t in enumerate(pending)]

    @staticmethod
    def _chunks(pieces: Sequence[Piece]) -> list[list[Piece]]:
        """One prompt's pieces cut at the multiples of CHUNK positions."""
        calls: list[list[Piece]] = []
        for piece in pieces:
            if not calls or piece.pos % CHUNK == 0:
                calls.append([])
            calls[-1].append(piece)
        return calls

    def _forward(self, rows: Sequence[Row]) -> dict[int, np.ndarray]:
        """Run every row's pending tokens; the logits of each row's last one, by sequence.
        The calls make every row's numbers those it gets alone (see :mod:`.llama`):

        - a row's prompt (several pieces) runs in calls ending at the multiples of CHUNK
          positions, as it would alone and whether it resumed or not, and shares a call
          only with other rows' single tokens (the first one), never with another prompt;
        - a row decoding at position ``LONG_ROW`` or later has a call of its own (alone,
          llama.cpp's CPU flash attention splits its keys over threads);
        - the other rows' single tokens share one call.

        Prompts run in row order, each restored from the prefix cache just before its
        calls, so a row can resume what an earlier row of the same step saved (a
        request's ``n`` rows, or two requests with one system prompt)."""
        out: dict[int, np.ndarray] = {}

        def run(call: list[Piece]) -> None:
            outputs = [piece.seq for piece in call if piece.output]
            out.update(zip(outputs, self.llm.decode(call), strict=True))
            if self.prefix is not None:
                self._save(rows, call)

        shared: list[Piece] | None = []  # None once it has run beside a prompt's first chunk
        own: list[list[Piece]] = []

        def single(piece: Piece) -> None:
            if piece.pos >= LONG_ROW:
                own.append([piece])
            elif shared is not None:
                shared.append(piece)
            else:  # below LONG_ROW a token alone gets what it gets beside others
                own.append([piece])

        prompts: list[Row] = []
        for row in rows:
            if len(row.tokens) - row.n_past > 1:
                prompts.append(row)
            else:
                single(self._pending(row)[0])
        for row in prompts:
            if self.prefix is not None and row.n_past == 0 and len(row.tokens) == row.prompt_len:
                self._resume(row)
            pieces = self._pending(row)
            if len(pieces) == 1:  # resumed up to its last token
                single(pieces[0])
                continue
            calls = self._chunks(pieces)
            if shared is not None:
                calls[0] = shared + calls[0]
                shared = None
            for call in calls:
                run(call)
        if shared:
            run(shared)
        for call in own:
            run(call)
        return out

    def step(self, batch: GGUFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None = None) -> list[int]:
        return self._draw(batch, 0, biases, allowed)

    def first_tokens(
        self, batch: GGUFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None = None
    ) -> list[int]:
        """The first tokens of the rows joined since the last step (the batch's last
        ``len(biases)`` rows), drawn now (:class:`~millm_core.engine.EagerJoin`): their
        prompts run in calls of their own, which is what each row computes alone."""
        return self._draw(batch, len(batch.rows) - len(biases), biases, allowed)

    def _draw(self, batch: GGUFBatch, first: int, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None) -> list[int]:
        """Run and draw the next token of the rows from position ``first`` on (0: every row)."""
        rows = batch.rows[first:]
        by_seq = self._forward(rows)
        out: list[int] = []
        broken: dict[int, BaseException] = {}
        masks: Sequence[Any] = allowed if allowed is not None else [None] * len(rows)
        for index, (row, bias, mask) in enumerate(zip(rows, biases, masks, strict=True), start=first):
            row_logits = by_seq[row.seq]
            row.n_past = len(row.tokens)
            if not np.isfinite(row_logits).all():  # this row fails alone
                broken[index] = NonFiniteLogits(f"row {index}'s logits are not finite (NaN or inf) at this step")
                token = 0
            else:
                token = sample_row(row_logits, row.sampling, len(row.tokens), bias, mask)
            row.tokens.append(token)
            out.append(token)
        if broken:
            raise RowsFailed(out, broken)
        return out

    def retain(self, batch: GGUFBatch, keep: Sequence[int]) -> None:
        kept = set(keep)
        for index, row in enumerate(batch.rows):
            if index not in kept:
                self._release(row)
        batch.rows = [batch.rows[i] for i in keep]

    def rewind(self, batch: GGUFBatch, row: int, k: int) -> None:
        """Take back row ``row``'s last ``k`` draws, as if never drawn: the sequence's KV
        cells from the re-fed token's position on are freed and the next step feeds that
        token there. Back to the prompt (``k == n``) the whole prompt runs again in the
        calls the prefill ran (restored from the prefix cache where it can): fed alone, its
        last token's logits would differ from the prefill's by rounding. A cache that
        cannot keep the sequence's start (recurrent state, sliding window) runs the prompt
        and the kept draws again."""
        if not 0 <= row < len(batch.rows):
            raise ValueError(f"row {row} is not in the batch ({len(batch.rows)} rows)")
        state = batch.rows[row]
        n = len(state.tokens) - state.prompt_len
        if not 1 <= k <= n:
            raise ValueError(f"row {row} drew {n} tokens: rewind takes back 1 to {n} of them, not {k}")
        del state.tokens[-k:]
        keep = len(state.tokens) - 1 if k < n else 0  # cache positions kept: all but the re-fed token
        if not self.llm.forget_from(state.seq, keep):
            self.llm.forget(state.seq)
            keep = 0
        state.n_past = keep

    def close(self, batch: GGUFBatch) -> None:
        for row in batch.rows:
            self._release(row)
        batch.rows = []

    def _release(self, row: Row) -> None:
        self.llm.forget(row.seq)
        self._free_seqs.append(row.seq)
        self._free_seqs.sort()

    # ------------------------------------------------------------------ embeddings

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str) -> list[list[float]]:
        """Mean of the last hidden states per input (the only pooling llama.cpp gives
        this engine); millm applies ``normalize`` afterwards."""
        if pooling != "mean":
            raise InvalidRequest(
                f"pooling {pooling!r} is not available on GGUF models; only mean", code="field_not_honoured", param="pooling"
            )
        return [self.llm.embed(ids, self.info.context_length).astype(np.float32).tolist() for ids in inputs]
