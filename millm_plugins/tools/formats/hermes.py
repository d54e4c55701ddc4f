"""The Hermes / Qwen2.5 call format: one ``<tool_call>`` block of JSON per call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    ForcedCall,
    ParsedCall,
    any_call_schema,
    call_from_object,
    dump_json,
    loads_json,
    named_function,
    parameters_of,
    parse_blocks,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesFormat:
    """``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``,
    one block per call (several for parallel calls); text may come before the first block.

    Read leniently where models are known to differ: a block may hold a JSON list of call
    objects (SmolLM2 was trained on ``<tool_call>[{…}, …]</tool_call>``), and ``arguments`` may
    be left out for a function without parameters."""

    name = "hermes"
    start = START
    whole_reply = False

    def render(self, calls: Sequence[ParsedCall]) -> str:
        """One block per call, joined by newlines."""
        return "\n".join(f"{START}\n{dump_json({'name': c.name, 'arguments': c.arguments})}\n{END}" for c in calls)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        """See ``CallFormat.parse``."""
        return parse_blocks(text, START, END, _parse_body)

    def forced(self, tools: Sequence[Mapping[str, Any]], name: str | None) -> ForcedCall:
        """See ``CallFormat.forced``: the JSON of the call (or of its arguments) is constrained."""
        if name is None:
            return ForcedCall(f"{START}\n", any_call_schema(tools, "arguments"), f"\n{END}")
        parameters = parameters_of(named_function(tools, name))
        return ForcedCall(f'{START}\n{{"name": {dump_json(name)}, "arguments": ', parameters, f"}}\n{END}")


HERMES = HermesFormat()
"""The format's one instance (formats are stateless)."""


def _parse_body(body: str) -> list[ParsedCall] | None:
    try:
        value = loads_json(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    objects = value if isinstance(value, list) else [value]
    calls = [call_from_object(obj, "arguments", arguments_optional=True) for obj in objects]
    if not calls or None in calls:
        return None
    return [call for call in calls if call is not None]
