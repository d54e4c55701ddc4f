"""RowDriver: everything that happens to one generated row around the engine's sampling.

It turns sampled ids into text (incrementally), runs the row's token processors, applies
end-of-sequence and the token budget, and records the finish reason. Engines stay free of
this logic, so every engine behaves the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .detokenize import Decode, Detokenizer
from .engine import Readout, RowEnd, TokenProcessor


@dataclass(slots=True)
class RowEvent:
    """What one step produced for one row: text to emit and, when the row ended, why."""

    row: int
    text: str
    finish_reason: str | None = None
    # Message fields processors added as the row ended (for example ``tool_calls``).
    fields: dict[str, Any] | None = None


class RowDriver:
    """Drives one row: ``bias()`` before each step, ``accept(token)`` after it."""

    __slots__ = ("row", "_detok", "_processors", "_masks", "_listeners", "_eos", "_budget", "generated", "finish_reason", "constrained")

    def __init__(
        self,
        row: int,
        *,
        decode: Decode,
        processors: Sequence[TokenProcessor],
        eos_token_ids: frozenset[int],
        max_new_tokens: int,
    ) -> None:
        self.row = row
        self._detok = Detokenizer(decode)
        self._processors = tuple(processors)
        # Processors that constrain which tokens may come next (the optional
        # ``allowed_tokens`` method of the per-token stage).
        self._masks = tuple(p for p in self._processors if callable(getattr(p, "allowed_tokens", None)))
        self.constrained = bool(self._masks)
        # Processors that read the row's residual vectors (``on_residuals``).
        self._listeners = tuple(p for p in self._processors if callable(getattr(p, "on_residuals", None)))
        self._eos = eos_token_ids
        self._budget = max_new_tokens
        self.generated = 0
        self.finish_reason: str | None = None

    def bias(self) -> dict[int, float] | None:
        """The summed logit bias of this row's processors for the next step."""
        merged: dict[int, float] | None = None
        for proc in self._processors:
            part: Mapping[int, float] | None = proc.logit_bias()
            if not part:
                continue
            if merged is None:
                merged = dict(part)
            else:
                for tok, val in part.items():
                    merged[tok] = merged.get(tok, 0.0) + val
        return merged

    def allowed(self) -> Any:
        """The token ids this row may draw next (a 1-D integer array), or None when no
        processor constrains it; several constraints intersect."""
        merged: Any = None
        for proc in self._masks:
            part = proc.allowed_tokens()  # type: ignore[attr-defined]
            if part is None:
                continue
            ids = np.asarray(part, dtype=np.int64)
            merged = ids if merged is None else np.intersect1d(merged, ids, assume_unique=False)
        return merged

    def read(self, readout: Readout) -> None:
        """Hand the residual vectors the engine read for this row at this step to the
        processors that listen (before ``accept`` of the step's token)."""
        for proc in self._listeners:
            proc.on_residuals(readout)  # type: ignore[attr-defined]

    def accept(self, token_id: int) -> RowEvent:
        """Take the token sampled for this row and say what to emit."""
        self.generated += 1
        if token_id in self._eos:
            return self._finish("stop", "", stopped_at=None)
        text = self._detok.push(token_id)
        for index, proc in enumerate(self._processors):
            text, stop = proc.on_token(token_id, text)
            if stop:
                return self._finish("stop", text, stopped_at=index)
        if self.generated >= self._budget:
            return self._finish("length", text, stopped_at=None)
        return RowEvent(self.row, text)

    def cancel(self) -> None:
        self.finish_reason = self.finish_reason or "cancelled"

    def _finish(self, reason: str, text: str, *, stopped_at: int | None) -> RowEvent:
        """End the row. Text still held back is released through the processors that
        have not seen it yet: after EOS or the budget, the detokenizer's tail goes
        through every processor; after processor ``stopped_at`` stopped the row, only
        the text it let through goes on, through the processors after it."""
        if stopped_at is None:
            emitted, carry, start = text, self._detok.flush(), 0
        else:
            emitted, carry, start = "", text, stopped_at + 1
        for proc in self._processors[start:]:
            stop = False
            if carry:
                carry, stop = proc.on_token(-1, carry)
            if stop:
                reason = "stop"
            else:
                carry += proc.flush()
        fields: dict[str, Any] | None = None
        for proc in self._processors:
            end = getattr(proc, "end", None)
            said: RowEnd | None = end(reason) if callable(end) else None
            if said is not None:
                fields = {**(fields or {}), **said.fields}
                reason = said.finish_reason or reason
        self.finish_reason = reason
        return RowEvent(self.row, emitted + carry, reason, fields)
