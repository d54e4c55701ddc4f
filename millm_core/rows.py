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
    # Text for other message fields this step (``{"reasoning_content": "..."}``).
    side: dict[str, str] | None = None
    # Tokens the row takes back after this step (the engine rewinds it by that many).
    rewind: int = 0
    # As the row ended: counts for ``usage.completion_tokens_details`` and fields of the
    # choice itself (beside ``message``).
    usage: dict[str, int] | None = None
    choice: dict[str, Any] | None = None
    # As the row ended: prompt tokens its prefill resumed from retained state (see
    # :class:`~millm_core.engine.PrefixReusing`).
    cached_tokens: int = 0


# How many of its latest tokens a row can take back (the detokenizer remembers that many).
REWIND_HISTORY = 256


def _method(proc: object, name: str) -> Any:
    found = getattr(proc, name, None)
    return found if callable(found) else None


class RowDriver:
    """Drives one row: ``bias()`` before each step, ``accept(token)`` after it.

    A processor that *owns* the row (its optional ``owns_row()`` is true) hides the row
    from the processors after it: they are not asked for biases or masks and see no
    tokens until it lets go (a reasoning block is not the answer that ``stop``, tool
    calls or a JSON constraint govern), except those with ``whole_row = True``, which see
    every token (penalties). Only such a processor may take tokens back."""

    __slots__ = (
        "row",
        "_detok",
        "_processors",
        "_masks",
        "_listeners",
        "_owners",
        "_whole",
        "_side",
        "_takers",
        "_turns",
        "_eos",
        "_budget",
        "generated",
        "finish_reason",
        "constrained",
        "cached_tokens",
    )

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
        self._processors = tuple(processors)
        # Processors that constrain which tokens may come next (the optional
        # ``allowed_tokens`` method of the per-token stage).
        self._masks = tuple(p for p in self._processors if _method(p, "allowed_tokens"))
        self.constrained = bool(self._masks)
        # Processors that read the row's residual vectors (``on_residuals``).
        self._listeners = tuple(p for p in self._processors if _method(p, "on_residuals"))
        self._owners = frozenset(id(p) for p in self._processors if _method(p, "owns_row"))
        # Processors an owner never hides the row from (``whole_row = True``: penalties
        # count every token drawn).
        self._whole = frozenset(id(p) for p in self._processors if getattr(p, "whole_row", False) is True)
        self._side = frozenset(id(p) for p in self._processors if _method(p, "side_text"))
        self._takers = tuple(p for p in self._processors if _method(p, "take_back"))
        self._turns = tuple(p for p in self._processors if _method(p, "end_of_turn"))
        self._detok = Detokenizer(decode, history=REWIND_HISTORY if self._takers else 0)
        self._eos = eos_token_ids
        self._budget = max_new_tokens
        self.generated = 0
        self.finish_reason: str | None = None
        # Prompt tokens the engine's prefill resumed for this row; None until it says.
        self.cached_tokens: int | None = None

    def _owner(self) -> int | None:
        """The position of the first processor that owns the row now, or None."""
        if self._owners:
            for index, proc in enumerate(self._processors):
                if id(proc) in self._owners and proc.owns_row():  # type: ignore[attr-defined]
                    return index
        return None

    def _active(self) -> Sequence[TokenProcessor]:
        """The processors that govern the next token: all of them, or those up to and
        including the first one that owns the row, and the whole-row ones after it."""
        owner = self._owner()
        if owner is None:
            return self._processors
        return self._processors[: owner + 1] + tuple(p for p in self._processors[owner + 1 :] if id(p) in self._whole)

    def bias(self) -> dict[int, float] | None:
        """The summed logit bias of this row's processors for the next step."""
        merged: dict[int, float] | None = None
        for proc in self._active():
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
        active = self._active()
        for proc in self._masks:
            if active is not self._processors and proc not in active:
                continue
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

    def _side_of(self, proc: TokenProcessor, side: dict[str, str] | None) -> dict[str, str] | None:
        if id(proc) not in self._side:
            return side
        part: Mapping[str, str] | None = proc.side_text()  # type: ignore[attr-defined]
        if not part:
            return side
        side = side if side is not None else {}
        for key, value in part.items():
            if value:
                side[key] = side.get(key, "") + value
        return side or None

    def accept(self, token_id: int) -> RowEvent:
        """Take the token sampled for this row and say what to emit."""
        self.generated += 1
        if token_id in self._eos:
            active = self._active()
            if self.generated < self._budget and any(
                p.end_of_turn(token_id) for p in self._turns if p in active  # type: ignore[attr-defined]
            ):
                return RowEvent(self.row, "", rewind=1)  # the end of turn is taken back, never fed
            return self._finish("stop", "", stopped_at=None)
        text = self._detok.push(token_id)
        side: dict[str, str] | None = None
        owner = self._owner()  # who owned the row when this token was drawn
        for index, proc in enumerate(self._processors):
            token = token_id
            if owner is not None and index > owner and id(proc) not in self._whole:
                # The owner's token: the processors after it get only the text it let go
                # (as it hands the row back), as text with no token.
                if not text:
                    continue
                token = -1
            text, stop = proc.on_token(token, text)
            side = self._side_of(proc, side)
            if stop:
                return self._finish("stop", text, stopped_at=index, side=side)
        rewind = self._taken_back()
        if self.generated >= self._budget:
            return self._finish("length", text, stopped_at=None, side=side)
        return RowEvent(self.row, text, side=side, rewind=rewind)

    def _taken_back(self) -> int:
        """Tokens a processor takes back after this step (the detokenizer forgets them;
        processors before the one that asked and keep per-token state hear it)."""
        total = 0
        for taker in self._takers:
            k = int(taker.take_back())  # type: ignore[attr-defined]
            if k <= 0:
                continue
            self._detok.rewind(k)
            before = True
            for proc in self._processors:
                if proc is taker:
                    before = False
                    continue
                hear = _method(proc, "on_rewind")
                if hear is not None and (before or id(proc) in self._whole):  # those that saw the tokens
                    hear(k)
            total += k
        return total

    def cancel(self) -> None:
        self.finish_reason = self.finish_reason or "cancelled"

    def _finish(self, reason: str, text: str, *, stopped_at: int | None, side: dict[str, str] | None = None) -> RowEvent:
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
            side = self._side_of(proc, side)
        fields: dict[str, Any] | None = None
        usage: dict[str, int] | None = None
        choice: dict[str, Any] | None = None
        for proc in self._processors:
            end = _method(proc, "end")
            said: RowEnd | None = end(reason) if end is not None else None
            if said is not None:
                fields = {**(fields or {}), **said.fields}
                reason = said.finish_reason or reason
                if said.usage:
                    usage = {**(usage or {}), **said.usage}
                if said.choice:
                    choice = {**(choice or {}), **said.choice}
        self.finish_reason = reason
        return RowEvent(self.row, emitted + carry, reason, fields, side=side, usage=usage, choice=choice, cached_tokens=self.cached_tokens or 0)
