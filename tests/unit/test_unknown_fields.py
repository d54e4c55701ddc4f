"""Unknown fields are found at every level the contract describes."""

from __future__ import annotations

import msgspec

from millm_core.contracts.chat import ChatCompletionRequest
from millm_core.contracts.completions import CompletionRequest
from millm_core.unknown import unknown_fields


def test_top_level_and_message_level_unknowns() -> None:
    raw = {
        "model": "m",
        "foo": 1,
        "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y", "weight": 2}],
        "stream_options": {"include_usage": True, "bar": 0},
    }
    assert unknown_fields(raw, ChatCompletionRequest) == ["foo", "messages[1].weight", "stream_options.bar"]


def test_known_fields_are_not_reported() -> None:
    raw = {"model": "m", "prompt": "x", "max_tokens": 3, "temperature": 0}
    assert unknown_fields(raw, CompletionRequest) == []


def test_content_parts_are_walked() -> None:
    raw = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]}
    assert unknown_fields(raw, ChatCompletionRequest) == ["messages[0].content[0].extra"]



class _Tool(msgspec.Struct, tag_field="type", tag="function"):
    name: str


class _Body(msgspec.Struct):
    tools: list[_Tool]


def test_a_tagged_structs_tag_is_not_unknown() -> None:
    assert unknown_fields({"tools": [{"type": "function", "name": "f", "strict": True}]}, _Body) == ["tools[0].strict"]
