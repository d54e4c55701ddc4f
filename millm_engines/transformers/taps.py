"""Reading rows' residual vectors back (the taps capability) on the transformers engine.

A row asks for taps in its :class:`~millm_core.api.RowSpec`; the batch keeps, per tap, the
indices of the rows that asked (:class:`TapSet`). Every forward pass — the HF forward for
prefills and the generic decode, the lean decode step — selects those rows' vectors at the
tapped blocks and nothing else: rows that asked for nothing cost no copy. ``pre_steering``
is a block's output before the row's delta at that block, ``post_steering`` after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from millm_core.api import Readout, Tap

# layer -> (rows reading pre_steering, rows reading post_steering); None: no row does.
LayerReads = dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
# Tap -> the selected rows' vectors, in the order of the TapSet's rows for that tap.
Captured = dict[Tap, torch.Tensor]


@dataclass(frozen=True)
class TapSet:
    """The taps of a batch's rows (row order) and, per tap, which rows read it."""

    per_row: tuple[tuple[Tap, ...], ...]
    rows: Mapping[Tap, tuple[int, ...]]
    by_layer: LayerReads

    @classmethod
    def build(cls, per_row: Sequence[tuple[Tap, ...]], device: torch.device, n_layers: int) -> TapSet | None:
        """None when no row has taps. Raises ValueError for a layer outside the model."""
        rows: dict[Tap, list[int]] = {}
        for r, taps in enumerate(per_row):
            for tap in taps:
                if not 0 <= tap.layer < n_layers:
                    raise ValueError(f"tap layer {tap.layer} is outside 0..{n_layers - 1}")
                rows.setdefault(tap, []).append(r)
        if not rows:
            return None
        by_layer: LayerReads = {}
        for layer in sorted({tap.layer for tap in rows}):
            pre, post = rows.get(Tap(layer, "pre_steering")), rows.get(Tap(layer, "post_steering"))
            by_layer[layer] = (
                torch.tensor(pre, dtype=torch.long, device=device) if pre else None,
                torch.tensor(post, dtype=torch.long, device=device) if post else None,
            )
        return cls(tuple(tuple(t) for t in per_row), {tap: tuple(r) for tap, r in rows.items()}, by_layer)


def capture(layer: int, reads: LayerReads, hidden: torch.Tensor, delta: torch.Tensor | None, captured: Captured) -> torch.Tensor:
    """Record the tapped rows of block ``layer``'s output ``hidden`` (``[rows, seq, d]``)
    before and after ``delta`` (``[rows, d]``) is added; returns the output with the delta."""
    pre, post = reads.get(layer, (None, None))
    if pre is not None:
        captured[Tap(layer, "pre_steering")] = hidden.index_select(0, pre)
    out = hidden + delta[:, None, :] if delta is not None else hidden
    if post is not None:
        captured[Tap(layer, "post_steering")] = out.index_select(0, post)
    return out


def block_hook(layer: int, delta: torch.Tensor | None, reads: LayerReads, captured: Captured) -> Any:
    """A forward hook on decoder block ``layer`` that adds the rows' steering delta and
    records the tapped rows (for one HF forward)."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        out = capture(layer, reads, hidden, delta, captured)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return hook


def readouts(taps: TapSet, captured: Captured, starts: Sequence[int], lengths: Sequence[int] | None) -> list[Readout | None]:
    """Each row's :class:`Readout` from one forward pass. ``captured[tap]`` holds
    ``[selected rows, seq, d]``; a prefill (``lengths`` given) was left-padded, so row
    ``r``'s positions are its last ``lengths[r]`` columns; a decode step read one column."""
    vectors: list[dict[Tap, Any]] = [{} for _ in taps.per_row]
    for tap, rows in taps.rows.items():
        block = captured[tap].detach().float().cpu().numpy()
        for j, r in enumerate(rows):
            vectors[r][tap] = block[j, block.shape[1] - lengths[r] :] if lengths is not None else block[j, -1:]
    return [Readout(start=starts[r], vectors=vectors[r]) if vectors[r] else None for r in range(len(taps.per_row))]
