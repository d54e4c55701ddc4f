"""Wire Structs of scoring responses (OpenAI's legacy and chat logprobs shapes)."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from millm_core.contracts.common import Usage


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy shape, one entry per scored position (here: one)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionScoringChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: Literal["length"] = "length"
    logprobs: CompletionLogprobs | None = None


class CompletionScoringResponse(msgspec.Struct, kw_only=True):
    """A scored text completion: ``text`` is the most probable allowed next token."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionScoringChoice]
    usage: Usage
    scoring_precision: Literal["native", "float32"] | UnsetType = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class ScoredMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatScoringChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ScoredMessage
    finish_reason: Literal["length"] = "length"
    logprobs: ChatLogprobs | None = None


class ChatScoringResponse(msgspec.Struct, kw_only=True):
    """A scored chat: ``content`` is the most probable allowed next token."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatScoringChoice]
    usage: Usage
