"""The lean prefill: the prompts of several rows in one forward pass, each row's numbers
its own.

Rows used to be prefilled one at a time through HF's forward, so that a row's prefill
never depended on the other rows: a padded pass over several prompts computes each row's
matrix products in a call whose row count (and, in bf16, whose kernel and rounding) depends
on the others, and reduces its attention over padding. One prompt at a time leaves most of
a CPU's matrix units idle, though: on SmolLM2-135M in bf16, 8 prompts of ~43 tokens took
354 ms one after another and 128 ms in one pass (measured with this module).

This pass keeps each row's numbers its own while sharing the work:

- every per-token operation (embedding, RMSNorm, rotary, the MLP's activation, residual
  adds, steering deltas) computes each token alone;
- the matrix products run over every row of every prompt at once, in blocks of at most
  ``block`` rows, a size for which this machine's kernels were checked (when the engine
  loads) to give each row the product it gets alone: a row's result then does not depend
  on which rows share its block;
- attention runs per prompt, one SDPA call over exactly the prompt's own keys (a causal
  chunk, after the keys of the chunks before it): the same call whether or not other
  prompts share the pass.

A prompt runs in the chunks the prefix cache keys its blocks by (ending at the multiples of
:data:`.prefix.CHUNK`), and chunk ``j`` of every prompt that has one goes in pass ``j``;
so a prompt resumed from cached blocks computes what it would have without them. The
lean prefill is used only where a load-time check (:func:`build`) finds it exact: bf16 or
fp16 weights (float32 products go through the BLAS, whose kernels depend on the row count
here), and a pass over three prompts of different lengths giving each the logits, keys
and values it gets alone, bit for bit. Elsewhere each row is prefilled alone through HF's
forward, as before. The lean prefill is not HF's forward: the numbers differ from it by
rounding (blocked weights, other kernel blocking), the same for every row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from millm_core.api import Tap

from .fastpath import LlamaDecoder, _rms
from .packed import Linear
from .prefix import chunks
from .taps import Captured

# Row blocks tried, largest first: the matrix products' blocks are the largest size whose
# rows this machine multiplies as alone (checked at load for every weight shape).
BLOCKS = (128, 64, 32)
# The logits' product runs over the prompts ending in a pass, in blocks of at most this many
# (a batch holds up to 16 rows).
LOGIT_BLOCK = 16
_FAILURES = (RuntimeError, MemoryError, NotImplementedError)


@dataclass
class Prompt:
    """One row's prompt being prefilled: ``keys``/``values`` (per layer
    ``[1, kv_heads, done, head_dim]``) hold its first ``done`` positions (resumed from the
    prefix cache, or computed by earlier passes). ``deltas`` (layer -> ``[d_model]``) is
    added to those blocks' outputs; ``taps`` are read at every position, one
    :data:`Captured` per pass (``[1, positions, d_model]``). ``logits`` is the last
    position's ``[1, vocab]`` once the prompt is done."""

    tokens: Sequence[int]
    done: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    deltas: Mapping[int, torch.Tensor] | None = None
    taps: tuple[Tap, ...] = ()
    captured: list[Captured] = field(default_factory=list)
    logits: torch.Tensor | None = None


class LeanPrefill:
    """Prefills prompts together on a :class:`~.fastpath.LlamaDecoder`'s weights, in
    blocks of ``block`` rows; build with :func:`build`."""

    def __init__(self, decoder: LlamaDecoder, block: int) -> None:
        self.decoder = decoder
        self.block = block

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, block: int | None = None) -> torch.Tensor:
        linear, block = self.decoder._linear, block or self.block
        if x.shape[0] <= block:
            return linear(x, weight)
        return torch.cat([linear(x[a : a + block], weight) for a in range(0, x.shape[0], block)])

    @torch.inference_mode()
    def run(self, prompts: Sequence[Prompt]) -> None:
        """Prefill every prompt from its ``done`` position to its end: pass ``j`` takes
        the ``j``-th remaining chunk of each prompt that has one."""
        plans = [list(chunks(p.done, len(p.tokens))) for p in prompts]
        if any(not plan for plan in plans):
            raise ValueError("nothing left to prefill: a prompt's every token was resumed")
        for j in range(max(len(plan) for plan in plans)):
            self._pass([(p, *plan[j]) for p, plan in zip(prompts, plans, strict=True) if j < len(plan)])

    def _pass(self, items: list[tuple[Prompt, int, int]]) -> None:
        """One forward pass over positions ``a .. b - 1`` of each ``(prompt, a, b)``."""
        d = self.decoder
        spans: list[tuple[int, int]] = []  # each item's rows in the pass
        for _, a, b in items:
            first = spans[-1][1] if spans else 0
            spans.append((first, first + b - a))
        n = spans[-1][1]
        device = d.embed.device
        tokens = torch.tensor([t for p, a, b in items for t in p.tokens[a:b]], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(a, b, device=device) for _, a, b in items])
        hidden = F.embedding(tokens, d.embed)
        cos, sin = d.rotary(hidden[None], positions[None])
        half = d.head_dim // 2  # as in the decode step: HF's rotate_half with its sign on sin
        cos, sin = cos[0][:, None], torch.cat((-sin[0][..., :half], sin[0][..., half:]), dim=-1)[:, None]
        masks = [None if a == 0 else torch.ones((b - a, b), dtype=torch.bool, device=device).tril(a) for _, a, b in items]
        k_end = d.q_size + d.kv_size
        gqa = d.n_kv != d.n_heads
        for p, _, _ in items:
            p.captured.append({})
        for i, layer in enumerate(d.layers):
            x = _rms(hidden, layer.w_in, d.eps)
            qkv = self._linear(x, layer.w_qkv)
            qk = qkv[:, :k_end].view(n, d.n_heads + d.n_kv, d.head_dim)
            qk = qk * cos + qk.roll(half, -1) * sin
            v = qkv[:, k_end:].view(n, d.n_kv, d.head_dim)
            parts = []
            for (p, a, _), (r0, r1), mask in zip(items, spans, masks, strict=True):
                keys = qk[r0:r1, d.n_heads :].transpose(0, 1)[None].contiguous()
                values = v[r0:r1].transpose(0, 1)[None].contiguous()
                if a > 0:  # after the prompt's earlier chunks
                    keys, values = torch.cat([p.keys[i], keys], dim=2), torch.cat([p.values[i], values], dim=2)
                if len(p.keys) > i:
                    p.keys[i], p.values[i] = keys, values
                else:
                    p.keys.append(keys)
                    p.values.append(values)
                q = qk[r0:r1, : d.n_heads].transpose(0, 1)[None]
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, is_causal=mask is None, scale=d.scaling, enable_gqa=gqa
                )
                parts.append(out[0].transpose(0, 1).reshape(r1 - r0, d.q_size))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = hidden + self._linear(attn, layer.w_o)
            x = _rms(hidden, layer.w_post, d.eps)
            gate_up = self._linear(x, layer.w_gate_up)
            hidden = hidden + self._linear(F.silu(gate_up[:, : d.inter]) * gate_up[:, d.inter :], layer.w_down)
            for (p, _, _), (r0, r1) in zip(items, spans, strict=True):
                self._block_output(p, i, hidden, r0, r1)
        for p, _, b in items:
            p.done = b
        last = [(p, r1 - 1) for (p, _, b), (_, r1) in zip(items, spans, strict=True) if b == len(p.tokens)]
        if last:
            rows = torch.tensor([r for _, r in last], dtype=torch.long, device=device)
            logits = self._linear(_rms(hidden.index_select(0, rows), d.norm, d.eps), d.lm_head, LOGIT_BLOCK)
            for j, (p, _) in enumerate(last):
                p.logits = logits[j : j + 1]

    @staticmethod
    def _block_output(p: Prompt, layer: int, hidden: torch.Tensor, r0: int, r1: int) -> None:
        """After block ``layer``: read the prompt's ``pre_steering`` taps, add its delta (in
        place, on its own rows), read its ``post_steering`` taps — as the HF forward's
        block hooks do."""
        delta = p.deltas.get(layer) if p.deltas else None
        read = [tap for tap in p.taps if tap.layer == layer]
        pre = Tap(layer, "pre_steering")
        if pre in read:
            p.captured[-1][pre] = hidden[r0:r1].clone()[None]
        if delta is not None:
            hidden[r0:r1] += delta
        post = Tap(layer, "post_steering")
        if post in read:
            p.captured[-1][post] = hidden[r0:r1].clone()[None]


def rows_refusal(linear: Linear, weight: torch.Tensor, block: int) -> str | None:
    """Why ``linear`` does not multiply each of up to ``block`` rows by ``weight`` as it
    does that row alone (None: it does), on random rows, at every row count from 1 to
    ``block`` (kernels change their blocking at counts of their own: a plain bf16 product
    past 32 rows and a blocked 576 x 1536 one past 129 rows, on the AMX machine)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((block, weight.shape[1]), generator=generator).to(weight.device, weight.dtype)
    alone = torch.cat([linear(x[r : r + 1], weight) for r in range(block)])
    for rows in range(2, block + 1):
        if not torch.equal(linear(x[:rows], weight), alone[:rows]):
            return f"a {tuple(weight.shape)} product of {rows} rows differs from its rows' products alone"
    return None


def _together_refusal(prefill: LeanPrefill, vocab: int) -> str | None:
    """Why three prompts of different lengths (one past a chunk) prefilled in one pass do
    not each get the logits, keys and values they get alone (None: they do)."""
    generator = torch.Generator().manual_seed(1)
    lengths = (3, 21, 140)
    tokens = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    alone = [Prompt(t) for t in tokens]
    for p in alone:
        prefill.run([p])
    together = [Prompt(t) for t in tokens]
    prefill.run(together)
    for n, a, b in zip(lengths, alone, together, strict=True):
        assert a.logits is not None and b.logits is not None
        same = torch.equal(a.logits, b.logits) and all(
            torch.equal(x, y) for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values], strict=True)
        )
        if not same:
            return f"a prompt of {n} tokens prefilled beside others differs from its prefill alone"
    return None


def build(decoder: LlamaDecoder) -> tuple[LeanPrefill | None, str | None]:
    """The lean prefill for ``decoder``'s model where it is exact here, else None and why
    not (see the module docstring)."""
    dtype = decoder.embed.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return None, f"weights are {str(dtype).removeprefix('torch.')}: float32 products depend on the row count here"
    shapes: dict[tuple[int, ...], torch.Tensor] = {}
    for layer in decoder.layers:
        for weight in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down):
            shapes.setdefault(tuple(weight.shape), weight)
    reasons = []
    try:
        failed = rows_refusal(decoder._linear, decoder.lm_head, LOGIT_BLOCK)
        if failed is not None:
            return None, f"{failed} (the logits)"
        for block in BLOCKS:
            failed = next((r for w in shapes.values() if (r := rows_refusal(decoder._linear, w, block)) is not None), None)
            if failed is None:
                prefill = LeanPrefill(decoder, block)
                reason = _together_refusal(prefill, decoder.embed.shape[0])
                return (prefill, None) if reason is None else (None, reason)
            reasons.append(f"{failed} (blocks of {block})")
    except _FAILURES as exc:
        return None, f"the check failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None, "; ".join(reasons)
