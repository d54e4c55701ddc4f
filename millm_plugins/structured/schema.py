"""millm's supported JSON Schema subset: what ``response_format.json_schema.schema`` may
use, the refusals (every unsupported keyword named with its RFC 6901 pointer, in one
error), the size limits, and the validation of a finished document.

The subset is millm's own list rather than "whatever the constraint library compiles":
the library accepts several keywords (``multipleOf``, ``format``, ``uniqueItems``, …)
without enforcing them, so a schema using them would produce documents that then fail
validation. Only keywords the constraint enforces, or that the final validation can
reasonably stand behind, are accepted; see :mod:`.constraint` for the few that are
enforced by validation alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import unquote

import interegular
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match

from millm_core.api import InvalidRequest

SCHEMA_PARAM = "response_format.json_schema.schema"
CODE = "response_format_unsupported"
MAX_BYTES = 64 * 1024  # of the schema serialised as compact-ish JSON (json.dumps defaults)
MAX_PATTERNS = 128  # distinct ``pattern`` strings: each is compiled and costed when a request is checked
MAX_DEPTH = 32  # nested subschemas, the root counting as depth 1; literal values count too
MAX_PROPERTIES = 256  # per object schema

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples"})
DEFS = ("$defs", "definitions")
SUPPORTED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
        "enum", "const", "minimum", "maximum", "minLength", "maxLength", "pattern", "anyOf", "$ref", *DEFS,
    }
)  # fmt: skip
_VALUES = ("const", "enum", "default", "examples")  # keywords whose value is data, not a schema
# The keywords beside an ``enum``/``const`` that its values are checked against when the
# schema is (no subschemas among them, so the check needs no references resolved).
_VALUE_SIBLINGS = ("type", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "required")
LOOKAROUND = "a lookahead or lookbehind ((?=…), (?!…), (?<=…) or (?<!…))"


@dataclass(frozen=True)
class SchemaProblem:
    """One reason a schema is refused: where (an RFC 6901 pointer into the schema, ``""``
    for the root), which keyword (``None`` when the problem is not one keyword's) and why."""

    pointer: str
    keyword: str | None
    reason: str

    def describe(self) -> str:
        return f"{self.reason} at {self.pointer or '(root)'}"


class ResponseFormatUnsupported(InvalidRequest):
    """400 ``response_format_unsupported``: the schema leaves millm's supported subset,
    exceeds a limit, or is not a valid Draft 2020-12 schema. ``problems`` lists every
    reason found (all of them, not just the first), each with its JSON pointer."""

    code = CODE

    def __init__(self, message: str, *, param: str, problems: tuple[SchemaProblem, ...] = ()) -> None:
        super().__init__(message, param=param)
        self.problems = problems


def pointer(tokens: tuple[str, ...]) -> str:
    """The RFC 6901 pointer of a path of keys (``~`` and ``/`` escaped)."""
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


def resolve_local_ref(root: dict[str, Any], ref: str) -> Any:
    """The value a local ``$ref`` (``#/$defs/...``) points at, or raises ``LookupError``.
    Only refs into the root's ``$defs``/``definitions`` resolve; anything else is refused
    by :func:`check_schema` before this is reached."""
    if not ref.startswith("#/"):
        raise LookupError(f"not a local reference: {ref}")
    tokens = [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")]
    if tokens[0] not in DEFS:
        raise LookupError(f"only references into $defs are supported: {ref}")
    node: Any = root
    for token in tokens:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise LookupError(f"$ref {ref} points nowhere")
    return node


def enforcer_pattern(pattern: str) -> str:
    """``pattern`` as the constraint enforces it: a full match of the pattern without its
    outer anchors. JSON Schema's ``pattern`` is an unanchored search; a full match of the
    unanchored core is always also a search match, so the constraint is stricter than the
    schema but never admits a string the schema refuses. (Wrapping the core in ``.*`` for
    search semantics can make the automaton exponentially large: ``.*a.{30}b``.)
    ECMA-262 ``\\uXXXX`` escapes become the characters they name."""
    core = re.sub(r"(?<!\\)((?:\\\\)*)\\u([0-9a-fA-F]{4})", lambda m: m.group(1) + re.escape(chr(int(m.group(2), 16))), pattern)
    if core.startswith("^"):
        core = core[1:]
    if core.endswith("$") and not _escaped_at_end(core[:-1]):
        core = core[:-1]
    # The library strips a leading "^" and a trailing "$" itself; the group keeps it from
    # stripping an escaped "\\$". Anchors left inside ("a$|b") fail to compile: refused.
    return f"(?:{core})"


def _escaped_at_end(text: str) -> bool:
    """Whether ``text`` ends in an odd run of backslashes (its next character is escaped)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


def _has_lookaround(parsed: object) -> bool:
    """Whether ``interegular``'s parse of a pattern holds a lookahead or lookbehind.

    ``interegular`` parses every lookaround (as its ``_NonCapturing`` node). Its automaton
    for a lookahead kept states from which no match can be completed, and lm-format-enforcer
    offers every transition of a state as allowed, so a row walked into one and then wrote
    anything (the pattern, and a ``maxLength`` beside it, went unenforced). The built
    automata lose their dead states now (``fsmbuild.live_only``), which made the lookaheads
    tried exact; lookarounds stay refused all the same: lookbehinds are not supported there,
    and lookaheads rest on ``interegular``'s own, documented as partial, support, which no
    test here covers beyond the few patterns tried."""
    stack: list[object] = [parsed]
    while stack:
        node = stack.pop()
        if type(node).__name__ == "_NonCapturing":
            return True
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name, None)
                stack.extend(value if isinstance(value, tuple) else (value,))
    return False


def _pattern_problem(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:  # a count past C's integers, nesting past the stack
        return f"pattern is not a valid regular expression ({type(exc).__name__}: {exc})"
    try:
        parsed = interegular.parse_pattern(enforcer_pattern(pattern))
    except Exception as exc:  # interegular raises its own Unsupported and plain errors
        return f"pattern uses regular-expression syntax the constraint cannot enforce ({exc})"
    if _has_lookaround(parsed):
        return f"pattern uses regular-expression syntax the constraint cannot enforce ({LOOKAROUND})"
    return None


def _plain_text(text: str) -> bool:
    """Whether ``text`` holds no ``"``, ``\\`` or control character: the constraint spells
    such a string (an ``enum``/``const`` string, a literal object's key) exactly."""
    return not any(c in '"\\' or ord(c) < 0x20 for c in text)


def literal_problem(value: Any) -> str | None:
    """Why the token mask cannot write an ``enum``/``const`` value exactly (None: it can).

    Scalars, arrays of numbers, booleans and nulls, and objects (member by member) are
    written exactly; a string holding ``"``, ``\\`` or a control character is left to the
    final validation (documented). An array holding a string or an object is not: the
    constraint has no per-position items, so unless all its items are equal (then it is
    ``items`` with a fixed count) it is refused, as is an object key holding ``"``, ``\\``
    or a control character."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, member in node.items():
                if not _plain_text(key):
                    return f"the object key {key!r} holds a quote, a backslash or a control character"
                stack.append(member)
        elif isinstance(node, list) and node:
            if not _holds_text(node):
                continue  # no string, no key: written as its JSON text
            if not all_equal(node):
                return "an array holding strings or objects (the constraint writes such an array only when all its items are equal)"
            stack.append(node[0])
    return None


def all_equal(items: list[Any]) -> bool:
    """Whether the JSON values ``items`` are all the same value, compared as JSON text
    (Python's ``==`` takes ``true`` for ``1``, inside objects and arrays too)."""
    first = json.dumps(items[0], sort_keys=True) if items else ""
    return all(json.dumps(item, sort_keys=True) == first for item in items[1:])


def _holds_text(value: Any) -> bool:
    """Whether a JSON value holds a string or an object key anywhere (its JSON text holds a
    quote), found without recursion."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str) or (isinstance(node, dict) and node):
            return True
        if isinstance(node, list):
            stack.extend(node)
    return False


def _fits(value: Any, siblings: dict[str, Any]) -> bool:
    """Whether ``value`` satisfies ``siblings`` (keywords without subschemas); True when
    they cannot be read (the metaschema check names a malformed keyword)."""
    try:
        return bool(Draft202012Validator(siblings).is_valid(value))
    except Exception:  # noqa: BLE001 - a malformed keyword or pattern: refused elsewhere
        return True


def _number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is a JSON number (a boolean is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _value_problems(node: dict[str, Any], path: tuple[str, ...]) -> Iterator[SchemaProblem]:
    """An ``enum``/``const`` none of whose values satisfies the keywords beside it (no value
    satisfies the schema), and values the token mask cannot write exactly."""
    enum = node.get("enum")
    if "enum" in node and not (isinstance(enum, list) and enum):
        return  # empty (refused above) or malformed (the metaschema check)
    key = "enum" if isinstance(enum, list) else "const"
    values: list[tuple[tuple[str, ...], Any]]
    values = [((key, str(i)), v) for i, v in enumerate(enum)] if isinstance(enum, list) else [((key,), node["const"])]
    siblings = {k: node[k] for k in (*_VALUE_SIBLINGS, "const") if k in node and k != key}
    if siblings:
        values = [(where, v) for where, v in values if _fits(v, siblings)]
        if not values:
            beside = ", ".join(sorted(siblings))
            unmet = f"no {key} value satisfies the keywords beside it ({beside}): no value can satisfy it"
            yield SchemaProblem(pointer((*path, key)), key, unmet)
            return
    for where, v in values:
        reason = literal_problem(v)
        if reason is not None:
            yield SchemaProblem(pointer((*path, *where)), key, f"the constraint cannot write this {key} value exactly: {reason}")


def _value_depth(value: Any) -> int:
    """JSON nesting depth of a literal value, iteratively (a deep value must not recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH + 1:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _subschemas(node: dict[str, Any], path: tuple[str, ...]) -> Iterator[tuple[Any, tuple[str, ...], bool]]:
    """(subschema, path, boolean allowed) for every subschema position of ``node``."""
    properties = node.get("properties")
    if isinstance(properties, dict):
        for name, sub in properties.items():
            yield sub, (*path, "properties", name), False
    if "additionalProperties" in node:
        yield node["additionalProperties"], (*path, "additionalProperties"), True
    if "items" in node and not isinstance(node["items"], list):
        yield node["items"], (*path, "items"), False
    if isinstance(node.get("anyOf"), list):
        for i, sub in enumerate(node["anyOf"]):
            yield sub, (*path, "anyOf", str(i)), False
    for key in DEFS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, (*path, key, name), False


def _node_problems(root: dict[str, Any], node: dict[str, Any], path: tuple[str, ...], depth: int) -> Iterator[SchemaProblem]:
    for key in node:
        if key not in SUPPORTED and key not in ANNOTATIONS:
            yield SchemaProblem(pointer((*path, key)), key, f"unsupported keyword {key}")
    properties = node.get("properties")
    if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
        yield SchemaProblem(
            pointer((*path, "properties")), "properties", f"{len(properties)} properties exceed the limit of {MAX_PROPERTIES}"
        )
    if isinstance(node.get("items"), list):
        yield SchemaProblem(pointer((*path, "items")), "items", "items as an array (tuple validation) is not supported")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#/"):
            yield SchemaProblem(pointer((*path, "$ref")), "$ref", f"$ref {ref!r} is not local (only #/$defs/... is supported)")
        else:
            try:
                target = resolve_local_ref(root, ref)
            except LookupError as exc:
                yield SchemaProblem(pointer((*path, "$ref")), "$ref", str(exc))
            else:
                if not isinstance(target, dict):
                    yield SchemaProblem(pointer((*path, "$ref")), "$ref", f"$ref {ref} does not point at a schema object")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and (reason := _pattern_problem(pattern)) is not None:
        yield SchemaProblem(pointer((*path, "pattern")), "pattern", reason)
    kind = node.get("type")
    numeric = kind in ("integer", "number") or (isinstance(kind, list) and bool(kind) and set(kind) <= {"integer", "number"})
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum")):
        if low == "minimum" and not numeric:  # another type's values pass numeric bounds
            continue
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int | float) and isinstance(hi, int | float) and not isinstance(lo, bool) and not isinstance(hi, bool) and lo > hi:
            yield SchemaProblem(pointer((*path, low)), low, f"{low} {lo} exceeds {high} {hi}: no value can satisfy it")
    lo, hi = node.get("minimum"), node.get("maximum")
    if (kind == "integer" or kind == ["integer"]) and _number(lo) and _number(hi) and lo <= hi and math.ceil(lo) > math.floor(hi):
        yield SchemaProblem(
            pointer((*path, "minimum")), "minimum", f"no integer lies between minimum {lo} and maximum {hi}: no value can satisfy it"
        )
    for key in ("enum", "type"):
        if node.get(key) == []:
            yield SchemaProblem(pointer((*path, key)), key, f"an empty {key} list: no value can satisfy it")
    if "enum" in node or "const" in node:
        yield from _value_problems(node, path)
    required = node.get("required")
    if kind == "object" and node.get("additionalProperties") is False and isinstance(required, list) and (properties is None or isinstance(properties, dict)):
        missing = [name for name in required if isinstance(name, str) and name not in (properties or {})]
        if missing:
            yield SchemaProblem(
                pointer((*path, "required")), "required", f"{missing[0]!r} is required but not a property, and additionalProperties is false"
            )
    for key in _VALUES:
        if key in node and depth + _value_depth(node[key]) > MAX_DEPTH + 1:
            yield SchemaProblem(pointer((*path, key)), key, f"nesting depth exceeds the limit of {MAX_DEPTH}")


def _walk(root: dict[str, Any]) -> list[SchemaProblem]:
    problems: list[SchemaProblem] = []
    stack: list[tuple[Any, tuple[str, ...], int, bool]] = [(root, (), 1, False)]
    while stack:
        node, path, depth, bool_ok = stack.pop()
        if isinstance(node, bool):
            if not bool_ok:
                problems.append(SchemaProblem(pointer(path), None, "boolean schemas are supported only as additionalProperties"))
            continue
        if not isinstance(node, dict):
            continue  # a malformed position: the Draft 2020-12 metaschema check names it
        if depth > MAX_DEPTH:
            problems.append(SchemaProblem(pointer(path), None, f"nesting depth exceeds the limit of {MAX_DEPTH}"))
            continue
        problems.extend(_node_problems(root, node, path, depth))
        children = list(_subschemas(node, path))
        stack.extend((sub, sub_path, depth + 1, ok) for sub, sub_path, ok in reversed(children))
    return problems


def _direct_refs(root: dict[str, Any], node: Any) -> Iterator[str]:
    """Refs reachable from ``node`` without consuming input: through ``$ref`` and ``anyOf``
    only (``properties``/``items``/``additionalProperties`` each consume a nesting level)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, dict):
            continue
        if isinstance(current.get("$ref"), str):
            yield current["$ref"]
        if isinstance(current.get("anyOf"), list):
            stack.extend(current["anyOf"])


def _ref_cycles(root: dict[str, Any]) -> list[SchemaProblem]:
    """Refs that reach themselves without consuming input (``{"$ref": "#/$defs/a"}`` inside
    ``a``): such a schema would make the constraint (and validation) recurse forever.
    Recursion through ``properties``/``items`` is fine: it is expanded lazily."""
    graph: dict[str, list[str]] = {}
    pending = list(_direct_refs(root, root))
    stack: list[Any] = [root]
    while stack:  # every ref anywhere in the schema
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                pending.append(node["$ref"])
            stack.extend(v for k, v in node.items() if k not in _VALUES)
        elif isinstance(node, list):
            stack.extend(node)
    while pending:
        ref = pending.pop()
        if ref in graph:
            continue
        try:
            target = resolve_local_ref(root, ref)
        except LookupError:
            graph[ref] = []
            continue
        graph[ref] = list(_direct_refs(root, target))
        pending.extend(graph[ref])
    problems = []
    for start in sorted(graph):
        seen, frontier = set(), list(graph[start])
        while frontier:
            ref = frontier.pop()
            if ref == start:
                problems.append(SchemaProblem(start[1:], "$ref", f"$ref {start} refers back to itself without nesting"))
                break
            if ref not in seen:
                seen.add(ref)
                frontier.extend(graph.get(ref, ()))
    return problems


def _refuse(problems: list[SchemaProblem], param: str) -> ResponseFormatUnsupported:
    message = "the schema cannot be constrained: " + "; ".join(p.describe() for p in problems)
    return ResponseFormatUnsupported(message, param=param, problems=tuple(problems))


def check_schema(schema: object, param: str = SCHEMA_PARAM) -> None:
    """Refuse (raise :class:`ResponseFormatUnsupported`) a schema millm cannot enforce.

    Refused, all at once with each keyword's JSON pointer: a schema that is not an object;
    a keyword outside the subset (``type``, ``properties``, ``required``,
    ``additionalProperties``, ``items``, ``minItems``, ``maxItems``, ``enum``, ``const``,
    ``minimum``, ``maximum``, ``minLength``, ``maxLength``, ``pattern``, ``anyOf``, local
    ``$ref`` into ``$defs``/``definitions``; annotations ``title``, ``description``,
    ``default``, ``examples`` are ignored); a boolean subschema other than
    ``additionalProperties``; a ``$ref`` that is remote, points outside ``$defs`` or points
    nowhere, or that refers back to itself without nesting; a ``pattern`` the constraint's
    regex engine cannot compile or enforce (a lookaround, a backreference, ``\\b``, …);
    an ``enum``/``const`` value the mask cannot write exactly (:func:`literal_problem`);
    what no value satisfies: ``minLength > maxLength``, ``minItems > maxItems``,
    ``minimum > maximum`` on a number (or no integer between them on an integer), an
    ``enum``/``const`` none of whose values satisfies the keywords beside it, an empty
    ``enum`` or ``type``, a required name that cannot be a property;
    nesting deeper than 32, more than 256 properties in one object; and finally a schema
    that is not valid Draft 2020-12 (:func:`check_validator`). Before any of that, and
    alone: more than 64 KiB serialised, or more than 128 distinct patterns (each pattern
    is compiled while the request is checked).
    """
    if not isinstance(schema, dict):
        kind = "a boolean" if isinstance(schema, bool) else type(schema).__name__
        problem = SchemaProblem("", None, f"the schema must be a JSON object, not {kind}")
        raise _refuse([problem], param)
    # The cheap limits first: the walk compiles every pattern it meets.
    try:
        size: int | None = len(json.dumps(schema).encode())
    except RecursionError:  # nested past the interpreter's limit: the walk names the depth
        size = None
    if size is not None and size > MAX_BYTES:
        raise _refuse([SchemaProblem("", None, f"the schema is {size} bytes, over the limit of {MAX_BYTES}")], param)
    patterns = _distinct_patterns(schema)
    if patterns > MAX_PATTERNS:
        raise _refuse([SchemaProblem("", "pattern", f"the schema has {patterns} distinct patterns, over the limit of {MAX_PATTERNS}")], param)
    problems = _walk(schema)
    if not problems and size is not None:
        problems = _ref_cycles(schema)
    if problems:
        raise _refuse(problems, param)
    check_validator(schema, param)


def _distinct_patterns(schema: object) -> int:
    """How many distinct ``pattern`` strings ``schema`` holds, counted without recursion."""
    found: set[str] = set()
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.add(node["pattern"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return len(found)


def check_validator(schema: object, param: str = SCHEMA_PARAM) -> None:
    """Refuse a schema that is not a valid Draft 2020-12 schema (a ``minLength`` that is a
    string, an unknown ``type`` name, ``required`` with duplicates, …), naming the problem."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = pointer(tuple(str(p) for p in exc.path))
        problem = SchemaProblem(where, str(exc.path[-1]) if exc.path else None, f"not a valid Draft 2020-12 schema: {exc.message}")
        raise ResponseFormatUnsupported(f"the schema cannot be served: {problem.describe()}", param=param, problems=(problem,)) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def validate(document: str, schema: dict[str, Any] | None) -> str | None:
    """Check a finished document: ``None`` when ``document`` is one JSON value that
    validates against ``schema`` (``None`` schema: ``json_object`` mode, any JSON object),
    else a short reason. ``NaN``/``Infinity`` are not JSON and are refused."""
    try:
        value = json.loads(document, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    if schema is None:
        return None if isinstance(value, dict) else f"not a JSON object but {_json_type(value)}"
    error: ValidationError | None = best_match(Draft202012Validator(schema).iter_errors(value))
    if error is None:
        return None
    where = pointer(tuple(str(p) for p in error.absolute_path)) or "(root)"
    message = error.message if len(error.message) <= 200 else error.message[:197] + "..."
    return f"{message} at {where}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"
