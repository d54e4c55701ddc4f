"""The transformers engine: prefill then cached decode over a batch of rows.

Each row is prefilled as it would be alone (see :mod:`.prefill`: where exact, the prompts
of requests joining together share the lean prefill's passes); the rows' KV caches are
then right-aligned, so that every row's next token sits in the last column, and a batch
without padding passes no attention mask at all (the causal fast path). Finished rows are
dropped from the KV cache between steps. A row's prefill runs in chunks, resumed from the
prefix cache where it can (see :mod:`.prefix`). Rows attend over their own cache columns
only: on the lean step by construction, on the generic HF forward through the attention
function of :mod:`.rows`. Rows of other requests join a running batch on both paths: on
the generic HF forward when the model's cache layers are plain key/value tensors (see
:mod:`.generic`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from millm_core.api import Capability, ModelInfo, NonFiniteLogits, OutOfMemory, Readout, RowsFailed, RowSpec

from .batch import HFBatch
from .chat import render_chat_ids
from .fastpath import KVCache, LlamaDecoder
from .forward import embed, last_logits, residuals
from .fp32 import Float32Copies
from .generic import cache_length, join_refusal, merge_caches
from .leanprefill import build as build_lean_prefill
from .memory import available_bytes, shortfall
from .plugin import CAPABILITIES  # declared once, before any load
from .prefill import prefill, prefill_all
from .prefix import PrefixCache, rope_refusal
from .rewind import refeed_prompt_ends, refusal, rewind, select
from .rows import install as install_rows_attention
from .sampler import apply_biases, apply_masks, sample
from .taps import Captured, TapSet, block_hook, readouts


def _non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows whose logits hold a NaN or ±inf. A row's sum is finite only if all its logits
    are, so one sum per row clears them (a twentieth of an elementwise check over a 49k
    vocabulary); a row whose sum is not finite (a NaN, an inf, or finite logits so large
    their sum overflows) is checked element by element."""
    suspect = (~torch.isfinite(logits.sum(dim=-1))).nonzero().flatten().tolist()
    return [row for row in suspect if not bool(torch.isfinite(logits[row]).all())]


class TransformersEngine:
    """An :class:`~millm_core.engine.Engine` over a transformers causal LM, also
    :class:`~millm_core.engine.Joinable`: rows of other requests join a running batch,
    their prompts prefilled as alone beside the others' decode steps — on the lean decode
    step always, on the generic HF forward when the model's cache can be merged
    (``join_refusal`` says why not, decided at load). Also
    :class:`~millm_core.engine.JoinTogether`: requests joining at once share the lean
    prefill's passes where a load-time check finds that exact (``lean`` is then set;
    ``lean_refusal`` says why not)."""

    capabilities = CAPABILITIES
    max_rows = 16  # rows one joined batch may hold

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        info: ModelInfo,
        eos_token_ids: frozenset[int],
        fast: LlamaDecoder | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.model = model
        self.fast = fast
        self._fp32 = Float32Copies()
        self.tokenizer = tokenizer
        self.info = info
        self.eos_token_ids = eos_token_ids
        # Sampling values the model's generation_config.json states (set by the loader).
        self.generation_defaults: dict[str, float] = {}
        self.device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else next(iter(eos_token_ids), 0))
        self._rows = 0  # rows in the open batch (the scheduler runs one at a time)
        # The lean decode step's cache can always take tokens back; HF's, per layer type.
        cannot = None if fast is not None else refusal(model.config)
        # Whether rows of other requests can join a running batch (None: they can).
        self.join_refusal: str | None = None if fast is not None else join_refusal(model)
        # Prompts' KV blocks for prefix reuse, wherever each row is prefilled alone in fixed
        # chunks (see .prefix): the lean decode step, and the generic forward of a model
        # whose cache can be merged (a serial model prefills a request's rows together);
        # not where the rotary embedding keeps state of its own. None: reuse is on.
        self.prefix_refusal: str | None = (
            "the prefix cache is off"
            if prefix is None
            else f"rows cannot join batches ({self.join_refusal})"
            if self.join_refusal is not None
            else rope_refusal(model.config)
        )
        self.prefix = prefix if self.prefix_refusal is None else None
        # On the generic forward, why a row cannot attend over its own columns alone (None:
        # it does, see .rows); the lean decode step always does.
        self.rows_refusal: str | None = None if fast is not None else install_rows_attention(model)
        # Prompts prefilled together where that is exact (see .leanprefill; None: why not).
        self.lean, self.lean_refusal = build_lean_prefill(fast) if fast is not None else (None, "the lean decode step is off")
        self.refusals: dict[Capability, str] = {}
        if cannot:
            self.capabilities = CAPABILITIES - {Capability.REWIND}
            self.refusals[Capability.REWIND] = cannot

    # ------------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], /, *, tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any
    ) -> list[int]:
        return render_chat_ids(self.tokenizer, messages, template_kwargs, tools)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source chats are rendered with (the operator's ``--chat-template``
        replaces the model's own at load)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) and template else None

    # ------------------------------------------------------------------ memory

    memory_probe: Callable[[torch.device], int] = staticmethod(available_bytes)  # replaceable in tests

    def memory_shortfall(
        self, prompt_lengths: Sequence[int], max_new_tokens: int, *, admitted: Sequence[tuple[int, int]] = ()
    ) -> str | None:
        """Why rows of these lengths would not fit in the memory free now beside the rows
        admitted before them (None: they fit)."""
        dtype = next(self.model.parameters()).dtype
        return shortfall(self.model.config, dtype, self.device, prompt_lengths, max_new_tokens, probe=self.memory_probe, admitted=admitted)

    # ------------------------------------------------------------------ batches

    def open_batch(self, rows: Sequence[RowSpec]) -> HFBatch:
        self._rows = len(rows)
        return self._new_batch(rows)

    def _new_batch(self, rows: Sequence[RowSpec]) -> HFBatch:
        batch = HFBatch(
            prompts=[r.prompt_ids for r in rows],
            params=[r.sampling for r in rows],
            row_taps=[r.taps for r in rows],
            drawn=[[] for _ in rows],
            resumed=[0] * len(rows),
        )
        batch.taps = TapSet.build(batch.row_taps, self.device, self.info.n_layers)
        layers = sorted({layer for r in rows for layer in r.deltas})
        if layers:
            dtype = next(self.model.parameters()).dtype
            batch.deltas = {}
            for layer in layers:
                if not 0 <= layer < self.info.n_layers:
                    raise ValueError(f"steering layer {layer} is outside 0..{self.info.n_layers - 1}")
                stacked = torch.zeros((len(rows), self.info.d_model), dtype=dtype, device=self.device)
                for r, row in enumerate(rows):
                    if layer in row.deltas:
                        stacked[r] = torch.tensor(row.deltas[layer], dtype=dtype)
                batch.deltas[layer] = stacked
        return batch

    @torch.inference_mode()
    def step(self, batch: HFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None = None) -> list[int]:
        try:
            return self._step(batch, biases, allowed)
        except (torch.OutOfMemoryError, MemoryError) as exc:  # admission estimated wrong, or memory went elsewhere
            raise OutOfMemory(f"the {self.device} device ran out of memory during a decode step; retry, or ask for fewer tokens") from exc

    def _step(self, batch: HFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None) -> list[int]:
        if not batch.started:
            batch.started = True
            logits = prefill(self, batch)
            batch.first_logits = list(logits.clone().unbind(0))  # the sampling below changes ``logits`` in place
        else:
            logits = self._decode(batch)
        joining, batch.joining = batch.joining, []
        if joining and (batch.reads is not None or any(sub.reads is not None for sub in joining)):
            reads = batch.reads if batch.reads is not None else [None] * batch.size
            batch.reads = reads + [r for sub in joining for r in (sub.reads if sub.reads is not None else [None] * sub.size)]
        for sub in joining:  # each joined request's prompts, prefilled on their own at join
            assert sub.prefilled is not None
            logits = torch.cat([logits, sub.prefilled])
            sub.prefilled = None
            self._merge(batch, sub)
        return self._draw(batch, logits, biases, allowed, 0)

    @torch.inference_mode()
    def first_tokens(self, batch: HFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None = None) -> list[int]:
        """The first tokens of the rows joined since the last step, drawn now from the
        logits their prefill in :meth:`join` left (:class:`~millm_core.engine.EagerJoin`);
        the rows are merged into the batch and the next step feeds them these tokens."""
        try:
            return self._first_tokens(batch, biases, allowed)
        except (torch.OutOfMemoryError, MemoryError) as exc:  # merging the joined caches allocates
            raise OutOfMemory(f"the {self.device} device ran out of memory merging joined rows into the running batch; retry") from exc

    def _first_tokens(self, batch: HFBatch, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None) -> list[int]:
        if not batch.started:
            raise RuntimeError("first_tokens before the batch's first step: its own prefill has not run")
        joining, batch.joining = batch.joining, []
        first = batch.size
        if batch.taps is not None or any(sub.reads is not None for sub in joining):
            # Only the joined prompts were read now; the running rows' last reads were handed over.
            none: list[Readout | None] = [None] * first
            batch.reads = none + [r for sub in joining for r in (sub.reads if sub.reads is not None else [None] * sub.size)]
        parts = []
        for sub in joining:
            assert sub.prefilled is not None
            parts.append(sub.prefilled)
            sub.prefilled = None
            self._merge(batch, sub)
        return self._draw(batch, torch.cat(parts), biases, allowed, first)

    def _draw(
        self, batch: HFBatch, logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None], allowed: Sequence[Any] | None, first: int
    ) -> list[int]:
        """Draw the next token of the rows from position ``first`` on (0: every row) from
        their ``logits``; rows whose logits are not finite fail alone."""
        logits = logits.float()
        broken = _non_finite_rows(logits)
        if broken:  # those rows fail alone; the others are sampled as usual
            logits[broken] = 0.0
        if any(biases):
            apply_biases(logits, biases)
        if allowed is not None:
            apply_masks(logits, allowed)
        assert batch.draw_pos is not None
        tokens = sample(logits, batch.params[first:], batch.draw_pos[first:])
        drawn = torch.tensor(tokens, dtype=torch.long, device=self.device)
        batch.last_tokens = drawn if first == 0 or batch.last_tokens is None else torch.cat([batch.last_tokens, drawn])
        for row, token in zip(batch.drawn[first:], tokens, strict=True):
            row.append(token)
        batch.draw_pos = batch.draw_pos[:first] + [p + 1 for p in batch.draw_pos[first:]]
        if broken:
            raise RowsFailed(
                tokens,
                {first + row: NonFiniteLogits(f"row {first + row}'s logits are not finite (NaN or inf) at this step") for row in broken},
            )
        return tokens

    @contextlib.contextmanager
    def _block_hooks(self, batch: HFBatch, captured: Captured) -> Iterator[None]:
        """Forward hooks adding each row's delta to the hooked blocks' outputs and reading
        the tapped rows into ``captured``, for the duration of one HF forward. Nothing
        outlives the call."""
        deltas = batch.deltas or {}
        reads = batch.taps.by_layer if batch.taps is not None else {}
        if not deltas and not reads:
            yield
            return
        layers = self.model.model.layers
        handles = [
            layers[layer].register_forward_hook(block_hook(layer, deltas.get(layer), reads, captured))
            for layer in sorted(set(deltas) | set(reads))
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _merge(self, batch: HFBatch, sub: HFBatch) -> None:
        """Append a freshly prefilled ``sub`` to a running ``batch``: KV caches (the lean
        step's or HF's plain ``DynamicCache``) and masks right-aligned to the longer one,
        positions and deltas per row."""
        assert batch.next_pos is not None and sub.next_pos is not None
        ra, rb = batch.size, sub.size
        if batch.kv is not None:
            assert sub.kv is not None
            la, lb = batch.kv.length, sub.kv.length
        else:
            assert batch.cache is not None and sub.cache is not None
            la, lb = cache_length(batch.cache), cache_length(sub.cache)
        length = max(la, lb)
        if batch.mask is not None or sub.mask is not None or la != lb:
            mask = torch.zeros((ra + rb, length), dtype=torch.long, device=self.device)
            mask[:ra, length - la :] = batch.mask if batch.mask is not None else 1
            mask[ra:, length - lb :] = sub.mask if sub.mask is not None else 1
            batch.mask = mask
        if batch.kv is not None:
            assert sub.kv is not None
            batch.kv = KVCache.merge(batch.kv, sub.kv)
        else:
            assert batch.cache is not None and sub.cache is not None
            merge_caches(batch.cache, sub.cache)
            sub.cache = None
        batch.next_pos = torch.cat([batch.next_pos, sub.next_pos])
        assert batch.draw_pos is not None and sub.draw_pos is not None
        batch.draw_pos = batch.draw_pos + sub.draw_pos
        batch.prompts += sub.prompts
        batch.params += sub.params
        batch.drawn += sub.drawn
        batch.resumed += sub.resumed
        batch.first_logits += sub.first_logits
        batch.row_taps += sub.row_taps
        if batch.taps is not None or sub.taps is not None:
            batch.taps = TapSet.build(batch.row_taps, self.device, self.info.n_layers)
        if batch.deltas or sub.deltas:
            layers = set(batch.deltas or {}) | set(sub.deltas or {})
            dtype = next(self.model.parameters()).dtype

            def rows_of(deltas: dict[int, torch.Tensor] | None, layer: int, count: int) -> torch.Tensor:
                if deltas and layer in deltas:
                    return deltas[layer]
                return torch.zeros((count, self.info.d_model), dtype=dtype, device=self.device)

            batch.deltas = {layer: torch.cat([rows_of(batch.deltas, layer, ra), rows_of(sub.deltas, layer, rb)]) for layer in layers}

    # ------------------------------------------------------------------ joining

    def readouts(self, batch: HFBatch) -> list[Readout | None]:
        """The tapped rows' vectors from the step just run (joined rows' prompts included)."""
        return batch.reads if batch.reads is not None else [None] * batch.size

    def resumed(self, batch: HFBatch) -> list[int]:
        """Per row, the prompt tokens its prefill resumed from the prefix cache (0: none)."""
        return list(batch.resumed)

    @property
    def batch_invariant(self) -> bool:
        """Both paths prefill each row as alone (the lean prefill's shared passes where a
        load-time check found them exact, see :mod:`.leanprefill`). The lean decode step attends over each row's
        own cache columns, and so does the generic HF forward where its attention is
        transformers' SDPA (see :mod:`.rows`); a model attending otherwise masks a row's
        foreign columns, which only float32 leaves the tokens alone for."""
        return self.fast is not None or self.rows_refusal is None or next(self.model.parameters()).dtype == torch.float32

    @property
    def batches_requests(self) -> bool:
        """Whether concurrent requests share decode steps: on the lean decode step, and on
        the generic HF forward when the model's cache can be merged (see :mod:`.generic`)."""
        return self.fast is not None or self.join_refusal is None

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        """Where the batch's KV cache can be merged (:attr:`batches_requests`), up to
        ``max_rows`` rows in all."""
        return self.batches_requests and self._rows + len(rows) <= self.max_rows

    @property
    def joins_together(self) -> bool:
        """Whether requests joining at once share the lean prefill's passes (elsewhere
        each row is prefilled alone: the scheduler then joins them one at a time, and each
        draws its first token right after its own prefill)."""
        return self.lean is not None

    def join(self, batch: HFBatch, rows: Sequence[RowSpec]) -> None:
        """Prefill the joining rows now (see :meth:`join_together`)."""
        error = self.join_together(batch, [rows])[0]
        if error is not None:
            raise error

    @torch.inference_mode()
    def join_together(self, batch: HFBatch, requests: Sequence[Sequence[RowSpec]]) -> list[BaseException | None]:
        """Prefill the joining requests' rows now, together where the lean prefill is
        exact (each row's numbers are those it gets alone), and on their own: a request
        that fails (a bad row, no memory) fails alone and the running batch is untouched.
        If the shared passes fail, each request is prefilled alone, to find which. Their
        logits join the batch's at the next step (or at :meth:`first_tokens`)."""
        if not self.batches_requests:
            raise ValueError(f"rows cannot join a running batch of this model: {self.join_refusal}")
        if batch.cache is not None:
            cache_length(batch.cache)  # a cache that cannot be merged refuses the join, not the batch
        outcome: list[HFBatch | BaseException] = []
        for rows in requests:
            try:
                outcome.append(self._new_batch(rows))
            except Exception as exc:  # noqa: BLE001 - this request's failure (a bad row, no memory)
                outcome.append(self._failure(exc))
        subs = [sub for sub in outcome if isinstance(sub, HFBatch)]
        try:
            logits: list[torch.Tensor | BaseException] = list(prefill_all(self, subs)) if subs else []
        except Exception as exc:  # noqa: BLE001 - one request's failure: which, when several
            logits = [self._prefill_alone(sub) for sub in subs] if len(subs) > 1 else [self._failure(exc)]
        errors: list[BaseException | None] = []
        for item in outcome:
            if not isinstance(item, HFBatch):
                errors.append(item)
                continue
            result = logits.pop(0)
            if not isinstance(result, BaseException):
                try:
                    item.first_logits = list(result.clone().unbind(0))
                except Exception as exc:  # noqa: BLE001 - no memory for the copy: this request's failure
                    result = self._failure(exc)
            if isinstance(result, BaseException):
                errors.append(result)
                continue
            item.prefilled, item.started = result, True  # nothing from here on can fail
            self._rows += item.size
            batch.joining.append(item)
            errors.append(None)
        return errors

    def _prefill_alone(self, sub: HFBatch) -> torch.Tensor | BaseException:
        """``sub``'s prefill on its own, or what failed it."""
        try:
            return prefill(self, sub)
        except Exception as exc:  # noqa: BLE001 - this request's failure
            return self._failure(exc)

    def _failure(self, exc: Exception) -> BaseException:
        """What a joining request's failed prefill tells its client: running out of
        memory as :class:`~millm_core.api.OutOfMemory`."""
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return exc
        error = OutOfMemory(f"the {self.device} device ran out of memory prefilling this request beside the running batch; retry")
        error.__cause__ = exc
        return error

    def _decode(self, batch: HFBatch) -> torch.Tensor:
        assert batch.last_tokens is not None and batch.next_pos is not None
        if batch.mask is not None:
            ones = torch.ones((batch.mask.shape[0], 1), dtype=batch.mask.dtype, device=self.device)
            batch.mask = torch.cat([batch.mask, ones], dim=1)
        captured: Captured = {}
        if self.fast is not None and batch.kv is not None:
            mask = batch.mask.bool() if batch.mask is not None else None
            reads = batch.taps.by_layer if batch.taps is not None else None
            # Padded rows attend over their own columns only: attention over a longer,
            # masked row reduces in another order, which bf16 shows in the tokens.
            starts = mask.int().argmax(dim=1).tolist() if mask is not None else None
            logits = self.fast.step(
                batch.last_tokens, batch.next_pos, batch.kv, None if starts else mask, batch.deltas, reads, captured, starts
            )
            refeed_prompt_ends(batch, logits)
            batch.next_pos = batch.next_pos + 1
            self._decode_reads(batch, captured)
            return logits
        with self._block_hooks(batch, captured):
            out = self.model(
                input_ids=batch.last_tokens[:, None],
                attention_mask=batch.mask,
                position_ids=batch.next_pos[:, None],
                cache=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits = out.logits[:, -1, :]
        refeed_prompt_ends(batch, logits)
        batch.next_pos = batch.next_pos + 1
        self._decode_reads(batch, captured)
        return logits

    @staticmethod
    def _decode_reads(batch: HFBatch, captured: Captured) -> None:
        """A decode step read the position of the token it fed: one before the draw."""
        if batch.taps is None:
            batch.reads = None
            return
        assert batch.draw_pos is not None
        batch.reads = readouts(batch.taps, captured, [p - 1 for p in batch.draw_pos], None)

    def retain(self, batch: HFBatch, keep: Sequence[int]) -> None:
        self._rows = len(keep) + sum(sub.size for sub in batch.joining)
        index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        batch.prompts = [batch.prompts[i] for i in keep]
        batch.params = [batch.params[i] for i in keep]
        assert batch.draw_pos is not None
        batch.draw_pos = [batch.draw_pos[i] for i in keep]
        batch.row_taps = [batch.row_taps[i] for i in keep]
        batch.resumed = [batch.resumed[i] for i in keep]
        if batch.taps is not None:
            batch.taps = TapSet.build(batch.row_taps, self.device, self.info.n_layers)
        batch.reads = None
        select(batch, keep)
        if batch.cache is not None:
            batch.cache.batch_select_indices(index)
        if batch.kv is not None:
            batch.kv.select(index)
        if batch.deltas is not None:
            batch.deltas = {layer: delta.index_select(0, index) for layer, delta in batch.deltas.items()}
        if batch.mask is not None:
            batch.mask = batch.mask.index_select(0, index)
        if batch.next_pos is not None:
            batch.next_pos = batch.next_pos.index_select(0, index)
        if batch.last_tokens is not None:
            batch.last_tokens = batch.last_tokens.index_select(0, index)

    @torch.inference_mode()
    def rewind(self, batch: HFBatch, row: int, k: int) -> None:
        """Take back row ``row``'s last ``k`` draws, as if never drawn (see :mod:`.rewind`)."""
        rewind(batch, row, k)

    # ------------------------------------------------------------------ scoring

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    @torch.inference_mode()
    def next_token_logits(
        self, prompts: Sequence[Sequence[int]], *, float32: bool = False, float32_device: str = "auto", headroom_mb: int = 0
    ) -> Any:
        if not float32:
            return last_logits(self.model, prompts)
        with self._fp32.copy_of(self.model, float32_device, headroom_mb) as copy:
            return last_logits(copy, prompts)

    # ------------------------------------------------------------------ embeddings

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str) -> list[list[float]]:
        """Pooled last hidden states (see :func:`.forward.embed`)."""
        return embed(self.model, inputs, pooling, self.device)

    def residuals(self, inputs: Sequence[Sequence[int]], layer: int) -> list[Any]:
        """Block ``layer``'s output per position (see :func:`.forward.residuals`)."""
        return residuals(self.model, inputs, layer, self.device)

    def close(self, batch: HFBatch) -> None:
        self._rows = 0
        batch.joining = []
        batch.cache = None
        batch.kv = None
        batch.mask = None
        batch.first_logits = []
        batch.refill = {}
