"""A Responses request → the chat completion request that serves it.

What maps: ``input`` (and a stored conversation) and ``instructions`` → ``messages``;
``max_output_tokens`` → ``max_completion_tokens``; ``tools`` and ``tool_choice`` from the
Responses shape to chat's; ``text.format`` → ``response_format``; ``reasoning.effort`` →
``reasoning_effort``; ``stream``. Every field this API does not declare (``model``, the
sampling fields, millm's extensions, fields nobody knows) goes to chat as sent, where it
is honoured, reported in ``X-miLLM-Ignored-Fields`` or refused exactly as on chat.

What is refused here, by name, before anything runs: OpenAI's features millm does not
have (built-in tools, background responses, conversations, prompt templates, automatic
truncation, log-probabilities, …) and chat's own names for what this API names otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from millm_core.api import InvalidRequest, convert, unknown_fields

from .conversation import STORED, Conversation, add_items, renamer
from .schema import (
    DECLARED,
    ENCRYPTED,
    ITEM_TYPES,
    PART_TYPES,
    FunctionChoice,
    InputItem,
    JsonObject,
    JsonSchema,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from .sealing import Sealer

# Chat's names for what this API names otherwise: sending them here is a mistake.
CHAT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
# Chat fields whose result a Response has no place for, with the values that ask for nothing.
NO_PLACE: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1 and not isinstance(v, bool),
    "logprobs": lambda v: v is False,
    "echo": lambda v: v is False,
    "allowed_token_ids": lambda v: False,
    "return_tokens_as_token_ids": lambda v: v is False,
    "extra_messages": lambda v: v == [],
}
# Responses fields millm does not serve, refused unless their value asks for nothing.
NOT_SERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (lambda v: v is False, "background responses are not available; leave background out or send false"),
    "conversation": (lambda v: False, "the Conversations API is not available; send the history in input or use previous_response_id"),
    "prompt": (lambda v: False, "stored prompt templates are not available; send instructions and input"),
    "context_management": (lambda v: v == [], "context management (compaction) is not available"),
    "truncation": (lambda v: v == "disabled", 'automatic truncation is not available: a conversation that does not fit is refused (truncation: "disabled")'),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool), "log-probabilities are not available on /v1/responses"),
    "max_tool_calls": (lambda v: False, "max_tool_calls limits built-in tool calls, which millm does not have; parallel_tool_calls: false allows one call"),
}


@dataclass
class Translation:
    """A Responses request translated: the chat body, the request's own unused field
    locations, how chat's locations are named here, and what the Response echoes.
    ``store``: whether the response is kept (the request's ``store``, turned off by the
    route when the server keeps none, or when keeping it failed)."""

    chat: dict[str, Any]
    request: ResponsesRequest
    conversation: Conversation
    history: list[dict[str, Any]]  # the input items before this response's output (stored)
    reported: list[str] = field(default_factory=list)
    store: bool = True

    @property
    def rename(self) -> Callable[[str], str]:
        """Chat's field locations in this API's names."""
        return renamer(self.conversation)

    @property
    def unreported(self) -> Callable[[str], bool]:
        """Chat's unused field locations that lie in the stored conversation: reported when
        they were sent, never again on each follow-up."""
        return self.conversation.stored

    @property
    def encrypted(self) -> bool:
        """Whether reasoning items are sealed too (``include``)."""
        return ENCRYPTED in (self.request.include or [])


def _refuse(message: str, param: str, code: str = "unsupported_value") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def _sent(raw: dict[str, Any], name: str) -> bool:
    return name in raw and raw[name] is not None


def _check_names(raw: dict[str, Any]) -> None:
    """Refuse chat's own names, chat fields a Response cannot carry, and the Responses
    features millm does not serve."""
    for name, ours in CHAT_NAMES.items():
        if _sent(raw, name):
            raise _refuse(f"{name} is a chat completions field; on /v1/responses send {ours}", name, "invalid_parameter")
    for name, neutral in NO_PLACE.items():
        if _sent(raw, name) and not neutral(raw[name]):
            raise _refuse(f"{name} is not available on /v1/responses: a response has one output and no log-probabilities", name)
    for name, (neutral, why) in NOT_SERVED.items():
        if _sent(raw, name) and not neutral(raw[name]):
            raise _refuse(why, name)


def _check_tools(raw: dict[str, Any]) -> None:
    tools = raw.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise _refuse(f"{kind} is one of OpenAI's built-in tools; millm offers function tools only", f"tools[{index}].type")
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise _refuse(f'tool_choice {choice["type"]!r} is not available; send "none", "auto", "required" or a function', "tool_choice.type")


def _typed_items(raw: dict[str, Any]) -> list[str]:
    """Give input items that leave out ``type`` their type (a message), refuse item and
    content types millm does not serve, and return the unknown keys inside the items."""
    items = raw.get("input")
    if not isinstance(items, list):
        return []
    unknown: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        if "type" not in item and "role" in item:
            items[index] = item = {**item, "type": "message"}
        kind = item.get("type")
        type_ = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if type_ is None:
            raise _refuse(f"input items of type {kind!r} are not available; send message, function_call, function_call_output or reasoning items", f"input[{index}].type")
        # The walk goes into the item's parts too (their types are a tagged union).
        unknown.extend(f"input[{index}].{loc}" for loc in unknown_fields(item, type_))
        parts = item.get("content") if kind == "message" else item.get("output") if kind == "function_call_output" else None
        for number, part in enumerate(parts if isinstance(parts, list) else []):
            where = f"input[{index}].{'content' if kind == 'message' else 'output'}[{number}]"
            part_kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(part_kind, str) or part_kind not in PART_TYPES:
                raise _refuse(f"content parts of type {part_kind!r} are not available: millm serves text only", f"{where}.type")
    return unknown


def _unused(raw: dict[str, Any], request: ResponsesRequest) -> list[str]:
    """The request's own fields (below the top level) that nothing reads."""
    # Input items are walked with their parts where they are read (a message may omit its
    # type), so the walk over the body leaves them out.
    found = [loc for loc in unknown_fields(raw, ResponsesRequest) if ("." in loc or "[" in loc) and not loc.startswith("input[")]
    reasoning = request.reasoning
    if reasoning is not None and reasoning is not msgspec.UNSET:
        found.extend(f"reasoning.{name}" for name in ("summary", "generate_summary") if isinstance(getattr(reasoning, name), str))
    options = request.stream_options
    if options is not None and options is not msgspec.UNSET and options.include_obfuscation is True:
        found.append("stream_options.include_obfuscation")
    for index, item in enumerate(request.input if isinstance(request.input, list) else []):
        if isinstance(item, MessageItem) and isinstance(item.phase, str):
            found.append(f"input[{index}].phase")
    return found


def _check_verbosity(request: ResponsesRequest) -> None:
    text = request.text
    if text is not None and text is not msgspec.UNSET and text.verbosity not in (None, msgspec.UNSET, "medium"):
        raise _refuse("text.verbosity is not available: the model's answer length follows max_output_tokens alone", "text.verbosity")


def _chat_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The chat fields this API's own fields translate to."""
    out: dict[str, Any] = {}
    if isinstance(request.max_output_tokens, int):
        out["max_completion_tokens"] = request.max_output_tokens
    if isinstance(request.tools, list):
        out["tools"] = [{"type": "function", "function": _present(msgspec.to_builtins(tool))} for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, FunctionChoice):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, str) and (choice != "auto" or out.get("tools")):
        out["tool_choice"] = choice  # "auto" is this API's default: without tools it asks for nothing
    text = request.text
    fmt = text.format if text is not None and text is not msgspec.UNSET else None
    if isinstance(fmt, JsonObject):
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, JsonSchema):
        schema = _present({"name": fmt.name, "schema": fmt.schema, "description": fmt.description, "strict": fmt.strict})
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    reasoning = request.reasoning
    if reasoning is not None and reasoning is not msgspec.UNSET and isinstance(reasoning.effort, str):
        out["reasoning_effort"] = reasoning.effort
    if request.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def _present(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None and v is not msgspec.UNSET and k != "type"}


class _StoredItem(msgspec.Struct):
    """One stored item (a Struct, so that :func:`convert` names what is wrong in it)."""

    item: InputItem


def _stored_items(history: list[dict[str, Any]]) -> list[InputItem]:
    """The stored conversation's items. A reasoning item renders its stored text: it is
    kept in plain text beside the response (the database holds the key anyway), so a blob
    is never opened again, and a follow-up still works after the key changed."""
    items: list[InputItem] = []
    for index, raw in enumerate(history):
        data = raw
        if isinstance(raw, dict) and raw.get("type") == "reasoning" and raw.get("content"):
            data = {k: v for k, v in raw.items() if k != "encrypted_content"}
        try:
            items.append(convert({"item": data}, _StoredItem).item)
        except InvalidRequest as exc:
            raise InvalidRequest(f"the stored conversation's item {index} cannot be read: {exc}", param=STORED) from None
    return items


def _kept(item: InputItem, text: str | None) -> dict[str, Any]:
    """An input item as it is stored: a reasoning item that was sent sealed is kept with
    the text it rendered, in plain text, and without its blob."""
    data: dict[str, Any] = msgspec.to_builtins(item)
    if isinstance(item, ReasoningItem) and isinstance(item.encrypted_content, str) and text is not None:
        data.pop("encrypted_content", None)
        data["content"] = [{"type": "reasoning_text", "text": text}]
    return data


def translate(raw: dict[str, Any], history: list[dict[str, Any]], sealer: Sealer | None) -> Translation:
    """Translate a decoded body (``history``: the stored conversation that
    ``previous_response_id`` names, already read). Raises the 400s of this API."""
    raw = dict(raw)
    _check_names(raw)
    _check_tools(raw)
    if isinstance(raw.get("input"), list):
        raw["input"] = list(raw["input"])
    reported = _typed_items(raw)
    request = convert(raw, ResponsesRequest)
    _check_verbosity(request)
    reported.extend(_unused(raw, request))
    conversation = Conversation()
    if isinstance(request.instructions, str):
        conversation.system(request.instructions)
    add_items(conversation, [(item, STORED) for item in _stored_items(history)], sealer, report=False)
    items: list[InputItem]
    if isinstance(request.input, str):
        items = [MessageItem(role="user", content=request.input)]
    else:
        items = request.input if isinstance(request.input, list) else []
    located = [(item, f"input[{index}]" if isinstance(request.input, list) else "input") for index, item in enumerate(items)]
    texts = add_items(conversation, located, sealer)
    reported.extend(conversation.unused)
    chat = {name: value for name, value in raw.items() if name not in DECLARED}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls"):
        if name in raw:
            chat[name] = raw[name]
    chat.update(_chat_fields(request))
    chat["messages"] = conversation.messages
    new_items = [_kept(item, text) for item, text in zip(items, texts, strict=True)]
    return Translation(
        chat=chat, request=request, conversation=conversation, history=[*history, *new_items], reported=reported, store=request.store is not False
    )
