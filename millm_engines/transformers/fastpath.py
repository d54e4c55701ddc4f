"""A lean decode step for Llama-architecture checkpoints.

HF's module-by-module forward costs more in Python than in arithmetic at batch sizes a
CPU serves: on SmolLM2-135M a bf16 decode step spends most of its time outside the
matrix products. For models whose structure we recognise this module runs the same
mathematics with fewer, larger operations:

- q/k/v and gate/up projections fused into one matrix each. The HF modules' weights are
  re-pointed to views of the fused matrices, so no memory is duplicated and the HF forward
  (used for prefill) computes exactly as before;
- a preallocated KV cache written in place (no concatenation per step);
- rotary cos/sin computed once per step by the model's own rotary module;
- RMSNorm written exactly as HF's (float32 accumulation), so results match HF's forward;
- the layers run in one call to TorchScript's interpreter where that is exact (see
  :mod:`.leanlayers`).

Anything else falls back to the generic HF forward. Whether the fast path is used is
logged at load and can be turned off with ``--fast-decode false``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .leanlayers import Layers, product, rms_norm, scripted
from .packed import Linear, pack
from .preflight import lean_refusal
from .taps import Captured, LayerReads, capture

_GROW = 256


# HF models expose their structure as dynamic attributes (model.model.layers[i].self_attn…),
# which torch's Module typing cannot describe: ``model`` is typed Any where it is read.
def unsupported_reason(model: Any) -> str | None:
    """Why the fast path cannot serve ``model``, or None when it can."""
    config = getattr(model, "config", None)
    reason = lean_refusal(config) if config is not None else "the model has no config"
    if reason is not None:
        return reason
    layers = model.model.layers
    for layer in layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
            if type(proj) is not nn.Linear:
                return "projections are not plain nn.Linear (quantised?)"
    return None


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    """One matrix holding the given projections' weights; each module's weight becomes a
    view into it."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


_rms = rms_norm  # the lean prefill's name for it


@dataclass
class _Layer:
    w_in: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    w_post: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


class KVCache:
    """Per-layer keys and values ``[rows, kv_heads, capacity, head_dim]``, filled to
    ``length`` columns (left-padded rows share the column index)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int, full: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        self.keys = keys
        self.values = values
        self.length = length
        # Per layer, the (keys, values) tensors whose first rows ``keys``/``values`` are,
        # with rows to spare (see merge); checked before use, since growth, selection and
        # rewinds replace ``keys`` and ``values``.
        self._full = full

    @classmethod
    def from_hf(cls, hf_cache: object, extra: int = _GROW) -> KVCache:
        """The keys and values of an HF ``DynamicCache`` (one row), with room for ``extra``
        more columns."""
        layers = hf_cache.layers  # type: ignore[attr-defined]
        return cls.from_layers([layer.keys for layer in layers], [layer.values for layer in layers], extra)

    @classmethod
    def from_layers(cls, keys: list[torch.Tensor], values: list[torch.Tensor], extra: int = _GROW) -> KVCache:
        """Per-layer keys and values ``[rows, kv_heads, length, head_dim]`` copied into a
        cache with room for ``extra`` more columns."""
        out_k, out_v = [], []
        for k, v in zip(keys, values, strict=True):
            rows, heads, length, dim = k.shape
            kk = k.new_empty((rows, heads, length + extra, dim))
            vv = v.new_empty((rows, heads, length + extra, dim))
            kk[:, :, :length] = k
            vv[:, :, :length] = v
            out_k.append(kk)
            out_v.append(vv)
        return cls(out_k, out_v, int(out_k[0].shape[2] - extra))

    def reserve(self, columns: int) -> None:
        capacity = self.keys[0].shape[2]
        if self.length + columns <= capacity:
            return
        grow = max(_GROW, capacity)
        self._full = None  # new tensors: the old ones (and their spare rows) are freed
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                bigger = t.new_empty((t.shape[0], t.shape[1], capacity + grow, t.shape[3]))
                bigger[:, :, : self.length] = t[:, :, : self.length]
                store[i] = bigger

    @torch.inference_mode()
    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` names, in that order. Where it names them in ascending
        order and the cache views tensors with rows to spare (see :meth:`merge`), the kept
        rows after the first dropped one move up in place (their filled columns) and the
        rows freed become spare for the next join; otherwise, and once a quarter or less of
        those tensors' rows would stay in use (their memory is then given back), every kept
        row is copied into new tensors."""
        keep = [int(i) for i in index.tolist()]
        room = self._room(0)
        if room is None or 4 * len(keep) <= room[0][0].shape[0] or any(a >= b for a, b in zip(keep, keep[1:], strict=False)):
            self.keys = [k.index_select(0, index) for k in self.keys]
            self.values = [v.index_select(0, index) for v in self.values]
            self._full = None
            return
        start = next((j for j, row in enumerate(keep) if row != j), len(keep))  # rows before it stay
        if start < len(keep):
            moved = index[start:]
            for pair in room:
                for base in pair:  # the rows are gathered first (a copy): a row may move onto one read later
                    base[start : len(keep), :, : self.length] = base[moved, :, : self.length]
        self.keys = [k[: len(keep)] for k, _ in room]
        self.values = [v[: len(keep)] for _, v in room]

    def _room(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, the (keys, values) tensors whose first rows this cache is, when each
        has ``rows`` more rows that nothing uses; None when the cache is no longer such a
        view (grown, selected, cut by a rewind) or the room is short."""
        if self._full is None:
            return None
        for (k, v), pair in zip(zip(self.keys, self.values, strict=True), self._full, strict=True):
            for t, base in zip((k, v), pair, strict=True):
                if (
                    base.data_ptr() != t.data_ptr()
                    or base.stride() != t.stride()
                    or base.shape[1:] != t.shape[1:]
                    or base.shape[0] < t.shape[0] + rows
                ):
                    return None
        return self._full

    @classmethod
    @torch.inference_mode()
    def merge(cls, first: KVCache, second: KVCache) -> KVCache:
        """``first``'s rows then ``second``'s, right-aligned to the longer length (the
        shorter one's new left columns are zeros, which the attention mask hides).

        Joining copies only the joined rows where it can: on the CPU the tensors a merge
        allocates hold twice the rows the merged cache uses (memory never written is never
        backed there), rows that leave in order free theirs (:meth:`select`), and a later
        merge of rows no longer than the cache writes them into unused rows in place (the
        running rows are not copied). Otherwise every row is copied into new tensors.
        Unused rows and the headroom after the filled columns are left unwritten, as
        :meth:`reserve` leaves them: a step writes its column before anything reads it. (A
        join used to copy and zero-fill the whole cache: about 160 MB for 9 rows of the 22M
        bench model at 300 tokens, 10-25 ms of an interactive request's time to first token
        beside 8 running agents.)"""
        length = max(first.length, second.length)
        split, joined = first.keys[0].shape[0], second.keys[0].shape[0]
        room = first._room(joined) if second.length <= first.length else None
        first._full = None  # its spare rows go to the merged cache: never offered twice
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        full: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(len(first.keys)):
            bases = []
            for out, a, b, base in (
                (keys, first.keys[i], second.keys[i], room[i][0] if room else None),
                (values, first.values[i], second.values[i], room[i][1] if room else None),
            ):
                parts = [(slice(split, split + joined), b, second.length)]
                if base is None:
                    used = split + joined
                    spare = used if a.device.type == "cpu" else 0  # an accelerator would reserve them
                    base = a.new_empty((used + spare, a.shape[1], length + _GROW, a.shape[3]))
                    parts.insert(0, (slice(None, split), a, first.length))
                for rows, part, filled in parts:
                    base[rows, :, : length - filled] = 0
                    base[rows, :, length - filled : length] = part[:, :, :filled]
                out.append(base[: split + joined])
                bases.append(base)
            full.append((bases[0], bases[1]))
        return cls(keys, values, length, full)


def grouping_refusal(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int, scale: float) -> str | None:
    """Why rows that attend over the same cache columns cannot share one SDPA call here
    (None: they can): on random inputs of a few lengths and row counts, one call over the
    rows must equal one call per row bit for bit. (Measured exact on the CPU's flash
    attention, float32 and bfloat16: each row and head is reduced on its own.)"""
    g = torch.Generator().manual_seed(0)
    gqa = heads != kv_heads
    for length in (1, 33, 300):
        for rows in (2, 3, 8):
            q = torch.randn((rows, heads, 1, head_dim), generator=g).to(device, dtype)
            k, v = (torch.randn((rows, kv_heads, length, head_dim), generator=g).to(device, dtype) for _ in range(2))
            together = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
            alone = torch.cat([F.scaled_dot_product_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], scale=scale, enable_gqa=gqa) for r in range(rows)])
            if not torch.equal(together, alone):
                return f"one attention call over {rows} rows of {length} columns differs from one call per row here"
    return None


def column_groups(starts: list[int], grouped: bool) -> list[tuple[int, int, int]]:
    """``(first row, end row, first column)`` of each run of consecutive rows that start at
    the same cache column (one per row when not ``grouped``)."""
    groups: list[tuple[int, int, int]] = []
    for r, s in enumerate(starts):
        if grouped and groups and groups[-1][2] == s:
            groups[-1] = (groups[-1][0], r + 1, s)
        else:
            groups.append((r, r + 1, s))
    return groups


class LlamaDecoder:
    """The lean decode step; build once per loaded model. Unless ``packing`` says why not
    (None: try), its bf16 matrix products use blocked weight copies where this CPU passes
    their check (see :mod:`.packed`; ``packing_refusal`` says why not, ``packed_bytes``
    what they take). Rows that start at the same cache column (a request's ``n`` rows,
    requests that joined together with prompts of one length) attend in one SDPA call
    where :func:`grouping_refusal` finds that exact (``grouping_refusal`` says why not).
    The layers run through TorchScript where :func:`.leanlayers.scripted` finds that
    exact (``scripting_refusal`` says why not)."""

    def __init__(self, model: Any, packing: str | None = "not asked for") -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        config = model.config
        inner = model.model
        self.eps = float(config.rms_norm_eps)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.rotary = inner.rotary_emb
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.scaling = float(first.scaling)
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = int(config.intermediate_size)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    w_in=layer.input_layernorm.weight,
                    w_qkv=_fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                    w_o=attn.o_proj.weight,
                    w_post=layer.post_attention_layernorm.weight,
                    w_gate_up=_fuse([mlp.gate_proj, mlp.up_proj]),
                    w_down=mlp.down_proj.weight,
                )
            )
        weights = [w for layer in self.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)] + [self.lm_head]
        packed, self.packing_refusal = pack(weights) if packing is None else (None, packing)
        self.packed_bytes = packed.nbytes if packed is not None else 0
        self._packed = packed
        self._linear: Linear = packed.linear if packed is not None else F.linear
        self._resolve_products()
        self.grouping_refusal = grouping_refusal(self.embed.dtype, self.embed.device, self.n_heads, self.n_kv, self.head_dim, self.scaling)

    def _resolve_products(self) -> None:
        """The layers' weights as :func:`.leanlayers.run_layers` takes them — the blocked
        copies where every product has one, else the weights themselves — and the layer
        function to run them with."""
        blocked = self._packed.blocked if self._packed is not None else (lambda weight: None)
        products = [w for layer in self.layers for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)] + [self.lm_head]
        copies = [blocked(w) for w in products]
        self._blocked = all(c is not None for c in copies)
        use = [c for c in copies if c is not None] if self._blocked else products
        self._weights = [[layer.w_in, use[4 * i], use[4 * i + 1], layer.w_post, use[4 * i + 2], use[4 * i + 3]] for i, layer in enumerate(self.layers)]
        self._head_weight = use[-1]
        self._shape = [self.n_heads, self.n_kv, self.head_dim, self.inter]
        self._layers: Layers
        self._layers, self.scripting_refusal = scripted(self._weights, self._blocked, self._shape, self.eps, self.scaling)

    def __deepcopy__(self, memo: dict[int, Any]) -> LlamaDecoder:
        # The copy's products are resolved again, for its own (copied) weights, which have no
        # blocked copies (F.linear).
        twin = LlamaDecoder.__new__(LlamaDecoder)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            if name not in ("_weights", "_head_weight", "_layers"):
                setattr(twin, name, copy.deepcopy(value, memo))
        twin._resolve_products()
        twin.packed_bytes = 0 if twin._packed is not None else twin.packed_bytes
        twin.packing_refusal = "a copy: its weights have no blocked copies" if twin._packed is not None else twin.packing_refusal
        return twin

    @torch.inference_mode()
    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None,
        deltas: dict[int, torch.Tensor] | None = None,
        reads: LayerReads | None = None,
        captured: Captured | None = None,
        starts: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for one new token per row. ``positions`` are the
        tokens' rotary positions; ``mask`` (bool ``[rows, length + 1]``, True = attend) is
        needed only when rows are padded; ``deltas[layer]`` (``[rows, d_model]``) is added
        to that block's output, as the steering hooks do on the HF forward; ``reads``
        names the rows whose block outputs go into ``captured`` (see :mod:`.taps`).
        ``starts[r]``, when given, is row r's first real cache column: each row then
        attends over exactly its own columns, with no mask (the row computes as alone;
        consecutive rows with one start share a call where that is exact)."""
        # The residual stream is 2-D ([rows, d_model]) throughout: the products take it as
        # it is, and q, k and v are views of the fused projection (no reshapes per call).
        hidden = F.embedding(tokens, self.embed)
        cos, sin = self.rotary(hidden[:, None], positions[:, None])
        # HF's x * cos + rotate_half(x) * sin, in fewer operations and for q and k at once:
        # rotate_half(x) is x rolled by half a head with its first half negated, and
        # (-a) * b rounds exactly as a * (-b), so the sign moves onto sin (bit for bit).
        half = self.head_dim // 2
        cos, sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
        cache.reserve(1)
        t = cache.length
        attn_mask = mask[:, None, None, : t + 1] if mask is not None else None
        groups = column_groups(starts, self.grouping_refusal is None) if starts is not None else []
        # Steering deltas and taps act between layers, in Python: the layers run in stretches.
        n_layers = len(self.layers)
        stops = sorted({i for i in (*(reads or ()), *(deltas or ())) if 0 <= i < n_layers})
        first = 0
        for end in (*(i + 1 for i in stops), n_layers):
            if end == first:  # the last layer was a stop
                continue
            hidden = self._layers(
                hidden, cos, sin, cache.keys, cache.values, self._weights, self._blocked, first, end, t, groups, attn_mask, self._shape, self.eps, self.scaling
            )
            i, first = end - 1, end
            if reads is not None and i in reads:
                assert captured is not None
                hidden = capture(i, reads, hidden[:, None], deltas.get(i) if deltas else None, captured)[:, 0]
            elif deltas is not None and i in deltas:
                hidden = hidden + deltas[i]
        cache.length = t + 1
        return product(rms_norm(hidden, self.norm, self.eps), self._head_weight, self._blocked)
