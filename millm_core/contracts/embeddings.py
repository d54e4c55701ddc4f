"""``POST /v1/embeddings``: request and response."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from .common import Usage


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """One vector per input string, pooled from the model's last hidden layer."""

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] | None | UnsetType = UNSET
    pooling: Literal["mean", "last", "cls"] | None | UnsetType = UNSET
    normalize: bool | None | UnsetType = UNSET
    # Declared so that they are refused by name: no model declares truncated embeddings,
    # and embeddings always run in the served precision ("native" is accepted).
    dimensions: int | None | UnsetType = UNSET
    scoring_precision: str | None | UnsetType = UNSET

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingItem(msgspec.Struct, kw_only=True):
    """One vector: a list of floats, or base64 of little-endian float32."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


__all__ = ["EmbeddingItem", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage", "Usage"]
