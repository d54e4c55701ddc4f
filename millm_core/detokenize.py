"""Incremental detokenisation: turn a growing list of token ids into text deltas.

Decoding each token alone breaks multi-byte characters and tokenizers that merge spaces
across tokens, so we decode a short window ending at the new token and emit only what is
new once it no longer ends in an incomplete character (U+FFFD). This is the
prefix/read-offset scheme used by text-generation-inference and vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    """Per-row incremental decoder over the generated ids only. With ``history`` it can
    also take back up to that many of its latest tokens (:meth:`rewind`)."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_history", "_states")

    def __init__(self, decode: Decode, history: int = 0) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # The offsets before each of the latest ``history`` pushes, newest last.
        self._history = history
        self._states: deque[tuple[int, int]] = deque(maxlen=history or None)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._history:
            self._states.append((self._prefix, self._read))
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def rewind(self, k: int) -> None:
        """Forget the latest ``k`` tokens as if they had never been pushed: the text they
        completed is the caller's to take back (it was returned by their pushes)."""
        if not 0 < k <= len(self._states):
            raise ValueError(f"cannot take back {k} tokens (at most {len(self._states)} are remembered)")
        for _ in range(k - 1):
            self._states.pop()
        self._prefix, self._read = self._states.pop()
        del self._ids[len(self._ids) - k :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character is emitted as is)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]
