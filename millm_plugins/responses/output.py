"""A chat completion → the Response object: the reasoning (``message.reasoning_content``),
the message (``content``), function calls (``tool_calls``), in that order; the status from
the finish reason; usage in the Responses names; the request's settings echoed; the
chat reply's extension keys, and its choice's own keys, carried over at the top level.

The streamed response (:mod:`.events`) ends with the same items, by the same rules
(:func:`wants_message`, :func:`mark_cut`): one reasoning item, one message, the calls."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from .objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputTextContent,
    ReasoningTextContent,
    ResponseObject,
    Status,
    choice_extensions,
    finished,
    new_id,
    usage_of,
    with_extensions,
)
from .schema import TextConfig
from .sealing import Sealer
from .translate import Translation

# The keys of a chat completion (or chunk) that the Response has its own place for.
CHAT_KEYS = frozenset({"id", "object", "created", "model", "system_fingerprint", "choices", "usage"})


def _set(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def started(translation: Translation, model: str) -> ResponseObject:
    """The response before any output: ``in_progress``, with the request's settings."""
    request = translation.request
    tools = [
        {"type": "function", "name": t.name, "description": t.description if _set(t.description) else None,
         "parameters": t.parameters if _set(t.parameters) else None, "strict": t.strict if _set(t.strict) else None}
        for t in (request.tools or [])
    ]  # fmt: skip
    reasoning = request.reasoning
    text = request.text
    fmt = text.format if isinstance(text, TextConfig) and _set(text.format) else None
    return ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        status="in_progress",
        model=model,
        instructions=request.instructions if isinstance(request.instructions, str) else None,
        max_output_tokens=request.max_output_tokens if isinstance(request.max_output_tokens, int) else None,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id if isinstance(request.previous_response_id, str) else None,
        reasoning=msgspec.to_builtins(reasoning) if reasoning is not None and _set(reasoning) else None,
        store=translation.store,
        temperature=request.temperature if isinstance(request.temperature, int | float) else None,
        top_p=request.top_p if isinstance(request.top_p, int | float) else None,
        text={"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        tool_choice=msgspec.to_builtins(request.tool_choice) if _set(request.tool_choice) else "auto",
        tools=tools,
        metadata=dict(request.metadata) if isinstance(request.metadata, dict) else {},
    )


def reasoning_item(text: str, status: Status, sealer: Sealer | None, encrypted: bool, item_id: str | None = None) -> OutputReasoning:
    """A reasoning output item; sealed as well when the request asked for it."""
    item = OutputReasoning(id=item_id or new_id("rs"), status=status, content=[ReasoningTextContent(text=text)])
    if encrypted and sealer is not None:
        item.encrypted_content = sealer.seal(text)
    return item


def function_call(call: dict[str, Any], status: Status) -> OutputFunctionCall:
    """A function call item from a chat tool call (a call with no id is given one: a stored
    conversation never holds an empty ``call_id``)."""
    function = call.get("function") or {}
    call_id = call.get("id")
    return OutputFunctionCall(
        id=new_id("fc"),
        call_id=call_id if isinstance(call_id, str) and call_id else new_id("call"),
        name=str(function.get("name", "")),
        arguments=str(function.get("arguments", "")),
        status=status,
    )


def wants_message(has_text: bool, has_reasoning: bool, has_calls: bool, status: Status) -> bool:
    """Whether the output has a message item: when the model wrote text, or else when it
    neither called a function nor was cut off while reasoning (then the reasoning item is
    the one left incomplete, with no message after it, as OpenAI answers)."""
    return has_text or not (has_calls or (has_reasoning and status == "incomplete"))


def mark_cut(output: list[OutputItem], status: Status) -> None:
    """Mark the item the budget cut short ``incomplete``: the last one, unless it is a
    function call (calls are parsed whole when they close, so none is ever cut)."""
    if status == "incomplete" and output and not isinstance(output[-1], OutputFunctionCall):
        output[-1].status = "incomplete"


def from_completion(translation: Translation, completion: dict[str, Any], sealer: Sealer | None) -> dict[str, Any]:
    """The Response for a (non-streamed) chat completion, as plain data."""
    choice = completion["choices"][0]
    message = choice.get("message") or {}
    response = started(translation, str(completion.get("model", "")))
    finished(response, choice.get("finish_reason"))
    output: list[OutputItem] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(reasoning, "completed", sealer, translation.encrypted))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if wants_message(bool(content), bool(output), bool(calls), response.status):
        output.append(OutputMessage(id=new_id("msg"), status="completed", content=[OutputTextContent(text=content or "")]))
    output.extend(function_call(call, "completed") for call in calls)
    mark_cut(output, response.status)
    response.output = output
    response.usage = usage_of(completion.get("usage"))
    extensions = {**choice_extensions(choice), **{k: v for k, v in completion.items() if k not in CHAT_KEYS}}
    return with_extensions(response, extensions)
