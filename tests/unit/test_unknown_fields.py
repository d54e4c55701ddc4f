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


def test_lists_of_lists_are_walked() -> None:
    """``extra_messages`` is a list of conversations, each a list of messages."""
    raw = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "extra_messages": [[{"role": "user", "content": "y"}], [{"role": "user", "content": "z"}, {"role": "user", "content": "w", "weight": 1}]],
    }
    assert unknown_fields(raw, ChatCompletionRequest) == ["extra_messages[1][1].weight"]


class _Text(msgspec.Struct, tag_field="type", tag="text"):
    pass


class _Schema(msgspec.Struct, tag_field="type", tag="json_schema"):
    json_schema: dict[str, object]


class _Formatted(msgspec.Struct):
    response_format: _Text | _Schema | None = None


def test_the_member_of_a_tagged_union_is_walked_by_its_tag() -> None:
    assert unknown_fields({"response_format": {"type": "text", "foo": 1}}, _Formatted) == ["response_format.foo"]
    raw = {"response_format": {"type": "json_schema", "json_schema": {"anything": 1}, "strict_mode": True}}
    assert unknown_fields(raw, _Formatted) == ["response_format.strict_mode"]
    # An unknown tag names no member: the decoder refuses the body, nothing is guessed here.
    assert unknown_fields({"response_format": {"type": "yaml", "foo": 1}}, _Formatted) == []
