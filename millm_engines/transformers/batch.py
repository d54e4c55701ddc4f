"""The transformers engine's per-batch state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from millm_core.api import Readout, SamplingParams, Tap

from .fastpath import KVCache
from .rewind import PromptEnd
from .taps import TapSet


@dataclass
class HFBatch:
    """Per-batch state: KV cache, attention mask, per-row positions and params."""

    prompts: list[tuple[int, ...]]
    params: list[SamplingParams]
    started: bool = False
    cache: DynamicCache | None = None
    kv: KVCache | None = None
    mask: torch.Tensor | None = None
    next_pos: torch.Tensor | None = None
    last_tokens: torch.Tensor | None = None
    # Absolute position (prompt length + tokens generated) of each row's next draw.
    draw_pos: list[int] | None = None
    # layer -> [rows, d_model] steering deltas (zero rows for unsteered rows).
    deltas: dict[int, torch.Tensor] | None = None
    # Rows of other requests that joined after the prefill, prefilled when they joined;
    # their logits (``prefilled``) join the batch's at the next step.
    joining: list[HFBatch] = field(default_factory=list)
    prefilled: torch.Tensor | None = None
    # Per-row taps (row order), the rows reading each tap, and what the last forward read.
    row_taps: list[tuple[Tap, ...]] = field(default_factory=list)
    taps: TapSet | None = None
    reads: list[Readout | None] | None = None
    # For rewinds (see .rewind): each row's draws, its prefill's logits, and the rows
    # taken back to their prompt, whose last prompt token the next step re-feeds.
    drawn: list[list[int]] = field(default_factory=list)
    first_logits: list[torch.Tensor] = field(default_factory=list)
    refill: dict[int, PromptEnd] = field(default_factory=dict)
    # Prompt tokens each row's prefill resumed from the prefix cache (see .prefix).
    resumed: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.params)
