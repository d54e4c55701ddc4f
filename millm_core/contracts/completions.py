"""``POST /v1/completions``: request, response and stream chunk."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from .common import FinishReason, SamplingFields, Usage

# No upper bound here: --max-rows-per-request governs rows (400 too_many_rows).
PromptList = Annotated[list[str], Meta(min_length=1)]


class CompletionRequest(SamplingFields, kw_only=True):
    """A text completion request. ``prompt`` is sent verbatim (no chat template);
    each prompt of a list gets its own choice."""

    prompt: str | PromptList
    add_special_tokens: bool | None | UnsetType = UNSET

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a non-streamed text completion: the generated text and why generation ended (``stop`` or ``length``).
    ``logprobs`` is always null (scoring mode answers with its own shapes)."""

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(msgspec.Struct, kw_only=True):
    """One choice in a text completion stream chunk: the text the chunk adds; ``finish_reason`` is null until the chunk that
    ends the choice. ``logprobs`` is always null."""

    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE frame of a streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | UnsetType = UNSET
