"""``POST /v1/chat/completions``."""

from __future__ import annotations

from ...contracts.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
)
from ...contracts.common import Usage
from ..respond import Shapes


def _full(rid: str, created: int, model: str, fingerprint: str, texts: list[str], reasons: list[str], usage: Usage) -> ChatCompletionResponse:
    choices = [
        ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=reasons[i])  # type: ignore[arg-type]
        for i, text in enumerate(texts)
    ]
    return ChatCompletionResponse(id=rid, created=created, model=model, system_fingerprint=fingerprint, choices=choices, usage=usage)


def _chunk(rid: str, created: int, model: str, index: int, text: str | None, reason: str | None, first: bool, usage: Usage | None) -> ChatCompletionChunk:
    if first:
        delta = ChatDelta(role="assistant", content="")
    else:
        delta = ChatDelta(content=text) if text else ChatDelta()
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason)  # type: ignore[arg-type]
    chunk = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
    if usage is not None:
        chunk.usage = usage
    return chunk


SHAPES = Shapes(id_prefix="chatcmpl", full=_full, chunk=_chunk)

