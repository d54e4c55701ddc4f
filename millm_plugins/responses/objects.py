"""The Response object and its output items, in OpenAI's shape, as ``/v1/responses``
answers, streams and stores them."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

import msgspec
import structlog
from msgspec import UNSET, UnsetType

from .schema import SummaryTextPart

log = structlog.get_logger("millm.responses")

Status = Literal["completed", "incomplete", "in_progress", "failed"]


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_…``, ``msg_…``, ``rs_…``, ``fc_…``."""
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputTextContent(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    """The assistant's text."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextContent(msgspec.Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    """The reasoning's text."""

    text: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    """The assistant's message (chat's ``message.content``)."""

    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextContent] = msgspec.field(default_factory=list)


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    """A call the model made (one of chat's ``tool_calls``)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class OutputReasoning(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    """The model's reasoning (chat's ``message.reasoning_content``). ``summary`` is always
    empty: the reasoning itself is in ``content``. ``encrypted_content`` is there when the
    request asked for it (``include``)."""

    id: str
    status: Status
    summary: list[SummaryTextPart] = msgspec.field(default_factory=list)
    content: list[ReasoningTextContent] = msgspec.field(default_factory=list)
    encrypted_content: str | UnsetType = UNSET


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """``cached_tokens``: prompt tokens resumed from kept state (0 when none);
    ``cache_write_tokens``: always 0 (millm has no prompt cache that bills writes)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """``reasoning_tokens``: output tokens spent reasoning; ``rewound_tokens``: tokens a
    loop guard took back (counted in ``output_tokens``; absent when none were)."""

    reasoning_tokens: int = 0
    rewound_tokens: int | UnsetType = UNSET


class ResponseUsage(msgspec.Struct, kw_only=True):
    """Token counts, from the chat reply's ``usage``."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response stopped early: ``max_output_tokens``."""

    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a response failed (a stream that failed after its 200)."""

    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response (``object: "response"``). Its output items are in the order the model
    wrote them: reasoning, the message, function calls. A stream's extension chunks, a
    reply's extension keys (``millm_steering``, ``millm``, …) and the chat choice's own
    keys (``thinking_budget_forced_at`` when the reasoning's close was forced, and any a
    plugin sets) are top-level keys beside these; one that would replace a field of the
    Response goes under ``millm_extensions`` instead."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    usage: ResponseUsage | None = None
    thinking_budget_forced_at: int | UnsetType = UNSET


class DeletedResponse(msgspec.Struct, kw_only=True):
    """The answer to ``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def usage_of(chat_usage: dict[str, Any] | None) -> ResponseUsage | None:
    """Chat's usage in the Responses names (details are 0 when chat reported none)."""
    if not chat_usage:
        return None
    prompt = chat_usage.get("prompt_tokens_details") or {}
    completion = chat_usage.get("completion_tokens_details") or {}
    rewound = completion.get("rewound_tokens")
    return ResponseUsage(
        input_tokens=int(chat_usage.get("prompt_tokens", 0)),
        input_tokens_details=InputTokensDetails(cached_tokens=int(prompt.get("cached_tokens", 0))),
        output_tokens=int(chat_usage.get("completion_tokens", 0)),
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=int(completion.get("reasoning_tokens", 0)), rewound_tokens=int(rewound) if rewound is not None else UNSET
        ),
        total_tokens=int(chat_usage.get("total_tokens", 0)),
    )


def finished(response: ResponseObject, finish_reason: str | None) -> None:
    """Set a response's final status from chat's finish reason: ``length`` is
    ``incomplete`` (``max_output_tokens``), anything else ``completed``."""
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    else:
        response.status = "completed"
        response.completed_at = int(time.time())


# A chat choice's keys that the Response has its own place for; any other (a plugin's,
# ``thinking_budget_forced_at``) becomes a top-level key.
CHOICE_KEYS = frozenset({"index", "message", "delta", "finish_reason", "logprobs"})
COLLIDED = "millm_extensions"


def choice_extensions(choice: dict[str, Any]) -> dict[str, Any]:
    """The keys a chat choice carries beside its own (``thinking_budget_forced_at``, …)."""
    return {key: value for key, value in choice.items() if key not in CHOICE_KEYS}


def with_extensions(response: ResponseObject, extensions: dict[str, Any]) -> dict[str, Any]:
    """The response as plain data, with the chat reply's extension keys at the top level.
    A key that is already a field of the response is never dropped: it goes under
    ``millm_extensions`` (and the collision is logged)."""
    data: dict[str, Any] = msgspec.to_builtins(response)
    moved: dict[str, Any] = {}
    for key, value in extensions.items():
        if key in data:
            log.warning("response_extension_collides", key=key, moved_to=COLLIDED)
            moved[key] = value
        else:
            data[key] = value
    if moved:
        kept = data.get(COLLIDED)
        data[COLLIDED] = {**kept, **moved} if isinstance(kept, dict) else moved
    return data
