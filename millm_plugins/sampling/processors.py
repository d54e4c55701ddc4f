"""Token processors for stop sequences and OpenAI-style penalties (engine-agnostic)."""

from __future__ import annotations

from collections.abc import Sequence


class StopSequences:
    """Ends a row before the first stop sequence to appear in its text; the sequence is
    never emitted. Text that might be the start of a stop sequence is held back until it
    is known not to be one, so a stop split across tokens is caught while streaming."""

    __slots__ = ("_stops", "_buffer", "_done")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        self._stops = tuple(stops)
        self._buffer = ""
        self._done = False

    def logit_bias(self) -> None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        if self._done:
            return "", False
        buffer = self._buffer + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._buffer = ""
            self._done = True
            return buffer[: min(hits)], True
        held = self._held_suffix(buffer)
        self._buffer = buffer[len(buffer) - held :] if held else ""
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out

    def _held_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:size]):
                    best = size
                    break
        return best


class Penalties:
    """OpenAI's frequency and presence penalties over the tokens this row generated:
    ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``."""

    __slots__ = ("_frequency", "_presence", "_counts", "_ids")

    # Penalties read every token the row draws, a reasoning block's included (a row owner
    # does not hide the row from it).
    whole_row = True

    def __init__(self, frequency: float, presence: float) -> None:
        self._frequency = frequency
        self._presence = presence
        self._counts: dict[int, int] = {}
        self._ids: list[int] = []  # the row's tokens in order, to forget those taken back

    def logit_bias(self) -> dict[int, float] | None:
        if not self._counts:
            return None
        f, p = self._frequency, self._presence
        return {tok: -(f * count + p) for tok, count in self._counts.items()}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        if token_id >= 0:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
            self._ids.append(token_id)
        return text, False

    def on_rewind(self, k: int) -> None:
        """The row's latest ``k`` tokens were taken back: they no longer count."""
        for token in self._ids[len(self._ids) - k :]:
            self._counts[token] -= 1
            if not self._counts[token]:
                del self._counts[token]
        del self._ids[len(self._ids) - k :]

    def flush(self) -> str:
        return ""
