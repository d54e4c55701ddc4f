"""Pre-packed bfloat16 weights for the lean decode step on CPUs with native bf16.

On a CPU whose oneDNN runs bf16 matrix products in hardware (AVX-512 BF16, AMX), a plain
``F.linear`` with a bf16 weight re-lays the weight out into the kernel's blocked format on
every call: a decode step at batch 1 then reads its weights at about half the memory
bandwidth float32 reaches (SmolLM2-135M: 10 against 20 GB/s, measured). oneDNN can do that
once: :func:`torch.ops.mkldnn._reorder_linear_weight` keeps a blocked copy, and
``torch.ops.mkldnn._linear_pointwise`` multiplies by it (what PyTorch's own compiler does
for frozen CPU models).

Two properties are checked on this machine when the model loads, per weight shape, before
the copies are used (:func:`packing_refusal`):

- a row's product does not depend on how many rows share the call (1 to 17 rows, and a
  row's own solo product): the decode step stays batch-invariant;
- a single row's product equals ``F.linear``'s bit for bit: the step keeps computing what
  HF's forward computes for one row, which prefill, rewinds and the generic path use.

Where either fails, or the CPU has no native bf16, the step keeps ``F.linear``; the reason
is logged. The blocked copies cost memory: one more copy of the projection and output
weights (the HF modules keep theirs for prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows tried by the load-time check: a lone row, small batches and one past the sizes the
# scheduler usually runs (the kernels block rows by 16 on AMX).
_CHECK_ROWS = (1, 2, 3, 8, 17)


def _ops_available() -> bool:
    mkldnn = torch.ops.mkldnn
    try:
        return bool(mkldnn._reorder_linear_weight) and bool(mkldnn._linear_pointwise) and bool(mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def _apply(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _packs_exactly(weight: torch.Tensor, packed: torch.Tensor) -> str | None:
    """None when ``packed`` multiplies every row as it does alone, and a lone row as
    ``F.linear`` does with ``weight``; else what differed."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((max(_CHECK_ROWS), weight.shape[1]), generator=generator).to(weight.dtype)
    alone = [_apply(x[r : r + 1], packed) for r in range(x.shape[0])]
    if not torch.equal(alone[0], F.linear(x[:1], weight)):
        return f"a packed {tuple(weight.shape)} product of one row differs from F.linear's"
    for rows in _CHECK_ROWS:
        if not torch.equal(_apply(x[:rows], packed), torch.cat(alone[:rows])):
            return f"a packed {tuple(weight.shape)} product depends on its {rows} rows"
    return None


class PackedWeights:
    """Blocked copies of bf16 weight matrices, and the linear that uses them."""

    def __init__(self, weights: Sequence[torch.Tensor]) -> None:
        self._packed: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        for weight in weights:
            if weight.data_ptr() not in self._packed:
                self._packed[weight.data_ptr()] = _pack(weight)
                self.nbytes += weight.numel() * weight.element_size()

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)``, through ``weight``'s blocked copy where it has one."""
        packed = self._packed.get(weight.data_ptr())
        return F.linear(x, weight) if packed is None else _apply(x, packed)


def packing_refusal(weights: Sequence[torch.Tensor]) -> str | None:
    """Why the lean step cannot use blocked copies of ``weights`` here, or None when it can
    (bf16 on the CPU with native bf16 kernels, each shape passing the check above)."""
    if not weights:
        return "no weights"
    first = weights[0]
    if first.dtype != torch.bfloat16:
        return f"weights are {str(first.dtype).removeprefix('torch.')}, not bfloat16"
    if first.device.type != "cpu":
        return f"weights are on {first.device.type}, not the CPU"
    if not _ops_available():
        return "this CPU has no native bf16 matrix kernels in oneDNN"
    checked: set[tuple[int, ...]] = set()
    with torch.inference_mode():
        for weight in weights:
            shape = tuple(weight.shape)
            if shape in checked:
                continue
            checked.add(shape)
            failed = _packs_exactly(weight, _pack(weight))
            if failed is not None:
                return failed
    return None
