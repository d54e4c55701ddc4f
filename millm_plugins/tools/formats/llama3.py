"""The Llama 3.1–3.3 JSON call format: the whole reply is the call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import JSON_DECODER, ForcedCall, ParsedCall, any_call_schema, call_from_object, dump_json, named_function, parameters_of

SEPARATOR = "; "


class Llama3Format:
    """``{"name": "get_weather", "parameters": {"city": "Paris"}}`` as the whole reply; several
    calls are separated by ``;``. No text may come before the first call."""

    name = "llama3"
    start = "{"
    whole_reply = True

    def render(self, calls: Sequence[ParsedCall]) -> str:
        """The call objects joined by ``"; "``."""
        return SEPARATOR.join(dump_json({"name": c.name, "parameters": c.arguments}) for c in calls)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        """See ``CallFormat.parse``; the content is always ``""``. Every object must be exactly
        ``{"name", "parameters"}`` (a reply that is some other JSON object stays content)."""
        stripped = text.strip()
        if not stripped.startswith("{"):
            return None
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            try:
                value, pos = JSON_DECODER.raw_decode(stripped, pos)
            except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                return None
            call = call_from_object(value, "parameters", arguments_optional=False)
            if call is None:
                return None
            calls.append(call)
            pos = _skip_space(stripped, pos)
            if pos < len(stripped) and stripped[pos] == ";":
                pos = _skip_space(stripped, pos + 1)
            elif pos < len(stripped):
                return None
            if pos == len(stripped):
                return "", calls

    def forced(self, tools: Sequence[Mapping[str, Any]], name: str | None) -> ForcedCall:
        """See ``CallFormat.forced``: the JSON of the call (or of its parameters) is constrained."""
        if name is None:
            return ForcedCall("", any_call_schema(tools, "parameters"), "")
        parameters = parameters_of(named_function(tools, name))
        return ForcedCall(f'{{"name": {dump_json(name)}, "parameters": ', parameters, "}")


LLAMA3 = Llama3Format()
"""The format's one instance (formats are stateless)."""


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
