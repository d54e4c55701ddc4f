"""The LFM2 / LFM2.5 call format: a Python list of calls with literal keyword arguments."""

from __future__ import annotations

import ast
import keyword
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from .base import ForcedCall, ParsedCall, function_of, named_function, parameters_of, parse_blocks

START = "<|tool_call_start|>"
END = "<|tool_call_end|>"
# LFM2.5's own template writes nested lists and dicts with ``tojson``, so JSON's literals
# appear inside otherwise Python calls.
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


class PythonicFormat:
    """``<|tool_call_start|>[get_weather(city='Paris'), other(x=1)]<|tool_call_end|>``: Python
    call syntax, keyword arguments only, each value a literal (str, int, float, True/False/None,
    lists, dicts with string keys; JSON's true/false/null are read too). The text is read with
    ``ast`` and never evaluated. A block holding one bare call without brackets is accepted."""

    name = "pythonic"
    start = START
    whole_reply = False

    def render(self, calls: Sequence[ParsedCall]) -> str:
        """One block holding the list of calls, values written as Python literals."""
        written = []
        for call in calls:
            keywords = ", ".join(f"{_checked_name(key)}={_literal_text(value)}" for key, value in call.arguments.items())
            written.append(f"{_checked_name(call.name)}({keywords})")
        return f"{START}[{', '.join(written)}]{END}"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        """See ``CallFormat.parse``."""
        return parse_blocks(text, START, END, _parse_body)

    def forced(self, tools: Sequence[Mapping[str, Any]], name: str | None) -> ForcedCall:
        """See ``CallFormat.forced``. No JSON schema fits Python call syntax, so the
        arguments are constrained by a regular ``pattern`` (:func:`arguments_pattern`) when
        every offered function's parameters are flat enough to write one; otherwise only
        the opening is forced and the model writes the arguments and closes the block."""
        if name is None:
            if not tools:
                raise ValueError("tool_choice 'required' needs at least one tool")
            calls = []
            for tool in tools:
                function = function_of(tool)
                arguments = arguments_pattern(parameters_of(function))
                if arguments is None:
                    return ForcedCall(f"{START}[", None, "")
                calls.append(f"{re.escape(_checked_name(str(function['name'])))}\\({arguments}")
            return ForcedCall(f"{START}[", None, f"){']'}{END}", pattern="(" + "|".join(calls) + ")")
        function = named_function(tools, name)
        arguments = arguments_pattern(parameters_of(function))
        opening = f"{START}[{_checked_name(name)}("
        if arguments is None:
            return ForcedCall(opening, None, "")
        return ForcedCall(opening, None, f"){']'}{END}", pattern=arguments)


PYTHONIC = PythonicFormat()
"""The format's one instance (formats are stateless)."""


def _checked_name(name: str) -> str:
    # Python folds identifiers to NFKC when it reads them, so a name that changes under NFKC
    # would come back as another name.
    if not name.isidentifier() or keyword.iskeyword(name) or unicodedata.normalize("NFKC", name) != name:
        raise ValueError(f"{name!r} cannot be written as a Python keyword or function name")
    return name


def _literal_text(value: Any) -> str:
    if value is None or isinstance(value, bool | int | str):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a JSON number")
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal_text(item) for item in value) + "]"
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ValueError("dict keys must be strings")
        return "{" + ", ".join(f"{key!r}: {_literal_text(item)}" for key, item in value.items()) + "}"
    raise ValueError(f"{type(value).__name__} is not a JSON value")


def _parse_body(body: str) -> list[ParsedCall] | None:
    try:
        tree = ast.parse(body.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls: list[ParsedCall] = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in arguments:  # **spread, or a repeated keyword
                return None
            try:
                arguments[kw.arg] = _literal(kw.value)
            except (_NotLiteral, RecursionError):
                return None
        calls.append(ParsedCall(node.func.id, arguments))
    return calls or None


def _literal(node: ast.expr) -> Any:
    """The JSON value a literal node spells; a stricter ``ast.literal_eval`` (no sets, tuples
    as lists, no bytes or complex numbers, no NaN or infinity) that also reads true/false/null."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = node.operand.value if isinstance(node.operand, ast.Constant) else None
        # bool is an int subclass: ``-True`` is not a literal a model means.
        if not isinstance(operand, int | float) or isinstance(operand, bool) or not math.isfinite(operand):
            raise _NotLiteral
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                raise _NotLiteral  # also ``{**spread}``, whose key is None
            out[key.value] = _literal(item)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


# Bounds that keep a forced call finite (a string's length, an unbounded number's digits).
_MAX_DIGITS = 15
_MAX_ENUMERATED = 200
# A longer string bound is left unconstrained: a regex automaton grows with the count.
_MAX_STRING = 256
_STRING_CHAR = r"([^'\\\n\r]|\\['\\nrt])"


def _value_pattern(schema: Any) -> str | None:
    """A regular expression for one Python literal valid against ``schema``, or None when
    the schema is beyond what a flat pattern states exactly (nested objects, arrays,
    ``anyOf``, references, numeric ranges too wide to list)."""
    if not isinstance(schema, Mapping):
        return None
    if "enum" in schema or "const" in schema:
        values = list(schema["enum"]) if "enum" in schema else [schema["const"]]
        try:
            return "(" + "|".join(re.escape(_literal_text(v)) for v in values) + ")"
        except (ValueError, TypeError):
            return None
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema or "format" in schema:
            return None
        shortest, longest = schema.get("minLength", 0), schema.get("maxLength", _MAX_STRING)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_STRING for v in (shortest, longest)):
            return None
        if shortest > longest:  # no string fits: left to the schema check, not a pattern
            return None
        return f"'{_STRING_CHAR}{{{shortest},{longest}}}'"
    if kind == "boolean":
        return "(True|False)"
    if kind == "null":
        return "None"
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)) for v in (low, high)):
            return None
        if low is not None and high is not None and 0 <= high - low <= _MAX_ENUMERATED:
            return "(" + "|".join(re.escape(str(v)) for v in range(math.ceil(low), math.floor(high) + 1)) + ")"
        if high is not None or (low is not None and low > 0):
            return None
        sign = "" if low is not None else "-?"
        return f"{sign}(0|[1-9][0-9]{{0,{_MAX_DIGITS - 1}}})"
    if kind == "number":
        if "minimum" in schema or "maximum" in schema:
            return None
        return f"-?(0|[1-9][0-9]{{0,{_MAX_DIGITS - 1}}})(\\.[0-9]{{1,{_MAX_DIGITS}}})?"
    return None


def arguments_pattern(parameters: Mapping[str, Any]) -> str | None:
    """A regular expression for the keyword arguments of a call whose ``parameters`` are
    a flat object: every declared property, in declaration order, ``name=value`` joined by
    ``", "`` (optional ones too, so the call always validates). None when a property's
    schema is beyond :func:`_value_pattern` or a name cannot be a Python keyword."""
    properties = parameters.get("properties") or {}
    if parameters.get("type", "object") != "object" or not isinstance(properties, Mapping):
        return None
    parts = []
    for key, schema in properties.items():
        value = _value_pattern(schema)
        if value is None:
            return None
        try:
            parts.append(f"{re.escape(_checked_name(str(key)))}={value}")
        except ValueError:
            return None
    return ", ".join(parts)
