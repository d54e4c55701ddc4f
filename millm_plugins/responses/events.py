"""A chat completion stream → the Responses event stream.

``response.created`` and ``response.in_progress`` open it. Each run of reasoning deltas
(``delta.reasoning_content``) becomes a reasoning item, each run of text deltas
(``delta.content``) a message item, each tool call a function call item: every item is
added, filled (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), finished (the matching ``.done`` events) and
done, in order. The finish chunk gives the status and usage; the closing extension chunks
(``{"choices": [], key: value}``) become top-level keys of the final response, sent with
``response.completed`` or ``response.incomplete``. A stream that fails after its 200 ends
with ``error`` and ``response.failed``. Every event carries its ``sequence_number``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from millm_core.api import encode

from .objects import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputTextContent,
    ResponseError,
    ResponseObject,
    Status,
    finished,
    new_id,
    usage_of,
    with_extensions,
)
from .output import CHAT_KEYS, function_call, reasoning_item
from .sealing import Sealer
from .translate import Translation

Event = dict[str, Any]


def sse(event: Event) -> bytes:
    """One event as SSE: its type as the event name, then its data."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + encode(event) + b"\n\n"


@dataclass
class _Open:
    """The item being streamed: a reasoning item or a message, and its text so far."""

    kind: Literal["reasoning", "message"]
    index: int
    id: str
    text: str = ""


class ResponseStream:
    """Turns one chat stream's frames into Responses events (:meth:`feed`, :meth:`end`,
    :meth:`fail`); ``final`` is the finished response, as plain data."""

    def __init__(self, translation: Translation, response: ResponseObject, sealer: Sealer | None) -> None:
        self.translation = translation
        self.response = response
        self.sealer = sealer
        self.items: list[OutputItem] = []
        self.open: _Open | None = None
        self.sequence = 0
        self.finish_reason: str | None = None
        self.extensions: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None

    def _event(self, type_: str, **fields: Any) -> Event:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return with_extensions(self.response, self.extensions)

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot()), self._event("response.in_progress", response=self._snapshot())]

    def _item_events(self, item: OutputItem) -> tuple[int, dict[str, Any]]:
        index = len(self.items)
        self.items.append(item)
        return index, msgspec.to_builtins(item)

    def _open(self, kind: Literal["reasoning", "message"]) -> list[Event]:
        events = self._close("completed") if self.open is not None and self.open.kind != kind else []
        if self.open is not None:
            return events
        index = len(self.items)
        if kind == "reasoning":
            self.open = _Open(kind, index, new_id("rs"))
            item = {"id": self.open.id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self.open = _Open(kind, index, new_id("msg"))
            item = {"id": self.open.id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            *events,
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", item_id=self.open.id, output_index=index, content_index=0, part=part),
        ]

    def _close(self, status: Status) -> list[Event]:
        current, self.open = self.open, None
        if current is None:
            return []
        where = {"item_id": current.id, "output_index": current.index, "content_index": 0}
        if current.kind == "reasoning":
            item: OutputItem = reasoning_item(current.text, status, self.sealer, self.translation.encrypted, item_id=current.id)
            done = [self._event("response.reasoning_text.done", **where, text=current.text)]
            part: dict[str, Any] = {"type": "reasoning_text", "text": current.text}
        else:
            item = OutputMessage(id=current.id, status=status, content=[OutputTextContent(text=current.text)])
            done = [self._event("response.output_text.done", **where, text=current.text, logprobs=[])]
            part = {"type": "output_text", "text": current.text, "annotations": [], "logprobs": []}
        _, data = self._item_events(item)
        return [
            *done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=current.index, item=data),
        ]

    def _delta(self, kind: Literal["reasoning", "message"], text: str) -> list[Event]:
        events = self._open(kind)
        assert self.open is not None
        self.open.text += text
        where = {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]
        return [*events, self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _calls(self, calls: list[dict[str, Any]]) -> list[Event]:
        events = self._close("completed")
        for call in calls:
            item = function_call(call, "completed")
            index, data = self._item_events(item)
            added = {**data, "status": "in_progress", "arguments": ""}
            where = {"item_id": item.id, "output_index": index}
            events += [
                self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.function_call_arguments.delta", **where, delta=item.arguments),
                self._event("response.function_call_arguments.done", **where, arguments=item.arguments),
                self._event("response.output_item.done", output_index=index, item=data),
            ]
        return events

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """The events one chat frame makes (an error frame: :meth:`fail`'s)."""
        if isinstance(chunk.get("error"), dict):
            return self.fail(chunk["error"])
        if isinstance(chunk.get("usage"), dict):
            self.response.usage = usage_of(chunk["usage"])
        choices = chunk.get("choices") or []
        if not choices:
            self.extensions.update({k: v for k, v in chunk.items() if k not in CHAT_KEYS})
            return []
        choice = choices[0]
        delta = choice.get("delta") or {}
        events: list[Event] = []
        if isinstance(delta.get("reasoning_content"), str) and delta["reasoning_content"]:
            events += self._delta("reasoning", delta["reasoning_content"])
        if isinstance(delta.get("content"), str) and delta["content"]:
            events += self._delta("message", delta["content"])
        if isinstance(delta.get("tool_calls"), list) and delta["tool_calls"]:
            events += self._calls(delta["tool_calls"])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if isinstance(choice.get("thinking_budget_forced_at"), int):
            self.response.thinking_budget_forced_at = choice["thinking_budget_forced_at"]
        return events

    def end(self) -> list[Event]:
        """The stream's end: the open item finished, then ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        status: Status = "incomplete" if self.finish_reason == "length" else "completed"
        has_message = any(isinstance(item, OutputMessage) for item in self.items) or (self.open is not None and self.open.kind == "message")
        calls = any(isinstance(item, OutputFunctionCall) for item in self.items)
        events: list[Event] = []
        if not has_message and not calls:
            events += self._close("completed") + self._open("message")
        events += self._close(status)
        finished(self.response, self.finish_reason)
        self.response.output = list(self.items)
        self.final = self._snapshot()
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.final)]

    def fail(self, error: dict[str, Any]) -> list[Event]:
        """An error after the stream's 200: ``error``, then ``response.failed``."""
        code = str(error.get("code") or "server_error")
        message = str(error.get("message") or "the response failed")
        events = [self._event("error", code=code, message=message, param=error.get("param"))]
        self.open = None
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        self.response.output = list(self.items)
        return [*events, self._event("response.failed", response=self._snapshot())]
