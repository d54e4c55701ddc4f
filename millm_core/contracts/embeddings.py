"""``POST /v1/embeddings``: request and response."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from .common import Usage


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """One vector per input string, pooled from the model's last hidden layer. Plugins
    add their fields (``pooling``, ``normalize``)."""

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] | None | UnsetType = UNSET

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingItem(msgspec.Struct, kw_only=True):
    """One vector: a list of floats, or base64 of little-endian float32."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    """Tokens read (embeddings generate nothing, so both counts are equal)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``'s answer: one item per input, in input order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


__all__ = ["EmbeddingItem", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage", "Usage"]
