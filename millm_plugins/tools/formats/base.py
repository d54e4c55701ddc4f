"""The types every call format shares, and the helpers two or more formats use."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One function call read from (or written into) a reply: the function's name and its
    arguments as a JSON object."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ForcedCall:
    """How tool_choice forcing opens a call: ``opening`` is appended to the assistant turn (part of
    the prompt), then the model's text is constrained by ``schema`` (a JSON schema, or None:
    unconstrained) and must then be followed by ``suffix``. ``opening + text + suffix`` is what
    the format's ``parse`` reads back. A format whose calls are not JSON gives a regular
    ``pattern`` for that text instead of a schema."""

    opening: str
    schema: dict[str, Any] | None
    suffix: str
    # For a format whose calls are not JSON: a regular expression the text between
    # ``opening`` and ``suffix`` must match (None: unconstrained, unless ``schema`` is set).
    pattern: str | None = None


class CallFormat(Protocol):
    """A tool-call syntax a model writes, as data: how to write calls, read them back, and open a
    forced call. Implementations are stateless and pure."""

    @property
    def name(self) -> str:
        """The format's id: ``"hermes"``, ``"pythonic"`` or ``"llama3"``."""
        ...

    @property
    def start(self) -> str:
        """The text that begins a call in a reply."""
        ...

    @property
    def whole_reply(self) -> bool:
        """True when a call is recognised only as the whole reply (no text before it)."""
        ...

    def render(self, calls: Sequence[ParsedCall]) -> str:
        """Exactly what the model would write for ``calls`` (ValueError when the syntax cannot
        express a name or value)."""
        ...

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        """(content before the first call, without trailing whitespace; the calls), or None when
        ``text`` holds no well-formed call. One malformed call makes the whole reply content; text
        after the last call may only be whitespace."""
        ...

    def forced(self, tools: Sequence[Mapping[str, Any]], name: str | None) -> ForcedCall:
        """The opening, constraint and suffix that force a call: of the function ``name``
        (tool_choice names one), or of any of ``tools`` (``name`` None: tool_choice "required").
        ``tools`` are OpenAI tool objects; ValueError when ``name`` is not among them."""
        ...


def arguments_json(arguments: dict[str, Any]) -> str:
    """The OpenAI ``function.arguments`` string for ``arguments``: non-ASCII kept as is,
    except a lone surrogate (a model may write ``\\ud800``), which stays escaped so that
    the response is still valid UTF-8."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(arguments, ensure_ascii=True)
    return text


def dump_json(value: Any) -> str:
    """JSON as the formats write it: default separators, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False)


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


# NaN and Infinity are accepted by Python's json by default; a call carrying them could not be
# handed to a client as standard JSON, so they make the call malformed.
JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def loads_json(text: str) -> Any:
    """Strict JSON (no NaN/Infinity); raises ValueError when ``text`` is not one JSON value."""
    return JSON_DECODER.decode(text)


def call_from_object(obj: Any, arguments_key: str, *, arguments_optional: bool) -> ParsedCall | None:
    """A call from a decoded ``{"name": …, <arguments_key>: {…}}`` object, or None when ``obj``
    has another shape (other keys, a non-string name, non-object arguments)."""
    if not isinstance(obj, dict) or not set(obj) <= {"name", arguments_key}:
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if arguments_key not in obj:
        return ParsedCall(name, {}) if arguments_optional else None
    arguments = obj[arguments_key]
    return ParsedCall(name, arguments) if isinstance(arguments, dict) else None


def parse_blocks(text: str, start: str, end: str, body: Callable[[str], list[ParsedCall] | None]) -> tuple[str, list[ParsedCall]] | None:
    """Read ``content start BODY end (ws start BODY end)* ws`` off ``text``. Each block's end is
    the first ``end`` after which the body parses, so an end marker quoted inside an argument
    does not cut the block short."""
    first = text.find(start)
    if first < 0:
        return None
    calls: list[ParsedCall] = []
    pos = first
    while True:
        body_start = pos + len(start)
        search = body_start
        while True:
            close = text.find(end, search)
            if close < 0:
                return None
            parsed = body(text[body_start:close])
            if parsed is not None:
                break
            search = close + 1
        calls.extend(parsed)
        pos = close + len(end)
        rest = text[pos:]
        pos += len(rest) - len(rest.lstrip())
        if pos == len(text):
            return text[:first].rstrip(), calls
        if not text.startswith(start, pos):
            return None


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool (ValueError for any other shape)."""
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("a tool must be {'type': 'function', 'function': {'name': …}}")
    return function


NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The parameters of a function sent without ``parameters``: as OpenAI reads it, a function
that takes no arguments (a forced call's arguments are ``{}``)."""


def parameters_of(function: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the function's parameters schema, held to an object: ``type: "object"`` is
    added where it has no ``type`` (arguments are a JSON object; a schema without one would
    let the model write a string there), ``{"type": "object"}`` for an empty one, and
    :data:`NO_ARGUMENTS` when it has none."""
    parameters = function.get("parameters")
    if not isinstance(parameters, Mapping):
        return copy.deepcopy(dict(NO_ARGUMENTS))
    out = copy.deepcopy(dict(parameters))
    out.setdefault("type", "object")
    return out


def named_function(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """The function called ``name`` among ``tools`` (ValueError when none is)."""
    for tool in tools:
        function = function_of(tool)
        if function["name"] == name:
            return function
    raise ValueError(f"tool_choice names {name!r}, which is not among the tools")


def any_call_schema(tools: Sequence[Mapping[str, Any]], arguments_key: str) -> dict[str, Any]:
    """``{"anyOf": [one call object per tool]}``: the JSON of a call to any of ``tools``.

    Each tool's parameters move under ``/anyOf/i/properties/<arguments_key>``, so their local
    ``$ref`` pointers are rewritten: ``#/$defs/X`` to a root ``$defs`` entry ``t<i>_X`` and
    ``#/definitions/X`` (the older keyword) to ``t<i>d_X`` (both hoisted there), any other
    ``#…`` to the parameters' new place."""
    if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")
    branches: list[dict[str, Any]] = []
    hoisted: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        function = function_of(tool)
        parameters = parameters_of(function)
        defs, legacy = parameters.pop("$defs", None), parameters.pop("definitions", None)
        prefix = f"t{index}_"
        home = f"#/anyOf/{index}/properties/{arguments_key}"
        parameters = _relocate_refs(parameters, prefix, home)
        for found, key_prefix in ((defs, prefix), (legacy, f"t{index}d_")):
            if isinstance(found, dict):
                for key, definition in found.items():
                    hoisted[key_prefix + key] = _relocate_refs(definition, prefix, home)
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": branches}
    if hoisted:
        schema["$defs"] = hoisted
    return schema


# Keywords whose values are instance data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _relocate_refs(node: Any, prefix: str, home: str) -> Any:
    if isinstance(node, list):
        return [_relocate_refs(item, prefix, home) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: value if key in _DATA_KEYWORDS else _relocate_refs(value, prefix, home) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        # A def key's pointer segment is escaped (~0, ~1); the prefix has neither, so prefixing
        # the escaped segment is the same as escaping the prefixed key.
        if ref.startswith("#/$defs/"):
            out["$ref"] = "#/$defs/" + prefix + ref[len("#/$defs/") :]
        elif ref.startswith("#/definitions/"):
            out["$ref"] = "#/$defs/" + prefix[:-1] + "d_" + ref[len("#/definitions/") :]
        else:
            out["$ref"] = home + ref[1:]
    return out
