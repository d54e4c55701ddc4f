"""``POST /v1/chat/completions``."""

from __future__ import annotations

from typing import Any

import msgspec

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


def _message(text: str, fields: dict[str, Any] | None) -> AssistantMessage:
    """A choice's message: its text, plus the fields processors added as it ended (a
    reply that is only tool calls has ``content: null``)."""
    if not fields:
        return AssistantMessage(content=text)
    content = text if text or "tool_calls" not in fields else None
    return msgspec.convert({**fields, "role": "assistant", "content": content}, AssistantMessage)


def _full(
    rid: str,
    created: int,
    model: str,
    fingerprint: str,
    texts: list[str],
    reasons: list[str],
    usage: Usage,
    fields: list[dict[str, Any] | None] | None = None,
) -> ChatCompletionResponse:
    extra = fields or [None] * len(texts)
    choices = [
        ChatChoice(index=i, message=_message(text, extra[i]), finish_reason=reasons[i])  # type: ignore[arg-type]
        for i, text in enumerate(texts)
    ]
    return ChatCompletionResponse(id=rid, created=created, model=model, system_fingerprint=fingerprint, choices=choices, usage=usage)


def _chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    reason: str | None,
    first: bool,
    usage: Usage | None,
    fields: dict[str, Any] | None = None,
) -> ChatCompletionChunk:
    if first:
        delta = ChatDelta(role="assistant", content="")
    elif fields:
        delta = msgspec.convert({**fields, **({"content": text} if text else {})}, ChatDelta)
    else:
        delta = ChatDelta(content=text) if text else ChatDelta()
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason)  # type: ignore[arg-type]
    chunk = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
    if usage is not None:
        chunk.usage = usage
    return chunk


SHAPES = Shapes(id_prefix="chatcmpl", full=_full, chunk=_chunk)
