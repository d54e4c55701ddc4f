"""The lean decode step's layers, as one function TorchScript can run.

An 8-row SmolLM2 bf16 decode step performs about 1,500 tensor operations, most of them on
a few kilobytes (RMSNorm, rotary, residual adds, per-row attention); Python's dispatch of
each costs more than its arithmetic. :func:`run_layers` is the step's per-layer work
written in the subset of Python TorchScript compiles, so the step can hand a run of
layers to TorchScript's interpreter in one call (about 17 % off that step on the 2-core
AMX machine).

TorchScript runs here as an interpreter only: graph optimisation is off for the call
(``torch.jit.optimized_execution(False)``; CPU fusion is off in PyTorch by default as
well), so every operation is the ATen kernel the Python function calls, with the same
inputs — the same bits. :func:`scripted` compiles the function and checks that: one call
over random rows of a model's own first layer must equal the Python function's result
bit for bit, or the Python function is used (and the reason logged).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

Layers = Callable[..., torch.Tensor]


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF's Llama computes it: float32 accumulation, the weight applied in the
    input's dtype."""
    h32 = hidden.to(torch.float32)
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(hidden.dtype)


def product(x: torch.Tensor, weight: torch.Tensor, blocked: bool) -> torch.Tensor:
    """``x @ weight.T``; ``blocked``: ``weight`` is oneDNN's blocked copy (see :mod:`.packed`)."""
    if blocked:
        scalars = torch.jit.annotate(list[int | float | complex | None], [])
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", scalars, "")
    return F.linear(x, weight)


def run_layers(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    weights: list[list[torch.Tensor]],
    blocked: bool,
    first: int,
    end: int,
    column: int,
    groups: list[tuple[int, int, int]],
    mask: torch.Tensor | None,
    shape: list[int],
    eps: float,
    scaling: float,
) -> torch.Tensor:
    """Layers ``first`` to ``end - 1`` of a decode step for ``hidden`` (``[rows,
    d_model]``, one new token per row), writing each layer's key and value at cache column
    ``column``.

    ``weights[i]`` is layer i's (input norm, fused q/k/v, output, post-attention norm,
    fused gate/up, down); ``cos`` and ``sin`` are ``[rows, 1, 1, head_dim]``, ``sin``'s
    first half negated (rotate-half's sign moved onto it: ``(-a) * b`` rounds as ``a *
    (-b)``). ``shape`` is (heads, kv heads, head dim, MLP width). With ``groups`` (``(first
    row, end row, first column)`` runs of rows), each run attends over exactly its own
    columns with no mask, as its rows would alone; without, every row attends over all
    columns under ``mask`` (bool ``[rows, 1, 1, column + 1]``, or None)."""
    rows = hidden.shape[0]
    n_heads, n_kv, head_dim, inter = shape[0], shape[1], shape[2], shape[3]
    half = head_dim // 2
    q_size = n_heads * head_dim
    k_end = q_size + n_kv * head_dim
    gqa = n_kv != n_heads
    for i in range(first, end):
        w = weights[i]
        qkv = product(rms_norm(hidden, w[0], eps), w[1], blocked)
        qk = qkv[:, :k_end].view(rows, n_heads + n_kv, 1, head_dim)
        qk = qk * cos + qk.roll(half, -1) * sin
        q = qk[:, :n_heads]
        v = qkv[:, k_end:].view(rows, n_kv, 1, head_dim)
        layer_keys = keys[i]
        layer_values = values[i]
        layer_keys[:, :, column : column + 1] = qk[:, n_heads:]
        layer_values[:, :, column : column + 1] = v
        if len(groups) == 0:
            attn = F.scaled_dot_product_attention(
                q, layer_keys[:, :, : column + 1], layer_values[:, :, : column + 1], attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
        else:
            parts: list[torch.Tensor] = []
            for group in groups:
                a, b, s = group
                parts.append(
                    F.scaled_dot_product_attention(
                        q[a:b], layer_keys[a:b, :, s : column + 1], layer_values[a:b, :, s : column + 1], scale=scaling, enable_gqa=gqa
                    )
                )
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        hidden = hidden + product(attn.reshape(rows, q_size), w[2], blocked)
        gate_up = product(rms_norm(hidden, w[3], eps), w[4], blocked)
        hidden = hidden + product(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w[5], blocked)
    return hidden


@cache
def _compiled() -> tuple[Layers | None, str | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script says so; still what runs this fastest and exactly
            return torch.jit.script(run_layers), None
    except Exception as exc:  # TorchScript missing or unable to compile: the Python function serves
        return None, f"TorchScript could not compile the layers: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def interpreted(fn: Layers) -> Layers:
    """``fn`` run with TorchScript's graph optimisation off (operations as written)."""

    def call(*args: Any) -> torch.Tensor:
        with torch.jit.optimized_execution(False):
            return fn(*args)

    return call


def scripted(weights: list[list[torch.Tensor]], blocked: bool, shape: list[int], eps: float, scaling: float) -> tuple[Layers, str | None]:
    """The layer function to run (compiled where that is exact) and why it is not the
    compiled one (None when it is). Random rows through the model's own first layers must
    come out of the compiled function as out of the Python one, bit for bit, keys and values
    included: three rows over caches of different lengths (one attention call per run of
    rows, one of them a run of two), the same rows under a mask in one call, and a stretch
    that starts past layer 0."""
    fn, reason = _compiled()
    if fn is None:
        return run_layers, reason
    fn = interpreted(fn)
    n_kv, head_dim = shape[1], shape[2]
    w_in = weights[0][0]
    g = torch.Generator().manual_seed(0)
    rows, column, layers = 3, 9, min(2, len(weights))

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g).to(w_in.device, w_in.dtype)

    hidden, angle = rand(rows, w_in.shape[0]), rand(rows, 1, 1, head_dim)
    cache = [[rand(rows, n_kv, column + 1, head_dim) for _ in range(layers)] for _ in range(2)]
    mask = (torch.arange(column + 1) >= torch.tensor([[4], [0], [0]])).to(w_in.device)[:, None, None]
    calls = [
        ([(0, 1, 4), (1, 3, 0)], None, 0, layers),
        ([], mask, 0, layers),
        ([(0, 3, 0)], None, layers - 1, layers),
    ]
    try:
        with torch.inference_mode():
            for groups, attn_mask, first, end in calls:
                results = []
                for run in (run_layers, fn):
                    keys, values = [k.clone() for k in cache[0]], [v.clone() for v in cache[1]]
                    out = run(hidden, angle.cos(), angle.sin(), keys, values, weights, blocked, first, end, column, groups, attn_mask, shape, eps, scaling)
                    results.append([out, *keys, *values])
                if not all(torch.equal(a, b) for a, b in zip(*results, strict=True)):
                    return run_layers, "TorchScript's layers differ from the Python function's here"
    except Exception as exc:  # the compiled function (or the check) fails here: the Python function serves
        return run_layers, f"TorchScript's layers failed their check: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return fn, None
