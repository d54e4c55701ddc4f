"""The Responses API's request: the fields ``/v1/responses`` reads itself, and the input
items it turns into chat messages. Fields it does not declare travel to the chat request
unchanged (``model`` and the sampling fields, millm's extensions), where chat honours,
reports or refuses them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from millm_plugins.tools.public import FunctionName

Role = Literal["user", "assistant", "system", "developer"]


class InputText(msgspec.Struct, tag_field="type", tag="input_text", kw_only=True):
    """Text a user, system or developer message carries."""

    text: str


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    """Text an assistant message carries (as a response's output returned it)."""

    text: str
    annotations: list[Any] | UnsetType = UNSET
    logprobs: list[Any] | None | UnsetType = UNSET


class RefusalText(msgspec.Struct, tag_field="type", tag="refusal", kw_only=True):
    """An assistant's refusal, rendered as its text."""

    refusal: str


ContentPart = InputText | OutputText | RefusalText


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    """A message of the conversation (``type`` may be left out)."""

    role: Role
    content: str | list[ContentPart]
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET
    phase: str | None | UnsetType = UNSET

    def text(self) -> str:
        """The message's text: its parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, RefusalText) else p.text for p in self.content)


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    """A call the model made: an assistant turn's ``tool_calls`` entry."""

    call_id: Annotated[str, Meta(min_length=1)]
    name: str
    arguments: str
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET


class FunctionCallOutputItem(msgspec.Struct, tag_field="type", tag="function_call_output", kw_only=True):
    """What a call returned: a ``tool`` message answering ``call_id``."""

    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[InputText | OutputText]
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET

    def text(self) -> str:
        """What the call returned, as text: its parts joined."""
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextPart(msgspec.Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    """The reasoning's own text."""

    text: str


class SummaryTextPart(msgspec.Struct, tag_field="type", tag="summary_text", kw_only=True):
    """A summary of the reasoning (millm writes none; a client may send one back)."""

    text: str


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    """The model's reasoning before an assistant turn: rendered as that turn's
    ``reasoning_content``, from ``encrypted_content`` when it carries one."""

    summary: list[SummaryTextPart] = msgspec.field(default_factory=list)
    content: list[ReasoningTextPart] | None | UnsetType = UNSET
    encrypted_content: str | None | UnsetType = UNSET
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[msgspec.Struct]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
PART_TYPES: dict[str, type[msgspec.Struct]] = {"input_text": InputText, "output_text": OutputText, "refusal": RefusalText}


class FunctionTool(msgspec.Struct, tag_field="type", tag="function", kw_only=True):
    """A function the model may call (the only tool type millm offers)."""

    name: FunctionName
    description: str | None | UnsetType = UNSET
    parameters: dict[str, Any] | None | UnsetType = UNSET
    strict: bool | None | UnsetType = UNSET


class FunctionChoice(msgspec.Struct, tag_field="type", tag="function", kw_only=True):
    """``tool_choice`` naming the function the model must call."""

    name: FunctionName


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class PlainText(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    """Free text (the default)."""


class JsonObject(msgspec.Struct, tag_field="type", tag="json_object", kw_only=True):
    """Any one JSON object."""


class JsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    """A JSON document that validates against ``schema`` (structured output)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any]
    description: str | None | UnsetType = UNSET
    strict: bool | None | UnsetType = UNSET


TextFormat = PlainText | JsonObject | JsonSchema


class TextConfig(msgspec.Struct, kw_only=True):
    """``text``: the output's format (and OpenAI's verbosity hint, ``medium`` only)."""

    format: TextFormat | None | UnsetType = UNSET
    verbosity: Literal["low", "medium", "high"] | None | UnsetType = UNSET


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """``reasoning``: ``effort`` becomes chat's ``reasoning_effort``; a ``summary`` is
    reported unused (the reasoning itself comes back, never a summary of it)."""

    effort: str | None | UnsetType = UNSET
    summary: Literal["auto", "concise", "detailed"] | None | UnsetType = UNSET
    generate_summary: Literal["auto", "concise", "detailed"] | None | UnsetType = UNSET


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: millm pads no events, so ``include_obfuscation`` is reported unused."""

    include_obfuscation: bool | None | UnsetType = UNSET


MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]
Include = Literal["reasoning.encrypted_content"]
ENCRYPTED = "reasoning.encrypted_content"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``. ``model``, ``temperature``, ``top_p`` and
    ``parallel_tool_calls`` mean what they mean on chat and are passed to it as sent, like
    every field this type does not declare (millm's extensions among them). ``input`` may
    be left out (a follow-up of ``previous_response_id`` with new ``instructions`` only)."""

    model: str
    input: str | list[InputItem] | UnsetType = UNSET
    instructions: str | None | UnsetType = UNSET
    max_output_tokens: Annotated[int, Meta(ge=1)] | None | UnsetType = UNSET
    temperature: float | None | UnsetType = UNSET
    top_p: float | None | UnsetType = UNSET
    tools: list[FunctionTool] | None | UnsetType = UNSET
    tool_choice: ToolChoice | None | UnsetType = UNSET
    parallel_tool_calls: bool | None | UnsetType = UNSET
    text: TextConfig | None | UnsetType = UNSET
    reasoning: ReasoningConfig | None | UnsetType = UNSET
    include: list[Include] | None | UnsetType = UNSET
    stream: bool | None | UnsetType = UNSET
    stream_options: ResponsesStreamOptions | None | UnsetType = UNSET
    store: bool | None | UnsetType = UNSET
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None | UnsetType = UNSET
    previous_response_id: str | None | UnsetType = UNSET
    # Accepted with the value that asks for nothing; anything else is refused by name.
    background: bool | None | UnsetType = UNSET
    truncation: Literal["auto", "disabled"] | None | UnsetType = UNSET
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None | UnsetType = UNSET
    max_tool_calls: Annotated[int, Meta(ge=1)] | None | UnsetType = UNSET
    conversation: Any | UnsetType = UNSET
    prompt: Any | UnsetType = UNSET
    context_management: Any | UnsetType = UNSET


DECLARED = frozenset(ResponsesRequest.__struct_fields__)
