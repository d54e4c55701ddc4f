"""The loop guard's detector: a span of reasoning tokens repeated back to back.

A loop is the latest ``p * r`` tokens made of ``r`` copies of one span of ``p`` tokens,
with ``p <= max_period`` and ``r`` at least ``min_repeats`` and enough copies to cover
``min_tokens`` (one token repeated 16 times, a two-token span 8 times, a span of six or
more three times). The guard takes the last copy back and bans the token that began it
for the step that redraws it, so the row goes on differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoopGuard:
    """Thresholds of the detector. ``max_rewinds`` bounds how often one row is taken back
    (then the guard stands down and the token budget ends a row that keeps looping)."""

    max_period: int = 32
    min_repeats: int = 3
    min_tokens: int = 16
    max_rewinds: int = 32

    @property
    def window(self) -> int:
        """The most recent tokens a row must keep to itself: a copy taken back is never
        longer than this, so their text is held back until they are older."""
        return self.max_period

    @property
    def history(self) -> int:
        """How many of the latest ids the detector reads."""
        return max(self.max_period * self.min_repeats, self.min_tokens)

    def period(self, ids: Sequence[int]) -> int:
        """The span length of a loop that ends with the latest token, or 0."""
        n = len(ids)
        if n < self.min_tokens:
            return 0
        last = ids[-1]
        for p in range(1, min(self.max_period, n // self.min_repeats) + 1):
            if ids[-1 - p] != last:
                continue
            repeats = max(self.min_repeats, -(-self.min_tokens // p))
            span = p * repeats
            if span > n:
                continue
            start = n - span
            if all(ids[i] == ids[i + p] for i in range(start, n - p)):
                return p
        return 0
