"""A chat completion stream → the Responses event stream.

``response.created`` and ``response.in_progress`` open it. The reasoning deltas
(``delta.reasoning_content``) become one reasoning item, the text deltas
(``delta.content``) one message item, each tool call a function call item: every item is
added, filled (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), finished (the matching ``.done`` events) and
done, in order — the items, their order and their statuses are those of the non-streamed
response (:mod:`.output`). The reasoning item is done when the text begins; reasoning that
a plugin adds after that still joins it (its deltas name that item) and the final response
carries it whole. (Only reasoning that first arrives after the text — no built-in plugin
writes it so — cannot be put before a message already added: it comes as an item after it.) The finish chunk gives the status and usage; the choice's own keys
(``thinking_budget_forced_at``, …) and the closing extension chunks (``{"choices": [],
key: value}``) become top-level keys of the final response, sent with
``response.completed`` or ``response.incomplete``. A stream that fails after its 200 — or
that ends without its end — ends with ``error`` and ``response.failed``. Every event
carries its ``sequence_number``.
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
    choice_extensions,
    finished,
    new_id,
    usage_of,
    with_extensions,
)
from .output import CHAT_KEYS, function_call, reasoning_item, wants_message
from .sealing import Sealer
from .translate import Translation

Event = dict[str, Any]
# The codes of a failed Response's ``error`` that OpenAI's clients accept (those about
# images and vector stores never arise here); any other code of millm's is ``server_error``.
FAILURE_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})


def sse(event: Event) -> bytes:
    """One event as SSE: its type as the event name, then its data."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + encode(event) + b"\n\n"


Kind = Literal["reasoning", "message"]


@dataclass
class _Text:
    """The reasoning item or the message: where it is, and its text so far."""

    kind: Kind
    index: int
    id: str
    text: str = ""
    done: bool = False


class ResponseStream:
    """Turns one chat stream's frames into Responses events (:meth:`start`, :meth:`feed`,
    :meth:`end`, :meth:`fail`); ``final`` is the finished response, as plain data."""

    def __init__(self, translation: Translation, response: ResponseObject, sealer: Sealer | None) -> None:
        self.translation = translation
        self.response = response
        self.sealer = sealer
        self.items: list[OutputItem | None] = []  # by output index (None: a text item still open)
        self.texts: dict[Kind, _Text] = {}
        self.open: _Text | None = None
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
        """The opening events: ``response.created``, ``response.in_progress``."""
        return [self._event("response.created", response=self._snapshot()), self._event("response.in_progress", response=self._snapshot())]

    def _item(self, text: _Text, status: Status) -> OutputItem:
        if text.kind == "reasoning":
            return reasoning_item(text.text, status, self.sealer, self.translation.encrypted, item_id=text.id)
        return OutputMessage(id=text.id, status=status, content=[OutputTextContent(text=text.text)])

    def _open(self, kind: Kind) -> list[Event]:
        """The item of ``kind`` to add text to: the open one, the one done already (its
        text grows still), or a new one (the open item of the other kind done first)."""
        if kind in self.texts:
            return []
        events = self._close("completed")
        index = len(self.items)
        self.items.append(None)
        current = self.open = self.texts[kind] = _Text(kind, index, new_id("rs" if kind == "reasoning" else "msg"))
        if kind == "reasoning":
            item = {"id": current.id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": current.id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            *events,
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", item_id=current.id, output_index=index, content_index=0, part=part),
        ]

    def _close(self, status: Status) -> list[Event]:
        """Finish the open item with ``status``."""
        current, self.open = self.open, None
        if current is None:
            return []
        current.done = True
        where = {"item_id": current.id, "output_index": current.index, "content_index": 0}
        item = self._item(current, status)
        self.items[current.index] = item
        if current.kind == "reasoning":
            done = [self._event("response.reasoning_text.done", **where, text=current.text)]
            part: dict[str, Any] = {"type": "reasoning_text", "text": current.text}
        else:
            done = [self._event("response.output_text.done", **where, text=current.text, logprobs=[])]
            part = {"type": "output_text", "text": current.text, "annotations": [], "logprobs": []}
        return [
            *done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=current.index, item=msgspec.to_builtins(item)),
        ]

    def _delta(self, kind: Kind, text: str) -> list[Event]:
        events = self._open(kind)
        current = self.texts[kind]
        current.text += text
        if current.done:  # reasoning a plugin added after the text began: the item's final text has it
            item = self.items[current.index]
            assert item is not None
            self.items[current.index] = self._item(current, item.status)
        where = {"item_id": current.id, "output_index": current.index, "content_index": 0}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]
        return [*events, self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _calls(self, calls: list[dict[str, Any]]) -> list[Event]:
        events = self._close("completed")
        for call in calls:
            item = function_call(call, "completed")
            index = len(self.items)
            self.items.append(item)
            data = msgspec.to_builtins(item)
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
        self.extensions.update(choice_extensions(choice))
        return events

    def end(self) -> list[Event]:
        """The stream's end: the open item finished, then ``response.completed`` (or
        ``response.incomplete``) with the whole response."""
        finished(self.response, self.finish_reason)
        status = self.response.status
        calls = any(isinstance(item, OutputFunctionCall) for item in self.items)
        events: list[Event] = []
        if "message" not in self.texts and wants_message(False, "reasoning" in self.texts, calls, status):
            events += self._open("message")  # an empty message, as the non-streamed response has
        # The open item is the last one unless calls followed it: closing it with the
        # response's status marks what the budget cut short, as mark_cut does.
        events += self._close(status)
        self.response.output = [item for item in self.items if item is not None]
        self.final = self._snapshot()
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.final)]

    def fail(self, error: dict[str, Any]) -> list[Event]:
        """An error after the stream's 200: ``error`` (with millm's code), then
        ``response.failed`` (its ``error.code`` one of OpenAI's: ``server_error`` unless
        millm's code is one of them)."""
        code = str(error.get("code") or "server_error")
        message = str(error.get("message") or "the response failed")
        events = [self._event("error", code=code, message=message, param=error.get("param"))]
        self.open = None
        self.response.status = "failed"
        self.response.error = ResponseError(code=code if code in FAILURE_CODES else "server_error", message=message)
        self.response.output = [item for item in self.items if item is not None]
        return [*events, self._event("response.failed", response=self._snapshot())]
