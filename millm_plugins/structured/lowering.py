"""Schema lowering: a checked schema of millm's subset rewritten into the dialect
lm-format-enforcer 0.11.3 handles without crashing or silently loosening it (each rule
names the quirk it works around; see :mod:`.constraint` for what the mask still cannot
enforce)."""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator

from .schema import ANNOTATIONS, DEFS, all_equal, enforcer_pattern, resolve_local_ref

# "integer" is a subset of "number" and "number" already generates it.
_ANY_TYPES = ("object", "array", "string", "number", "boolean", "null")


class _Literal(float):
    """A JSON value the parser must emit verbatim. The library's ``enum`` support emits
    a number list as the ``str()`` of each item, unquoted; this float's ``str()`` is any
    JSON text without quotes or backslashes (``true``, ``null``, ``[1,2]``), which is how
    non-string ``enum``/``const`` values are enforced exactly. (Its own handling passes
    ``true`` through as ``True``, and crashes on a numeric ``const``.)"""

    text: str

    def __new__(cls, text: str) -> _Literal:
        value = super().__new__(cls, 0.0)
        value.text = text
        return value

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"_Literal({self.text!r})"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _type_set(types: Any) -> set[str]:
    return set(types) if isinstance(types, list) else {types}


def _merge(outer: dict[str, Any], branch: dict[str, Any]) -> dict[str, Any] | None:
    """``branch`` with the keywords written beside its ``anyOf``; ``None`` when their
    types cannot meet. ``required`` is united, ``properties`` joined, ``type`` intersected
    (integer within number); for any other keyword in both, the branch's wins (loose)."""
    merged = dict(branch)
    for key, value in outer.items():
        if key not in merged:
            merged[key] = value
        elif key == "required":
            merged[key] = list(dict.fromkeys([*merged[key], *value]))
        elif key == "properties":
            merged[key] = {**value, **merged[key]}
        elif key == "type":
            a, b = _type_set(value), _type_set(merged[key])
            both = (a & b) | ({"integer"} if ("integer" in a and "number" in b) or ("number" in a and "integer" in b) else set())
            if not both:
                return None
            merged[key] = sorted(both)
    return merged


class _Lowerer:
    """Rewrites a schema checked by :func:`~.schema.check_schema` into what
    ``JsonSchemaParser`` enforces correctly. Refs become ``#/$defs/d<n>`` into one root
    ``$defs`` (the library resolves a ref by its last path segment, in the root only),
    lowered lazily so recursive schemas stay finite."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.names: dict[str, str] = {}
        self.defs: dict[str, Any] = {}
        self.pending: list[str] = []

    def lower(self) -> dict[str, Any]:
        top = self.node(self.root)
        while self.pending:
            ref = self.pending.pop()
            self.defs[self.names[ref]] = self.node(resolve_local_ref(self.root, ref))
        if self.defs:
            top = {**top, "$defs": self.defs}
        return top

    def ref(self, ref: str) -> dict[str, Any]:
        if ref not in self.names:
            self.names[ref] = f"d{len(self.names)}"
            self.pending.append(ref)
        return {"$ref": f"#/$defs/{self.names[ref]}"}

    def node(self, schema: dict[str, Any]) -> dict[str, Any]:
        s = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in DEFS}
        if "$ref" in s:
            return self.ref(s["$ref"])
        if "anyOf" in s:
            outer = {k: v for k, v in s.items() if k != "anyOf"}
            merged = [m for m in (_merge(outer, b) for b in s["anyOf"]) if m is not None]
            return {"anyOf": [self.node(m) for m in (merged or s["anyOf"])]}
        if "const" in s or "enum" in s:
            return self.values(s)
        types = s.get("type", list(_ANY_TYPES))
        if isinstance(types, list):
            kinds = list(dict.fromkeys(types))
            if "number" in kinds and "integer" in kinds:
                kinds.remove("integer")
            if len(kinds) != 1:  # the library drops every other keyword for a type list
                return {"anyOf": [self.typed(s, t) for t in kinds]}
            types = kinds[0]
        return self.typed(s, types)

    def values(self, s: dict[str, Any]) -> dict[str, Any]:
        candidates = list(s["enum"]) if "enum" in s else [s["const"]]
        rest = {k: v for k, v in s.items() if k not in ("enum", "const")}
        if "enum" in s and "const" in s:
            rest["const"] = s["const"]
        if rest:  # enum values must also satisfy the keywords beside them
            validator = Draft202012Validator({**rest, **{k: self.root[k] for k in DEFS if k in self.root}})
            candidates = [v for v in candidates if validator.is_valid(v)] or candidates
        branches: list[dict[str, Any]] = []
        strings = [v for v in candidates if isinstance(v, str)]
        plain = [v for v in strings if not any(c in '"\\' or ord(c) < 0x20 for c in v)]
        if plain:
            branches.append({"enum": list(dict.fromkeys(plain))})
        loose = {"string"} if len(plain) < len(strings) else set()
        texts = []
        exact: list[dict[str, Any]] = []
        for value in candidates:
            if not isinstance(value, str):
                text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
                if '"' not in text and "\\" not in text:
                    texts.append(text)
                elif isinstance(value, dict):
                    exact.append(self.literal_object(value))
                elif isinstance(value, list) and all_equal(value):
                    items = self.values({"const": value[0]})
                    exact.append({"type": "array", "items": items, "minItems": len(value), "maxItems": len(value)})
                else:  # refused by check_schema (literal_problem): never reached for a checked schema
                    loose.add(_json_type(value))
        if texts:
            branches.append({"enum": [_Literal(t) for t in dict.fromkeys(texts)]})
        branches += exact
        branches += [self.typed({}, t) for t in sorted(loose)]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def literal_object(self, value: dict[str, Any]) -> dict[str, Any]:
        """An object value of an ``enum``/``const`` as the object schema that admits it
        alone: each member a ``const`` of its own, every key required, no other key (the
        library generates only the listed properties)."""
        return {
            "type": "object",
            "properties": {key: self.values({"const": member}) for key, member in value.items()},
            "required": list(value),
        }

    def typed(self, s: dict[str, Any], kind: str) -> dict[str, Any]:
        if kind == "string":
            out: dict[str, Any] = {"type": "string"}
            if "pattern" in s:  # the library refuses pattern with lengths: keep the pattern
                out["pattern"] = enforcer_pattern(s["pattern"])
            elif s.get("maxLength") == 0:  # its free-text shortcut reads 0 as "no limit"
                return {"enum": [""]}
            else:
                out.update({k: s[k] for k in ("minLength", "maxLength") if k in s})
            return out
        if kind == "array":
            if s.get("maxItems") == 0:  # the library would still allow one item
                return {"enum": [_Literal("[]")]}
            out = {"type": "array", **{k: s[k] for k in ("minItems", "maxItems") if k in s}}
            if isinstance(s.get("items"), dict):
                out["items"] = self.node(s["items"])
            return out
        if kind == "object":
            return self.object(s)
        return {"type": kind}  # number and integer bounds are not enforced by the library

    def object(self, s: dict[str, Any]) -> dict[str, Any]:
        required = list(s.get("required", []))
        extra = s.get("additionalProperties", True)
        out: dict[str, Any] = {"type": "object", "required": required}
        if "properties" in s:
            # With properties the library generates only those keys (stricter than
            # additionalProperties); a required key missing from them would never come.
            properties = {k: self.node(v) for k, v in s["properties"].items()}
            for key in required:
                if key not in properties and extra is not False:
                    properties[key] = self.node(extra if isinstance(extra, dict) else {})
            out["properties"] = properties
        elif extra is False:
            out["properties"] = {}  # the library reads additionalProperties: false as "any"
        elif isinstance(extra, dict):
            out["additionalProperties"] = self.node(extra)
        # additionalProperties: true crashes the library; absent means the same.
        return out


def lower(schema: dict[str, Any] | None) -> dict[str, Any]:
    """``schema`` (checked by :func:`~.schema.check_schema`) rewritten for the library's
    ``JsonSchemaParser``; ``None`` (``json_object`` mode) is any JSON object."""
    return _Lowerer(schema if schema is not None else {"type": "object"}).lower()


def patterns_in(node: Any) -> set[str]:
    """Every ``pattern`` a lowered schema holds, at any depth."""
    found: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if current.get("type") == "string" and isinstance(current.get("pattern"), str):
                found.add(current["pattern"])
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


def schema_patterns(schema: dict[str, Any] | None) -> set[str]:
    """Every ``pattern`` the rows of ``schema`` (checked) are constrained by, as the
    constraint's parser asks for them."""
    return patterns_in(lower(schema))
