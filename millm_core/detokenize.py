"""Incremental detokenisation: turn a growing list of token ids into text deltas.

Decoding each token alone breaks multi-byte characters and tokenizers that merge spaces
across tokens, so we decode a short window ending at the new token and emit only what is
new once it no longer ends in an incomplete character (U+FFFD). This is the
prefix/read-offset scheme used by text-generation-inference and vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class Detokenizer:
    """Per-row incremental decoder over the generated ids only."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character is emitted as is)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]
