"""The per-token side of function calling: hold back what may be a call, parse the
reply when the row ends, and turn well-formed calls into OpenAI ``tool_calls``.

Text before a call streams as content. From the first character that may open a call
(the format's start marker, or a prefix of it at the end of the text) everything is held,
so a ``stop`` string never matches inside a call (later processors see held text only if
it turns out not to be a call). When the row ends the held text is parsed: calls to
offered functions become ``tool_calls`` with ``finish_reason: "tool_calls"``; anything
else (no call, a malformed one, an unknown function) is released as plain content.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Set
from typing import Any

import jsonschema

from millm_core.api import RowEnd
from millm_plugins.structured.public import ConstrainedOutputInvalid

from .formats import CallFormat, ParsedCall, arguments_json, holdback

# Each format's markers, whose text a tokenizer may keep as one special token (LFM2 marks
# <|tool_call_start|> special, so decoding skips it): their ids are mapped back to text.
MARKERS: Mapping[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "llama3": (),
}


def call_id() -> str:
    """A fresh OpenAI-style call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def special_markers(engine: Any, fmt: CallFormat) -> dict[int, str]:
    """``{token id: marker text}`` for the format's markers that this tokenizer writes as
    one token whose decoded text is empty (a special token)."""
    found: dict[int, str] = {}
    for marker in MARKERS.get(fmt.name, ()):
        ids = engine.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and not engine.decode(ids):
            found[int(ids[0])] = marker
    return found


class ToolCalls:
    """One row's tool-call processor. ``opening`` is text the prompt already ended with
    (a forced call's opening): the reply is parsed as ``opening + text``, and all of it
    is held, since the row is inside a call from its first token; when it is no call, the
    content released is ``opening + text`` too."""

    def __init__(
        self,
        fmt: CallFormat,
        offered: Set[str],
        *,
        parallel: bool,
        opening: str = "",
        markers: Mapping[int, str] | None = None,
        schemas: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self._fmt = fmt
        self._offered = offered
        self._parallel = parallel
        self._opening = opening
        self._markers = markers or {}
        # A constrained forced call's functions: its arguments must validate, or the
        # request fails (the constraint promised they would).
        self._schemas = schemas or {}
        self._text = ""
        self._sent = 0
        self._calls: list[ParsedCall] = []
        self._opening_released = False

    def logit_bias(self) -> None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self._text += self._markers.get(token_id, "") + text
        if self._opening:
            return "", False
        safe = len(self._text) - holdback(self._fmt, self._text)
        if safe <= self._sent:
            return "", False
        out = self._text[self._sent : safe]
        self._sent = safe
        return out, False

    def flush(self) -> str:
        parsed = self._fmt.parse(self._opening + self._text)
        if parsed is not None:
            content, calls = parsed
            if calls and all(c.name in self._offered for c in calls):
                self._calls = calls if self._parallel else calls[:1]
                # Content before the call not yet released (parse strips its trailing space).
                if self._opening:
                    return ""
                return content[self._sent :] if len(content) > self._sent else ""
        # Not a call: released as content. A forced call's opening was never sent (the row
        # was held from its first token), and what the model wrote is only the rest of it,
        # so the opening leads the content: the reply reads as the model's whole turn.
        rest = self._text[self._sent :]
        if self._opening and not self._opening_released:
            rest, self._opening_released = self._opening + rest, True
        self._sent = len(self._text)
        return rest

    def end(self, finish_reason: str) -> RowEnd | None:
        if not self._calls:
            return None
        for call in self._calls:
            schema = self._schemas.get(call.name)
            if schema is not None:
                try:
                    jsonschema.validate(call.arguments, schema)
                except jsonschema.ValidationError as exc:
                    raise ConstrainedOutputInvalid(f"the forced call's arguments do not validate: {exc.message}") from exc
        calls = [
            {"index": i, "id": call_id(), "type": "function", "function": {"name": c.name, "arguments": arguments_json(c.arguments)}}
            for i, c in enumerate(self._calls)
        ]
        return RowEnd(fields={"tool_calls": calls}, finish_reason="tool_calls")
