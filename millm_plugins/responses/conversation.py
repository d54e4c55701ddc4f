"""Input items → chat messages.

``message`` items become messages of their role; the assistant's side of a turn —
``reasoning``, an assistant ``message``, ``function_call`` items, in any run — becomes one
assistant message (``reasoning_content``, ``content``, ``tool_calls``), so the chat
template renders the turn as the model wrote it; ``function_call_output`` items become
``tool`` messages. Each chat message remembers which item it came from, so that an error
or an unused field is named by the item's location (``input[3]``), never by chat's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from millm_core.api import InvalidRequest

from .schema import FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ReasoningItem
from .sealing import Refusal, Sealer, SealError

STORED = "previous_response_id"  # the location of every item of a stored conversation


@dataclass
class _Turn:
    """One chat message being built, and where its parts came from (chat field → location)."""

    message: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)


@dataclass
class Conversation:
    """The chat messages, and the location each one's fields came from."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[dict[str, str]] = field(default_factory=list)
    # Locations of what the items sent that nothing renders (a reasoning item's summary).
    unused: list[str] = field(default_factory=list)

    def add(self, turn: _Turn) -> None:
        """Append a finished chat message."""
        self.messages.append(turn.message)
        self.origins.append(turn.origins)

    def system(self, text: str) -> None:
        """Append the instructions, as a first ``system`` message."""
        self.add(_Turn({"role": "system", "content": text}, {"": "instructions"}))

    def stored(self, location: str) -> bool:
        """Whether a chat field location (``messages[2].reasoning_content``) lies in the
        stored conversation that ``previous_response_id`` names."""
        match = _MESSAGE.match(location)
        if match is None or int(match[1]) >= len(self.origins):
            return False
        return self.origins[int(match[1])].get("") == STORED


def _where(location: str, suffix: str) -> str:
    """A field's location: inside an input item, or the stored response as a whole."""
    return location if location == STORED else f"{location}{suffix}"


_REFUSALS: dict[Refusal, str] = {
    "malformed": "is not encrypted reasoning of this server's format",
    "other_key": "was sealed under another key (another server's key file or database, or a key that has changed since), so this server cannot open it",
    "altered": "was altered: it does not open under this server's key",
}


def reasoning_text(item: ReasoningItem, location: str, sealer: Sealer | None) -> str | None:
    """The text a reasoning item renders: its ``encrypted_content`` opened, else its
    ``content``; None when it has neither. A blob that does not open is a 400 naming it
    and saying why (another key, altered, not a blob)."""
    if isinstance(item.encrypted_content, str):
        param = _where(location, ".encrypted_content")
        try:
            if sealer is None:
                raise SealError("other_key")
            return sealer.open(item.encrypted_content)
        except SealError as exc:
            raise InvalidRequest(f"{param} {_REFUSALS[exc.reason]}", param=param, code="invalid_encrypted_content") from None
    if isinstance(item.content, list) and item.content:
        return "".join(part.text for part in item.content)
    return None


class _Builder:
    """Gathers items into chat messages: the assistant's side of a turn into one message
    (:meth:`assistant`), every other item into a message of its own."""

    def __init__(self, sealer: Sealer | None, out: Conversation, report: bool) -> None:
        self.sealer = sealer
        self.out = out
        self.report = report  # report unused parts (the client's own items, not a stored conversation)
        self.turn: _Turn | None = None  # the assistant message being gathered

    def flush(self) -> None:
        """Finish the assistant message being gathered, if any."""
        if self.turn is not None:
            self.turn.message.setdefault("content", None)
            self.out.add(self.turn)
            self.turn = None

    def assistant(self, location: str, *, fresh: bool) -> _Turn:
        """The assistant message to add to (a new one when ``fresh``)."""
        if self.turn is not None and fresh:
            self.flush()
        if self.turn is None:
            self.turn = _Turn({"role": "assistant"}, {"": location})
        return self.turn

    def item(self, item: InputItem, location: str) -> str | None:
        """Add one item; a reasoning item's rendered text is returned (else None)."""
        if isinstance(item, ReasoningItem):
            text = reasoning_text(item, location, self.sealer)
            if item.summary and self.report:  # a summary is never rendered: the reasoning itself is
                self.out.unused.append(_where(location, ".summary"))
            if text is None:
                return None
            turn = self.assistant(location, fresh=self.turn is not None and len(self.turn.message) > 1)
            turn.message["reasoning_content"] = text
            turn.origins[".reasoning_content"] = location
            return text
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = self.assistant(location, fresh=self.turn is not None and ("content" in self.turn.message or "tool_calls" in self.turn.message))
            turn.message["content"] = item.text()
            turn.origins[".content"] = _where(location, ".content")
        elif isinstance(item, FunctionCallItem):
            turn = self.assistant(location, fresh=False)
            calls = turn.message.setdefault("tool_calls", [])
            turn.origins.setdefault(".tool_calls", location)
            turn.origins[f".tool_calls[{len(calls)}]"] = location
            calls.append({"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            self.flush()
            origins = {"": location, ".content": _where(location, ".output"), ".tool_call_id": _where(location, ".call_id")}
            self.out.add(_Turn({"role": "tool", "tool_call_id": item.call_id, "content": item.text()}, origins))
        else:
            assert isinstance(item, MessageItem)
            self.flush()
            self.out.add(_Turn({"role": item.role, "content": item.text()}, {"": location, ".content": _where(location, ".content")}))
        return None


def add_items(conversation: Conversation, items: list[tuple[InputItem, str]], sealer: Sealer | None, *, report: bool = True) -> list[str | None]:
    """Append ``items`` (each with its location) to ``conversation`` as chat messages; the
    text each reasoning item rendered (None for other items). ``report``: whether what the
    items send that nothing renders is reported (not for a stored conversation, which was
    reported when it was sent)."""
    builder = _Builder(sealer, conversation, report)
    texts = [builder.item(item, location) for item, location in items]
    builder.flush()
    return texts


_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_TOOL_FUNCTION = re.compile(r"^tools\[(\d+)\]\.function(.*)$")
# chat's name → the Responses name it came from (longest prefix first)
_RENAMED = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("reasoning_effort", "reasoning.effort"),
    ("tool_choice.function", "tool_choice"),
    ("messages", "input"),
)


def renamer(conversation: Conversation) -> Callable[[str], str]:
    """Chat's field locations → the request's own (``messages[2].content`` →
    ``input[1].content``, ``max_completion_tokens`` → ``max_output_tokens``, …)."""

    def rename(location: str) -> str:
        match = _MESSAGE.match(location)
        if match and int(match[1]) < len(conversation.origins):
            origins, rest = conversation.origins[int(match[1])], match[2]
            best = max((key for key in origins if rest.startswith(key)), key=len, default="")
            return origins.get(best, origins[""])
        tool = _TOOL_FUNCTION.match(location)
        if tool:
            return f"tools[{tool[1]}]{tool[2]}"
        for chat, ours in _RENAMED:
            if location == chat or location.startswith(chat + ".") or location.startswith(chat + "["):
                return ours + location[len(chat) :]
        return location

    return rename
