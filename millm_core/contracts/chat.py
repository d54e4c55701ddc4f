"""``POST /v1/chat/completions``: request, response and stream chunk."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from .common import FinishReason, SamplingFields, Usage

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a multi-part message content; only text parts exist on millm."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of the conversation. ``content`` is a string, a list of text parts,
    or null (an assistant message that only carried tool calls)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | UnsetType = UNSET
    tool_calls: list[dict[str, Any]] | None | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET
    # An assistant turn's reasoning, as a reply returned it (a plugin renders it when the
    # model's template reads it; otherwise it is reported unused).
    reasoning_content: str | None | UnsetType = UNSET

    def text(self) -> str:
        """The content as one string (text parts joined without separator)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Conversation = Annotated[list[ChatMessage], Meta(min_length=1)]


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """A chat completion request: OpenAI's fields that the core serves (plugins add theirs).
    ``extra_messages`` (a millm extension): more conversations, each served as its own
    choice (index 1, 2, … after ``messages``), in one batch."""

    messages: Conversation
    extra_messages: list[Conversation] | None | UnsetType = UNSET  # --max-rows-per-request bounds them
    chat_template_kwargs: dict[str, Any] | None | UnsetType = UNSET

    def conversations(self) -> list[list[ChatMessage]]:
        """``messages``, then each of ``extra_messages``."""
        extra = self.extra_messages if isinstance(self.extra_messages, list) else []
        return [self.messages, *extra]


# A chat choice may also end because the model called tools.
ChatFinishReason = FinishReason | Literal["tool_calls"]


class FunctionCall(msgspec.Struct, kw_only=True):
    """A function the model called: its name and its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call of an assistant message (OpenAI's shape; ``id`` is ``call_…``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """One tool call in a stream chunk: millm sends each call whole, in one delta."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The generated message of one choice. ``content`` is null when the reply was only
    tool calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # The model's reasoning, apart from the answer (models whose template has a reasoning block).
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a non-streamed chat completion: its generated message and why generation ended (``stop``, ``length`` or
    ``tool_calls``). ``logprobs`` is always null (scoring mode answers with its own shapes)."""

    index: int
    message: AssistantMessage
    finish_reason: ChatFinishReason
    logprobs: None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, kw_only=True):
    """What one stream chunk adds to a choice's message."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """One choice in a chat stream chunk: what the chunk adds to its message (``delta``); ``finish_reason`` is null until the
    chunk that ends the choice. ``logprobs`` is always null."""

    index: int
    delta: ChatDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE frame of a streamed chat completion. The final content chunk carries
    ``finish_reason`` and ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType = UNSET
