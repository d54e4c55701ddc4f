"""Pre-packed bfloat16 weights for the lean decode step on CPUs with native bf16.

On a CPU whose oneDNN runs bf16 matrix products in hardware (AVX-512 BF16, AMX), a plain
``F.linear`` with a bf16 weight re-lays the weight out into the kernel's blocked format on
every call: a decode step at batch 1 then reads its weights at about half the memory
bandwidth float32 reaches (SmolLM2-135M: 10 against 20 GB/s, measured). oneDNN can do that
once: :func:`torch.ops.mkldnn._reorder_linear_weight` keeps a blocked copy, and
``torch.ops.mkldnn._linear_pointwise`` multiplies by it (what PyTorch's own compiler does
for frozen CPU models).

Two properties are checked on this machine when the model loads, per weight shape, before
the copies are used (:func:`pack`):

- a row's product does not depend on how many rows share the call (1 to 64 rows, against
  each row's own product): the decode step stays batch-invariant;
- a single row's product equals ``F.linear``'s bit for bit: the step keeps computing what
  HF's forward computes for one row, which prefill, rewinds and the generic path use.

Where either fails, where oneDNN cannot pack (an error, or no memory for the copies), or
where the CPU has no bf16 kernels, the step keeps ``F.linear``; the reason is logged. The
blocked copies cost memory: one more copy of the projection and output weights (the HF
modules keep theirs for prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Rows tried by the load-time check: a lone row, small batches, and each side of the sizes
# where oneDNN's kernels change their blocking (AMX tiles hold 16 rows; plain bf16 F.linear
# was measured to change its results past 32 rows), up to the 64 rows one request may run.
CHECK_ROWS = (1, 2, 3, 8, 16, 17, 32, 33, 64)
# What oneDNN raises where it cannot pack or multiply (no kernel for the shape or dtype, no
# memory for the copies).
_FAILURES = (RuntimeError, MemoryError, NotImplementedError)


def ops_available() -> bool:
    """Whether this torch has oneDNN's packing ops and oneDNN runs bf16 here."""
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


def packs_exactly(weight: torch.Tensor, packed: torch.Tensor) -> str | None:
    """None when ``packed`` multiplies every row of a call as it does that row alone, and a
    lone row as ``F.linear`` does with ``weight``; else what differed."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((max(CHECK_ROWS), weight.shape[1]), generator=generator).to(weight.dtype)
    alone = torch.cat([_apply(x[r : r + 1], packed) for r in range(x.shape[0])])
    if not torch.equal(alone[:1], F.linear(x[:1], weight)):
        return f"a packed {tuple(weight.shape)} product of one row differs from F.linear's"
    for rows in CHECK_ROWS:
        if not torch.equal(_apply(x[:rows], packed), alone[:rows]):
            return f"a packed {tuple(weight.shape)} product depends on its {rows} rows"
    return None


class PackedWeights:
    """Blocked copies of bf16 weight matrices, and the linear that uses them. Built by
    :func:`pack`, which checks them first."""

    def __init__(self) -> None:
        # id(weight) -> (the weight, kept alive so its id stays its own; its blocked copy)
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.nbytes = 0

    def add(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        self._packed[id(weight)] = (weight, packed)
        nbytes = getattr(torch.ops.mkldnn, "_nbytes", None)
        self.nbytes += int(nbytes(packed)) if nbytes is not None else weight.numel() * weight.element_size()

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)``, through ``weight``'s blocked copy where it has one (the
        same tensor object it was packed from; a view or a copy of it gets ``F.linear``)."""
        entry = self._packed.get(id(weight))
        return F.linear(x, weight) if entry is None or entry[0] is not weight else _apply(x, entry[1])

    def blocked(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight``'s blocked copy (None where it has none: a view or a copy of the
        tensor that was packed has none)."""
        entry = self._packed.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedWeights:
        # oneDNN's blocked tensors cannot be copied; they are never written, so a copy may
        # share them (a deep-copied decoder's own weights are other objects: F.linear).
        return self


def pack(weights: Sequence[torch.Tensor]) -> tuple[PackedWeights | None, str | None]:
    """Checked blocked copies of ``weights`` (bf16, on the CPU), or None and why not."""
    if not weights:
        return None, "no weights"
    first = weights[0]
    if first.dtype != torch.bfloat16:
        return None, f"weights are {str(first.dtype).removeprefix('torch.')}, not bfloat16"
    if first.device.type != "cpu":
        return None, f"weights are on {first.device.type}, not the CPU"
    if not ops_available():
        return None, "oneDNN here has no bf16 matrix kernels"
    packed = PackedWeights()
    checked: set[tuple[int, ...]] = set()
    try:
        with torch.inference_mode():
            for weight in weights:
                if id(weight) in packed._packed:
                    continue  # tied: one copy
                blocked = _pack(weight)
                if tuple(weight.shape) not in checked:
                    checked.add(tuple(weight.shape))
                    failed = packs_exactly(weight, blocked)
                    if failed is not None:
                        return None, failed
                packed.add(weight, blocked)
    except _FAILURES as exc:
        return None, f"oneDNN could not pack the weights: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return packed, None
