"""millm's JSON Schema subset: what is refused (each keyword named with its JSON pointer),
the limits, local refs, the final validation, and a hypothesis property over schemas
drawn from the subset. The strategies here are reused by ``test_constraint.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from millm_core.api import InvalidRequest
from millm_plugins.structured.schema import (
    MAX_BYTES,
    MAX_DEPTH,
    MAX_PATTERNS,
    MAX_PROPERTIES,
    ResponseFormatUnsupported,
    check_schema,
    check_validator,
    enforcer_pattern,
    pointer,
    validate,
)

PARAM = "response_format.json_schema.schema"

# ---------------------------------------------------------------- strategies

NAMES = st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True)
# Printable ASCII without quote or backslash: what the constraint reproduces exactly.
PLAIN = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=6)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-500, 500), PLAIN)
# Quotes, backslashes, control characters and a non-ASCII letter. (A character that no
# token of the vocabulary spells whole cannot be generated at all; see test_constraint.)
WILD = st.text(st.characters(max_codepoint=0x7E) | st.just("é"), max_size=4)
PATTERNS = st.sampled_from([r"^[a-z]{2,4}$", r"^\d{3}-\d{2}$", r"[A-Z][a-z]{0,3}", r"^(yes|no|maybe)$", r"^x\u0079z$"])
TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]
# enum/const objects and arrays the constraint writes exactly: objects member by member,
# arrays of equal items (an array of different strings or objects is refused).
LITERALS = st.recursive(
    SCALARS,
    lambda inner: st.dictionaries(NAMES, inner, max_size=3) | st.tuples(inner, st.integers(0, 2)).map(lambda pair: [pair[0]] * pair[1]),
    max_leaves=5,
)


def _json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _string(draw: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if draw(st.booleans()):
        schema["pattern"] = draw(PATTERNS)
        return schema
    low = draw(st.none() | st.integers(0, 3))
    if low is not None:
        schema["minLength"] = low
    if draw(st.booleans()):
        schema["maxLength"] = draw(st.integers(low or 0, 8))
    return schema


@st.composite
def enforced_leaves(draw: Any) -> dict[str, Any]:
    """Leaf schemas whose every keyword the constraint enforces."""
    kind = draw(
        st.sampled_from(["string", "integer", "number", "boolean", "null", "enum", "const", "object_enum", "typed_enum", "types", "any"])
    )
    if kind == "string":
        schema = _string(draw)
    elif kind == "enum":
        schema = {"enum": draw(st.lists(SCALARS, min_size=1, max_size=4, unique_by=_json_key))}
    elif kind == "const":
        schema = {"const": draw(SCALARS | st.lists(st.integers(-9, 9) | st.booleans() | st.none(), max_size=3) | LITERALS)}
    elif kind == "object_enum":  # objects (and arrays of equal items) are written member by member
        schema = {"enum": draw(st.lists(LITERALS, min_size=1, max_size=3, unique_by=_json_key))}
    elif kind == "typed_enum":  # enum values are filtered by the keywords beside them
        kind, fitting = draw(st.sampled_from([("string", PLAIN), ("integer", st.integers(-9, 9)), ("boolean", st.booleans())]))
        values = [draw(fitting), *draw(st.lists(SCALARS, max_size=4))]
        schema = {"type": kind, "enum": list({_json_key(v): v for v in values}.values())}
    elif kind == "types":
        schema = {"type": draw(st.lists(st.sampled_from(TYPES[2:]), min_size=2, max_size=3, unique=True))}
        if draw(st.booleans()):
            schema["maxLength"] = draw(st.integers(0, 4))
    elif kind == "any":
        schema = {}
    else:
        schema = {"type": kind}
    if draw(st.integers(0, 4)) == 0:
        schema["description"] = draw(PLAIN)
    return schema


@st.composite
def _object(draw: Any, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    properties = draw(st.dictionaries(NAMES, children, max_size=4))
    required = sorted(draw(st.sets(st.sampled_from(sorted(properties)))) if properties else set())
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    extra = draw(st.sampled_from(["absent", "false", "true", "schema", "no_properties"]))
    if extra == "false":
        schema["additionalProperties"] = False
    elif extra == "true":
        schema["additionalProperties"] = True
        schema["required"] = sorted({*required, "extra"})  # a required key outside properties
    elif extra == "schema":
        schema["additionalProperties"] = draw(children)
    elif extra == "no_properties":
        del schema["properties"]
        schema["required"] = []
        if draw(st.booleans()):
            schema["additionalProperties"] = draw(children)
    if properties and "properties" in schema and draw(st.integers(0, 3)) == 0:  # anyOf of required keys beside properties
        schema["anyOf"] = [{"required": [name]} for name in sorted(properties)[:2]]
    return schema


@st.composite
def _array(draw: Any, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": draw(children)}
    low = draw(st.none() | st.integers(0, 2))
    if low is not None:
        schema["minItems"] = low
    if draw(st.booleans()):
        schema["maxItems"] = draw(st.integers(low or 0, 3))
    return schema


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        _object(children), _array(children), st.lists(children, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches})
    )


@st.composite
def _with_ref(draw: Any, inner: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """Moves a drawn schema into ``$defs`` and refers to it from a property, or not."""
    schema = draw(inner)
    if not draw(st.booleans()):
        return schema
    defs = "$defs" if draw(st.booleans()) else "definitions"
    return {defs: {"thing": schema}, "type": "object", "properties": {"x": {"$ref": f"#/{defs}/thing"}}, "required": ["x"]}


def enforced_schemas(max_leaves: int = 6) -> st.SearchStrategy[dict[str, Any]]:
    """Small schemas from the subset, using only what the constraint enforces."""
    return _with_ref(st.recursive(enforced_leaves(), _extend, max_leaves=max_leaves))


@st.composite
def _validation_only_leaves(draw: Any) -> dict[str, Any]:
    """Leaves whose keywords are in the subset but enforced by the final validation alone
    (or only partly by the constraint): numeric bounds, pattern beside lengths, enum
    strings with quotes, backslashes or non-ASCII text, $ref beside other keywords."""
    kind = draw(st.sampled_from(["bounds", "pattern_lengths", "wild_enum", "ref_siblings"]))
    if kind == "bounds":
        low = draw(st.integers(-50, 50))
        return {"type": draw(st.sampled_from(["integer", "number"])), "minimum": low, "maximum": low + draw(st.integers(0, 100))}
    if kind == "pattern_lengths":
        return {"type": "string", "pattern": draw(PATTERNS), "minLength": 1, "maxLength": 4}
    if kind == "wild_enum":
        wild = WILD | WILD.map(lambda text: [text, text]) | st.dictionaries(NAMES, WILD, max_size=2)
        return {"enum": draw(st.lists(wild, min_size=1, max_size=3, unique_by=_json_key))}
    return {"$ref": "#/$defs/shared", "maximum": 3}  # subset_schemas puts "shared" in the root


def _with_shared(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": {**schema.get("$defs", {}), "shared": {"type": "integer"}}}


def subset_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Schemas from the whole supported subset (annotations included)."""
    leaves = st.one_of(enforced_leaves(), _validation_only_leaves())
    annotated = st.builds(
        lambda schema, notes: {**schema, **notes},
        st.recursive(leaves, _extend, max_leaves=8),
        st.fixed_dictionaries({}, optional={"title": PLAIN, "default": SCALARS, "examples": st.lists(SCALARS, max_size=2)}),
    )
    return _with_ref(annotated).map(_with_shared)


# ---------------------------------------------------------------- refusals

REFUSED: list[tuple[str, Any]] = [
    ("multipleOf", 3),
    ("not", {"type": "string"}),
    ("uniqueItems", True),
    ("allOf", [{"type": "integer"}]),
    ("oneOf", [{"type": "integer"}, {"type": "null"}]),
    ("if", {"minimum": 3}),
    ("then", {"maximum": 9}),
    ("else", {"maximum": 1}),
    ("format", "date-time"),
    ("patternProperties", {"^x": {"type": "integer"}}),
    ("dependentRequired", {"a": ["b"]}),
    ("$schema", "https://json-schema.org/draft/2020-12/schema"),
    ("exclusiveMinimum", 0),
    ("exclusiveMaximum", 10),
    ("prefixItems", [{"type": "integer"}]),
    ("contains", {"type": "integer"}),
    ("propertyNames", {"maxLength": 3}),
    ("minProperties", 1),
    ("maxProperties", 4),
    ("unevaluatedProperties", False),
    ("dependentSchemas", {"a": {"required": ["b"]}}),
    ("$id", "https://example.com/age"),
    ("$anchor", "age"),
    ("$dynamicRef", "#meta"),
    ("contentEncoding", "base64"),
    ("$comment", "not an accepted annotation"),
    ("nullable", True),
]


def _refusal(schema: object) -> ResponseFormatUnsupported:
    with pytest.raises(ResponseFormatUnsupported) as info:
        check_schema(schema, PARAM)
    return info.value


@pytest.mark.parametrize(("keyword", "value"), REFUSED, ids=[k for k, _ in REFUSED])
def test_each_unsupported_keyword_is_refused_with_its_pointer(keyword: str, value: Any) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", keyword: value}}}
    error = _refusal(schema)
    assert isinstance(error, InvalidRequest)
    assert (error.status, error.code, error.param) == (400, "response_format_unsupported", PARAM)
    where = pointer(("properties", "age", keyword))
    assert f"unsupported keyword {keyword} at {where}" in error.message
    assert [(p.pointer, p.keyword) for p in error.problems] == [(where, keyword)]


def test_remote_and_non_defs_refs_are_refused() -> None:
    for ref in ("https://example.com/person.json", "person.json#/$defs/a", "#/properties/b", "#"):
        error = _refusal({"type": "object", "properties": {"a": {"$ref": ref}, "b": {"type": "string"}}})
        assert error.problems[0].pointer == "/properties/a/$ref"
        assert ref in error.message and "/properties/a/$ref" in error.message


def test_several_unsupported_keywords_are_named_in_one_error() -> None:
    schema = {
        "type": "object",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "properties": {
            "age": {"type": "integer", "multipleOf": 2},
            "tags": {"type": "array", "items": {"type": "string", "format": "email"}, "uniqueItems": True},
            "a/b~c": {"not": {"type": "null"}},
        },
        "oneOf": [{"required": ["age"]}],
    }
    error = _refusal(schema)
    expected = {
        ("/$schema", "$schema"),
        ("/properties/age/multipleOf", "multipleOf"),
        ("/properties/tags/items/format", "format"),
        ("/properties/tags/uniqueItems", "uniqueItems"),
        ("/properties/a~1b~0c/not", "not"),
        ("/oneOf", "oneOf"),
    }
    assert {(p.pointer, p.keyword) for p in error.problems} == expected
    for where, keyword in expected:
        assert f"{keyword} at {where}" in error.message


def test_a_schema_must_be_an_object_and_booleans_only_additional_properties() -> None:
    for schema in (True, False, [], "string", 3, None):
        assert "must be a JSON object" in _refusal(schema).message
    error = _refusal({"type": "object", "properties": {"a": True, "b": {"type": "array", "items": False}}})
    assert {p.pointer for p in error.problems} == {"/properties/a", "/properties/b/items"}
    check_schema({"type": "object", "properties": {"a": {"type": "object", "additionalProperties": True}}, "additionalProperties": False})


def test_items_as_an_array_is_refused() -> None:
    assert _refusal({"type": "array", "items": [{"type": "string"}]}).problems[0].pointer == "/items"


def test_contradictory_lengths_are_refused() -> None:
    assert _refusal({"type": "string", "minLength": 5, "maxLength": 2}).problems[0].keyword == "minLength"
    assert _refusal({"type": "array", "minItems": 3, "maxItems": 1}).problems[0].keyword == "minItems"
    check_schema({"type": "string", "minLength": 2, "maxLength": 2})


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"label": {"enum": ["humor", "not_humor"]}}, "required": ["label"], "additionalProperties": False},
        {"type": ["string", "null"], "maxLength": 3, "title": "t", "description": "d", "default": None, "examples": ["a"]},
        {
            "type": "array",
            "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "x"}]},
            "minItems": 1,
            "maxItems": 4,
        },
        {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "minLength": 1},
        {
            "$defs": {"p": {"type": "object", "properties": {"n": {"type": "number"}}}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/p"}},
        },
        {"definitions": {"p": {"type": "boolean"}}, "$ref": "#/definitions/p"},
        {"properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": {"type": "integer"}},
        {},
    ],
)
def test_supported_schemas_pass(schema: dict[str, Any]) -> None:
    check_schema(schema, PARAM)
    Draft202012Validator.check_schema(schema)


# ---------------------------------------------------------------- refs


def test_local_refs_resolve_and_missing_ones_are_refused() -> None:
    check_schema({"$defs": {"a": {"$defs": {"b": {"type": "null"}}}}, "$ref": "#/$defs/a/$defs/b"})
    check_schema({"$defs": {"a~b/c": {"type": "null"}}, "$ref": "#/$defs/a~0b~1c"})
    error = _refusal({"$defs": {"a": {"type": "null"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})
    assert error.problems[0].pointer == "/properties/x/$ref" and "points nowhere" in error.message
    assert "points nowhere" in _refusal({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}).message


def test_recursion_through_properties_is_allowed_but_a_ref_loop_is_refused() -> None:
    check_schema(
        {
            "$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
            "$ref": "#/$defs/node",
        }
    )
    loop = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    error = _refusal(loop)
    assert "refers back to itself" in error.message
    assert {p.pointer for p in error.problems} == {"/$defs/a", "/$defs/b"}


# ---------------------------------------------------------------- patterns


def test_patterns_the_constraint_cannot_compile_are_refused() -> None:
    assert "cannot enforce" in _refusal({"type": "string", "pattern": r"(a)\1"}).message
    assert "cannot enforce" in _refusal({"type": "string", "pattern": r"\bword\b"}).message
    assert "cannot enforce" in _refusal({"type": "string", "pattern": r"a$|b"}).message
    assert "not a valid regular expression" in _refusal({"type": "string", "pattern": "(unclosed"}).message
    check_schema({"type": "string", "pattern": r"^caf\u00e9$"})


@pytest.mark.parametrize(
    "pattern",
    [
        "^(?!abc)[a-c]{3}$",  # the automaton kept dead states: "abcdefg..." was generated
        "^[a-c](?!z)[a-c]{2}$",
        "^(?=b)[a-z]{3}$",  # accepted, then a 500 after generating
        "(?<=a)b",
        "(?<!a)b",
        "^(?:x(?=y)|z)+$",  # nested inside a group and a repeat
        "^[a-z]+(?P<tail>(?!q)[a-z])$",
    ],
)
def test_lookarounds_are_refused_like_other_unenforceable_syntax(pattern: str) -> None:
    """interegular parses every lookaround (and builds a lookahead's automaton), but the
    constraint cannot enforce one: refused up front, as a backreference or ``\\b`` is."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern, "maxLength": 5}}, "required": ["a"]}
    error = _refusal(schema)
    assert (error.code, error.param) == ("response_format_unsupported", PARAM)
    assert [(p.pointer, p.keyword) for p in error.problems] == [("/properties/a/pattern", "pattern")]
    assert "regular-expression syntax the constraint cannot enforce" in error.message and "lookahead or lookbehind" in error.message
    check_schema({"type": "string", "pattern": "^(?:ab|c)[?=!<]{2}$"})  # a plain group and the characters themselves are fine


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"const": ["a", "b"]}, "/const"),  # no per-position items: the order could not be held
        ({"enum": [1, [{"x": 1}, {"x": 2}]]}, "/enum/1"),
        ({"const": {"x": ["a", 1]}}, "/const"),  # at any depth
        ({"enum": [{'k"ey': 1}]}, "/enum/0"),  # a key the mask cannot spell
        ({"const": [{"a": 1}, {"a": True}]}, "/const"),  # equal to Python (True == 1), not to JSON
        ({"const": [[{"a": 1}], [{"a": True}]]}, "/const"),
    ],
)
def test_enum_and_const_values_the_mask_cannot_write_are_refused(value: dict[str, Any], where: str) -> None:
    error = _refusal({"type": "object", "properties": {"a": value}})
    assert error.problems[0].pointer == "/properties/a" + where and "cannot write this" in error.message


def test_enum_and_const_objects_and_arrays_of_equal_items_are_accepted() -> None:
    values: list[dict[str, Any]] = [{"const": {"x": 1}}, {"enum": [{"x": 1}, [1, 2]]}, {"const": ["a", "a"]}, {"const": {"x": {"y": [True]}}}, {"const": []}]
    for value in values:
        check_schema({"type": "object", "properties": {"a": value}})


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "enum": ["x"]}, "/enum"),
        ({"type": "string", "const": 3}, "/const"),
        ({"type": "boolean", "enum": [0, 1]}, "/enum"),  # 0 and 1 are no booleans
        ({"enum": ["a", "b"], "const": "c"}, "/enum"),
        ({"type": "string", "maxLength": 1, "enum": ["ab", "cd"]}, "/enum"),
        ({"type": "integer", "minimum": 1.5, "maximum": 1.7}, "/minimum"),
        ({"type": ["integer"], "minimum": -0.9, "maximum": -0.1}, "/minimum"),
    ],
)
def test_values_that_cannot_meet_their_schema_are_refused(schema: dict[str, Any], where: str) -> None:
    """Each was accepted and failed with a 500 after the model had written what it could."""
    error = _refusal({"type": "object", "properties": {"a": schema}})
    assert error.problems[0].pointer == "/properties/a" + where and "no value can satisfy it" in error.message


def test_values_that_can_meet_their_schema_are_accepted() -> None:
    for schema in (
        {"type": "string", "enum": ["a", 1]},  # 1 is filtered out, "a" is left
        {"type": "integer", "enum": [1.0]},  # 1.0 is an integer
        {"type": "integer", "minimum": 1.5, "maximum": 2},
        {"type": "number", "minimum": 1.5, "maximum": 1.7},
        {"type": ["integer", "null"], "minimum": 1.5, "maximum": 1.7},  # null
        {"enum": ["a", "b"], "const": "b"},
    ):
        check_schema({"type": "object", "properties": {"a": schema}})


def test_enforcer_pattern_strips_outer_anchors_only() -> None:
    assert enforcer_pattern("^[a-z]+$") == "(?:[a-z]+)"
    assert enforcer_pattern("[a-z]+") == "(?:[a-z]+)"
    assert enforcer_pattern(r"a\$") == r"(?:a\$)"  # an escaped dollar is a character
    assert enforcer_pattern(r"^\u00e9$") == "(?:é)"
    assert enforcer_pattern(r"\\u00e9") == r"(?:\\u00e9)"  # an escaped backslash, then text


# ---------------------------------------------------------------- limits


def _sized(size: int) -> dict[str, Any]:
    base = {"type": "string", "description": ""}
    schema = {**base, "description": "x" * (size - len(json.dumps(base).encode()))}
    assert len(json.dumps(schema).encode()) == size
    return schema


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_size_limit() -> None:
    check_schema(_sized(MAX_BYTES))
    error = _refusal(_sized(MAX_BYTES + 1))
    assert f"{MAX_BYTES + 1} bytes" in error.message and error.problems[0].pointer == ""


def test_size_and_pattern_count_are_checked_before_any_pattern_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a pattern costs; a schema of thousands of them (a 4 MiB body holds a
    great many) is refused on the cheap limits alone, with nothing compiled."""
    from millm_plugins.structured import schema as module

    def patterns(n: int) -> dict[str, Any]:
        return {"anyOf": [{"type": "string", "pattern": f"(?:a{i}|b{i})[a-z]{{0,8}}"} for i in range(n)]}

    check_schema(patterns(MAX_PATTERNS))
    compiled: list[str] = []
    real = module._pattern_problem
    monkeypatch.setattr(module, "_pattern_problem", lambda p: compiled.append(p) or real(p))
    error = _refusal(patterns(MAX_PATTERNS + 1))
    assert f"{MAX_PATTERNS + 1} distinct patterns" in error.message and len(error.problems) == 1
    big = {**patterns(MAX_PATTERNS), "description": "x" * MAX_BYTES}
    assert "bytes, over the limit" in _refusal(big).message and len(_refusal(big).problems) == 1
    assert compiled == []


def test_depth_limit() -> None:
    check_schema(_nested(MAX_DEPTH))
    error = _refusal(_nested(MAX_DEPTH + 1))
    assert "nesting depth" in error.message
    assert error.problems[0].pointer == "/items" * MAX_DEPTH


def test_a_deep_literal_counts_towards_depth_and_does_not_recurse() -> None:
    deep: Any = 1
    for _ in range(5000):
        deep = [deep]
    assert _refusal({"const": deep}).problems[0].pointer == "/const"


def test_property_count_limit() -> None:
    def props(n: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}

    check_schema(props(MAX_PROPERTIES))
    error = _refusal({"type": "object", "properties": {"inner": props(MAX_PROPERTIES + 1)}})
    assert error.problems[0].pointer == "/properties/inner/properties"
    assert f"{MAX_PROPERTIES + 1} properties" in error.message


# ---------------------------------------------------------------- metaschema


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "strin"}, "/type"),
        ({"type": "string", "minLength": "3"}, "/minLength"),
        ({"type": "object", "required": ["a", "a"]}, "/required"),
        ({"type": "object", "properties": {"a": {"maxItems": -1}}}, "/properties/a/maxItems"),
    ],
)
def test_invalid_draft_2020_12_schemas_are_refused(schema: dict[str, Any], where: str) -> None:
    with pytest.raises(ResponseFormatUnsupported) as info:
        check_validator(schema, PARAM)
    assert info.value.code == "response_format_unsupported" and info.value.param == PARAM
    assert "Draft 2020-12" in info.value.message and info.value.problems[0].pointer == where
    with pytest.raises(ResponseFormatUnsupported):
        check_schema(schema, PARAM)  # the subset check ends with the metaschema check


# ---------------------------------------------------------------- validate

PERSON = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"], "additionalProperties": False}


def test_validate() -> None:
    assert validate('{"age": 3}', PERSON) is None
    assert validate(' {"age": 3}\n\n', PERSON) is None
    reason = validate('{"age": -1}', PERSON)
    assert reason is not None and "minimum" in reason and "/age" in reason
    reason = validate('{"age": 3, "x": 1}', PERSON)
    assert reason is not None and "'x'" in reason
    reason = validate('{"age": 3', PERSON)
    assert reason is not None and reason.startswith("not valid JSON")
    assert validate('{"age": NaN}', PERSON) == "not valid JSON: NaN is not JSON"
    assert validate("[1]", {"type": "array"}) is None


def test_validate_json_object_mode() -> None:
    assert validate('{"any": [1, {"thing": null}]}', None) is None
    assert validate("[]", None) == "not a JSON object but an array"
    assert validate('"text"', None) == "not a JSON object but a string"
    assert validate("", None) is not None


# ---------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subset_schemas())
def test_schemas_from_the_subset_are_accepted(schema: dict[str, Any]) -> None:
    check_schema(schema, PARAM)
    Draft202012Validator.check_schema(schema)  # and they are valid Draft 2020-12


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subset_schemas(), st.sampled_from(REFUSED), st.data())
def test_an_unsupported_keyword_anywhere_is_named_at_its_pointer(schema: dict[str, Any], refused: tuple[str, Any], data: Any) -> None:
    keyword, value = refused
    nodes: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    stack: list[tuple[tuple[str, ...], Any]] = [((), schema)]
    while stack:  # every subschema position of the drawn schema
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        nodes.append((path, node))
        for name, sub in node.get("properties", {}).items():
            stack.append(((*path, "properties", name), sub))
        for key in ("items", "additionalProperties"):
            stack.append(((*path, key), node.get(key)))
        for i, sub in enumerate(node.get("anyOf", [])):
            stack.append(((*path, "anyOf", str(i)), sub))
        for defs in ("$defs", "definitions"):
            for name, sub in node.get(defs, {}).items():
                stack.append(((*path, defs, name), sub))
    path, node = data.draw(st.sampled_from(nodes))
    node[keyword] = value
    error = _refusal(schema)
    assert (pointer((*path, keyword)), keyword) in {(p.pointer, p.keyword) for p in error.problems}
    assert f"{keyword} at {pointer((*path, keyword))}" in error.message
