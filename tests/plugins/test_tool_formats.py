"""Tool-call formats: rendering and parsing round trips, forced openings, malformed replies,
format detection from chat templates (rendered for real with transformers), and stream holdback."""

from __future__ import annotations

import functools
import json
import keyword
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from millm_plugins.structured.schema import check_schema
from millm_plugins.tools.formats import (
    FORMATS,
    HERMES,
    LLAMA3,
    PYTHONIC,
    CallFormat,
    ForcedCall,
    ParsedCall,
    arguments_json,
    detect_format,
    holdback,
    takes_tools,
)
from millm_plugins.tools.formats.base import NO_ARGUMENTS

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
SMOLLM2_EXAMPLE = ROOT / "examples" / "templates" / "smollm2-hermes-tools.jinja"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Pieces that break naive parsers: quotes, escapes, newlines, the formats' own markers.
TRICKY = ['"', "'", "\\", "\n", "\t", "\r", "</tool_call>", "<tool_call>", "<|tool_call_end|>", "<|tool_call_start|>"]
TRICKY += [")]", "}", "{", ";", "é", "東京", "🙂", "\x00", "\u2028", "\\n", "True", "null"]
texts = st.one_of(st.text(max_size=12), st.lists(st.sampled_from(TRICKY) | st.text(max_size=3), max_size=5).map("".join))
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=10)


def argument_dicts(fmt: CallFormat) -> st.SearchStrategy[dict[str, Any]]:
    # Keyword names must be Python identifiers in the pythonic format; JSON keys can be anything.
    return st.dictionaries(identifiers if fmt is PYTHONIC else texts, values, max_size=5)


def call_lists(fmt: CallFormat) -> st.SearchStrategy[list[ParsedCall]]:
    return st.lists(st.builds(ParsedCall, name=identifiers, arguments=argument_dicts(fmt)), min_size=1, max_size=3)


def assert_parsed(actual: tuple[str, list[ParsedCall]] | None, content: str, calls: list[ParsedCall]) -> None:
    assert actual is not None
    assert actual[0] == content
    # repr tells True from 1 and 1.0, and -0.0 from 0.0, and shows key order; == would not.
    assert repr(actual[1]) == repr(calls)


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"The {name} function"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


# --- the registry and what each format writes ---------------------------------------------


def test_formats_are_registered_by_name() -> None:
    assert {name: (f.start, f.whole_reply) for name, f in FORMATS.items()} == {
        "hermes": ("<tool_call>", False),
        "pythonic": ("<|tool_call_start|>", False),
        "llama3": ("{", True),
    }
    assert all(f.name == name for name, f in FORMATS.items())


def test_render_writes_what_the_models_write() -> None:
    paris = ParsedCall("get_weather", {"city": "Paris"})
    assert HERMES.render([paris]) == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert HERMES.render([paris, paris]) == HERMES.render([paris]) + "\n" + HERMES.render([paris])
    assert (
        PYTHONIC.render([paris, ParsedCall("other", {"x": 1})])
        == "<|tool_call_start|>[get_weather(city='Paris'), other(x=1)]<|tool_call_end|>"
    )
    assert PYTHONIC.render([ParsedCall("f", {"a": [True, None, 1.5, {"k": "it's"}]})]) == (
        "<|tool_call_start|>[f(a=[True, None, 1.5, {'k': \"it's\"}])]<|tool_call_end|>"
    )
    assert LLAMA3.render([paris]) == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert LLAMA3.render([paris, paris]) == LLAMA3.render([paris]) + "; " + LLAMA3.render([paris])


@pytest.mark.parametrize(
    "call",
    [
        ParsedCall("get-weather", {}),  # OpenAI allows hyphens; Python call syntax does not
        ParsedCall("f", {"class": 1}),
        ParsedCall("f", {"two words": 1}),
        ParsedCall("ﬁnd", {}),  # NFKC folds the ligature: Python would read back "find"
        ParsedCall("f", {"x": float("inf")}),
        ParsedCall("f", {"x": {1: "a"}}),
        ParsedCall("f", {"x": b"bytes"}),
    ],
)
def test_pythonic_refuses_to_render_what_it_cannot_write(call: ParsedCall) -> None:
    with pytest.raises(ValueError):
        PYTHONIC.render([call])


def test_arguments_json_is_the_openai_string() -> None:
    assert arguments_json({"city": "Zürich", "n": [1, None]}) == '{"city": "Zürich", "n": [1, null]}'


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [HERMES, PYTHONIC, LLAMA3], ids=lambda f: f.name)
@given(data=st.data())
def test_parse_reads_back_what_render_writes(fmt: CallFormat, data: st.DataObject) -> None:
    calls = data.draw(call_lists(fmt))
    assert_parsed(fmt.parse(fmt.render(calls)), "", calls)


@pytest.mark.parametrize("fmt", [HERMES, PYTHONIC], ids=lambda f: f.name)
@given(data=st.data())
def test_content_before_the_calls_is_returned(fmt: CallFormat, data: st.DataObject) -> None:
    content = data.draw(texts)
    assume(fmt.start not in content)
    separator = data.draw(st.sampled_from(["", " ", "\n", "\n\n", " \t\n"]))
    calls = data.draw(call_lists(fmt))
    reply = content + separator + fmt.render(calls) + data.draw(st.sampled_from(["", "\n", "  \n "]))
    assert_parsed(fmt.parse(reply), (content + separator).rstrip(), calls)


@pytest.mark.parametrize("fmt", [HERMES, PYTHONIC], ids=lambda f: f.name)
def test_content_before_a_call(fmt: CallFormat) -> None:
    call = ParsedCall("get_weather", {"city": "Paris"})
    assert_parsed(fmt.parse("Let me check.\n\n" + fmt.render([call])), "Let me check.", [call])


def test_llama3_call_must_be_the_whole_reply() -> None:
    call = LLAMA3.render([ParsedCall("get_weather", {"city": "Paris"})])
    assert LLAMA3.parse("Sure. " + call) is None
    assert_parsed(LLAMA3.parse("\n  " + call + "\n"), "", [ParsedCall("get_weather", {"city": "Paris"})])


# --- replies as models write them ---------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "reply", "content", "calls"),
    [
        # The spec's own examples.
        (PYTHONIC, "<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>", "", [("get_weather", {"city": "Paris"})]),
        (
            HERMES,
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
            "",
            [("get_weather", {"city": "Paris"})],
        ),
        (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
        # Parallel calls, blank lines between blocks.
        (
            HERMES,
            'On it.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
            "On it.",
            [("a", {"x": 1}), ("b", {})],
        ),
        # SmolLM2's trained habit: a JSON list of calls inside one block.
        (
            HERMES,
            '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
            "",
            [("a", {"x": 1}), ("b", {})],
        ),
        # A function without parameters may leave "arguments" out.
        (HERMES, '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", {})]),
        # The end marker quoted inside an argument does not end the block.
        (HERMES, '<tool_call>\n{"name": "say", "arguments": {"s": "</tool_call>"}}\n</tool_call>', "", [("say", {"s": "</tool_call>"})]),
        (PYTHONIC, "<|tool_call_start|>[say(s='<|tool_call_end|>')]<|tool_call_end|>", "", [("say", {"s": "<|tool_call_end|>"})]),
        # LFM2.5's template writes nested values with tojson: JSON literals inside Python calls.
        (
            PYTHONIC,
            '<|tool_call_start|>[f(a=[true, false, null], b={"k": 1})]<|tool_call_end|>',
            "",
            [("f", {"a": [True, False, None], "b": {"k": 1}})],
        ),
        # Double quotes, negative numbers, tuples, a bare call without brackets, no arguments.
        (
            PYTHONIC,
            '<|tool_call_start|>[f(s="x", n=-3, g=-2.5, t=(1, 2)), g()]<|tool_call_end|>',
            "",
            [("f", {"s": "x", "n": -3, "g": -2.5, "t": [1, 2]}), ("g", {})],
        ),
        (PYTHONIC, "Checking. <|tool_call_start|>f(x=1)<|tool_call_end|>", "Checking.", [("f", {"x": 1})]),
        (LLAMA3, '{"name": "a", "parameters": {}};{"name": "b", "parameters": {"y": [1]}};\n', "", [("a", {}), ("b", {"y": [1]})]),
    ],
)
def test_replies_as_models_write_them(fmt: CallFormat, reply: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert_parsed(fmt.parse(reply), content, [ParsedCall(name, arguments) for name, arguments in calls])


GOOD_HERMES = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
GOOD_PYTHONIC = "<|tool_call_start|>[f(x=1)]<|tool_call_end|>"


@pytest.mark.parametrize(
    ("fmt", "reply"),
    [
        (HERMES, "Just an answer."),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}'),  # unclosed
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>'),  # bad JSON
        (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'),  # arguments as a string
        (HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {}, "id": 1}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
        (HERMES, "<tool_call>\n[]\n</tool_call>"),
        (HERMES, GOOD_HERMES + "\nDone, anything else?"),  # trailing text
        (HERMES, GOOD_HERMES + "\n<tool_call>\nnot json\n</tool_call>"),  # one bad block spoils all
        (HERMES, GOOD_HERMES + "</tool_call>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=1)]"),  # unclosed
        (PYTHONIC, "<|tool_call_start|>[f(x=1)<|tool_call_end|>"),  # syntax error
        (PYTHONIC, "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>"),  # positional
        (PYTHONIC, "<|tool_call_start|>[f(x=os.system('x'))]<|tool_call_end|>"),  # not a literal
        (PYTHONIC, "<|tool_call_start|>[f(x=__import__('os'))]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=y)]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=1 + 2)]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(**{'x': 1})]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x={**y})]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=1, x=2)]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x={1, 2})]<|tool_call_end|>"),  # a set
        (PYTHONIC, "<|tool_call_start|>[f(x={1: 'a'})]<|tool_call_end|>"),  # a non-string key
        (PYTHONIC, "<|tool_call_start|>[f(x=1e999)]<|tool_call_end|>"),  # infinity
        (PYTHONIC, "<|tool_call_start|>[f(x=b'raw')]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=1j)]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[f(x=-True)]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[os.system(x=1)]<|tool_call_end|>"),  # not a plain name
        (PYTHONIC, "<|tool_call_start|>[f(x=1), 2]<|tool_call_end|>"),
        (PYTHONIC, "<|tool_call_start|>[]<|tool_call_end|>"),
        (PYTHONIC, GOOD_PYTHONIC + " I called f."),  # trailing text
        (LLAMA3, 'Sure: {"name": "f", "parameters": {}}'),  # text before
        (LLAMA3, '{"name": "f", "parameters": {}} is what I would call'),  # trailing text
        (LLAMA3, '{"name": "f", "parameters": {}}; nope'),
        (LLAMA3, '{"name": "f", "arguments": {}}'),
        (LLAMA3, '{"name": "f"}'),
        (LLAMA3, '{"name": "f", "parameters": "x"}'),
        (LLAMA3, '{"name": "f", "parameters": {}'),
        (LLAMA3, '{"answer": 42}'),
        (LLAMA3, "[1, 2]"),
        (LLAMA3, ""),
    ],
)
def test_malformed_replies_are_content(fmt: CallFormat, reply: str) -> None:
    assert fmt.parse(reply) is None


@given(reply=texts)
def test_parsers_never_raise(reply: str) -> None:
    for fmt in FORMATS.values():
        for text in (reply, fmt.start + reply, fmt.start + reply + "<|tool_call_end|></tool_call>"):
            result = fmt.parse(text)
            assert result is None or (isinstance(result[0], str) and result[1])


# --- forced calls -----------------------------------------------------------------------------


def test_forced_openings() -> None:
    params = WEATHER["function"]["parameters"]
    tools = [WEATHER, tool("now")]
    assert HERMES.forced(tools, "get_weather") == ForcedCall(
        '<tool_call>\n{"name": "get_weather", "arguments": ', params, "}\n</tool_call>"
    )
    # Without parameters a function takes none (as OpenAI reads it); an empty schema is any object.
    assert HERMES.forced(tools, "now") == ForcedCall('<tool_call>\n{"name": "now", "arguments": ', dict(NO_ARGUMENTS), "}\n</tool_call>")
    assert LLAMA3.forced([tool("now", {})], "now").schema == {"type": "object"}
    # A schema without a type is held to an object (arguments are one).
    untyped = {"properties": {"a": {"type": "integer"}}}
    assert LLAMA3.forced([tool("now", untyped)], "now").schema == {**untyped, "type": "object"}
    assert LLAMA3.forced(tools, "get_weather") == ForcedCall('{"name": "get_weather", "parameters": ', params, "}")
    forced = PYTHONIC.forced(tools, "get_weather")
    assert (forced.opening, forced.schema, forced.suffix) == ("<|tool_call_start|>[get_weather(", None, ")]<|tool_call_end|>")
    branch = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False}
    assert HERMES.forced(tools, None) == ForcedCall(
        "<tool_call>\n",
        {
            "anyOf": [
                {**branch, "properties": {"name": {"const": "get_weather"}, "arguments": params}},
                {**branch, "properties": {"name": {"const": "now"}, "arguments": NO_ARGUMENTS}},
            ]
        },
        "\n</tool_call>",
    )
    llama_schema = LLAMA3.forced(tools, None)
    assert (llama_schema.opening, llama_schema.suffix) == ("", "")
    assert llama_schema.schema is not None
    assert [b["required"] for b in llama_schema.schema["anyOf"]] == [["name", "parameters"]] * 2
    required = PYTHONIC.forced(tools, None)
    assert (required.opening, required.schema, required.suffix) == ("<|tool_call_start|>[", None, ")]<|tool_call_end|>")
    assert required.pattern is not None


@pytest.mark.parametrize("fmt", [HERMES, PYTHONIC, LLAMA3], ids=lambda f: f.name)
def test_forcing_needs_the_named_tool(fmt: CallFormat) -> None:
    with pytest.raises(ValueError):
        fmt.forced([WEATHER], "send_email")
    with pytest.raises(ValueError):
        fmt.forced([], None)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
@given(data=st.data())
def test_a_forced_call_parses_back(fmt: CallFormat, data: st.DataObject) -> None:
    names = data.draw(st.lists(identifiers, min_size=1, max_size=4, unique=True))
    tools = [tool(name, {"type": "object"}) for name in names]
    name = data.draw(st.sampled_from(names))
    arguments = data.draw(argument_dicts(fmt))
    ascii_only = data.draw(st.booleans())

    named = fmt.forced(tools, name)
    assert named.schema is not None
    jsonschema.validate(arguments, named.schema)
    assert_parsed(
        fmt.parse(named.opening + json.dumps(arguments, ensure_ascii=ascii_only) + named.suffix), "", [ParsedCall(name, arguments)]
    )

    required = fmt.forced(tools, None)
    assert required.schema is not None
    instance = {"name": name, ("arguments" if fmt is HERMES else "parameters"): arguments}
    jsonschema.validate(instance, required.schema)
    assert_parsed(
        fmt.parse(required.opening + json.dumps(instance, ensure_ascii=ascii_only) + required.suffix), "", [ParsedCall(name, arguments)]
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**instance, "name": name + "_other"}, required.schema)


def test_a_forced_pythonic_call_parses_back() -> None:
    named = PYTHONIC.forced([WEATHER], "get_weather")
    assert_parsed(PYTHONIC.parse(named.opening + "city='Paris')]<|tool_call_end|>"), "", [ParsedCall("get_weather", {"city": "Paris"})])
    required = PYTHONIC.forced([WEATHER], None)
    assert_parsed(
        PYTHONIC.parse(required.opening + "get_weather(city='Rome')]<|tool_call_end|>"), "", [ParsedCall("get_weather", {"city": "Rome"})]
    )


PYDANTIC_LIKE: dict[str, Any] = {
    "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Person"}, "cc": {"type": "array", "items": {"$ref": "#/$defs/Person"}}},
    "required": ["to"],
    "$defs": {
        "Person": {"type": "object", "properties": {"email": {"type": "string"}, "boss": {"$ref": "#/$defs/Person"}}, "required": ["email"]}
    },
}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
def test_required_keeps_each_tools_refs_pointing_at_its_own_defs(fmt: CallFormat) -> None:
    other = tool("other", {"type": "object", "properties": {"n": {"$ref": "#/$defs/Person"}}, "$defs": {"Person": {"type": "integer"}}})
    forced = fmt.forced([tool("send", PYDANTIC_LIKE), other], None)
    assert forced.schema is not None
    key = "arguments" if fmt is HERMES else "parameters"
    jsonschema.validate({"name": "send", key: {"to": {"email": "a@b", "boss": {"email": "c@d"}}, "cc": []}}, forced.schema)
    jsonschema.validate({"name": "other", key: {"n": 3}}, forced.schema)
    for bad in (
        {"name": "send", key: {"to": {"boss": {}}}},
        {"name": "send", key: {"to": 3}},
        {"name": "other", key: {"n": {"email": "x"}}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, forced.schema)
    # The tool objects of the request are left as they were.
    assert PYDANTIC_LIKE["$defs"]["Person"]["properties"]["boss"] == {"$ref": "#/$defs/Person"}


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3], ids=lambda f: f.name)
def test_required_hoists_definitions_too(fmt: CallFormat) -> None:
    """The older ``definitions`` keyword is hoisted as ``$defs`` is, so the call stays
    constrained (its refs resolve within millm's subset)."""
    legacy = tool(
        "send",
        {
            "type": "object",
            "properties": {"to": {"$ref": "#/definitions/P"}, "cc": {"$ref": "#/$defs/d_P"}},
            "definitions": {"P": {"type": "integer"}},
            "$defs": {"d_P": {"type": "string"}},  # a $defs key that looks like a hoisted definitions one
        },
    )
    forced = fmt.forced([legacy, tool("other", {"type": "object", "properties": {"n": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}})], None)
    assert forced.schema is not None
    check_schema(forced.schema, "tools")  # in the enforced subset: the call is constrained
    key = "arguments" if fmt is HERMES else "parameters"
    jsonschema.validate({"name": "send", key: {"to": 3, "cc": "x"}}, forced.schema)
    jsonschema.validate({"name": "other", key: {"n": "x"}}, forced.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "send", key: {"to": "x"}}, forced.schema)


# --- format detection -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected", "reads_tools"),
    [
        (TEMPLATES / "hermes.jinja", "hermes", True),
        (TEMPLATES / "lfm2.jinja", "pythonic", True),
        (TEMPLATES / "llama3.jinja", "llama3", True),
        (TEMPLATES / "no_tools.jinja", None, False),
        (SMOLLM2_EXAMPLE, "hermes", True),
    ],
    ids=lambda p: p.name if isinstance(p, Path) else None,
)
def test_detect_format_on_templates(path: Path, expected: str | None, reads_tools: bool) -> None:
    template = path.read_text(encoding="utf-8")
    fmt = detect_format(template)
    assert (fmt.name if fmt else None) == expected
    assert takes_tools(template) is reads_tools


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # LFM2's first template only lists the tools; the call markers never appear in it.
        ("{% if tools %}List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|>{% endif %}", "pythonic"),
        # <tool_call> around an XML-like body is not the Hermes JSON format.
        ("{{ tools }}<tool_call>\n<function={{ name }}>\n<parameter=x>1</parameter>\n</function>\n</tool_call>", None),
        ("{{ tools }}Wrap calls in <tool_call></tool_call>.", None),
        # Quotes escaped inside a Jinja string literal, as Qwen2.5's template writes them.
        ('{{ tools }}{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args>}\\n</tool_call>" }}', "hermes"),
        # The Llama 3.1 call rendering spread over two statements.
        ("{{ tools }}{{- '{\"name\": \"' + call.name + '\", ' }}\n{{- '\"parameters\": ' + call.arguments | tojson }}", "llama3"),
        # A {"name", "parameters"} example in a template that never reads tools.
        ('Answer as {"name": x, "parameters": y}.{{ messages }}', None),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_detect_format_reads_markers_not_names(template: str, expected: str | None) -> None:
    fmt = detect_format(template)
    assert (fmt.name if fmt else None) == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% if tools %}{{ tools | tojson }}{% endif %}", True),
        # Llama 3.1 defaults tools itself, after reading it.
        (
            "{% if custom_tools is defined %}{% set tools = custom_tools %}{% endif %}{% if not tools is defined %}{% set tools = none %}{% endif %}{{ tools }}",
            True,
        ),
        ("{% set tools = [] %}{{ tools }}{{ messages }}", False),
        ("{{ messages }} Use the tools wisely.", False),  # the word in text is not the variable
        ("{{ xml_tools }}", False),
        # transformers' {% generation %} tags parse here too.
        ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ tools }}", True),
        ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}", False),
        # A template that does not parse here falls back to looking for the word.
        ("{% unknown_tag %}{{ tools }}", True),
        ("{% unknown_tag %}{{ messages }}", False),
    ],
)
def test_takes_tools(template: str, expected: bool) -> None:
    assert takes_tools(template) is expected


# --- the templates render for real --------------------------------------------------------


@functools.cache
def _tokenizer() -> Any:
    from millm_engines.transformers.testing import build_tokenizer

    return build_tokenizer()


def render(template: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    tokenizer = _tokenizer()
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return text


# (template, the assistant turn's opening and closing, whether it writes the content next to calls)
RENDERED = [
    (TEMPLATES / "hermes.jinja", "<|im_start|>assistant\n", "<|im_end|>", True),
    (TEMPLATES / "lfm2.jinja", "<|im_start|>assistant\n", "<|im_end|>", True),
    (TEMPLATES / "llama3.jinja", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", False),
    (SMOLLM2_EXAMPLE, "<|im_start|>assistant\n", "<|im_end|>", True),
]


def history(calls: list[ParsedCall], content: str | None) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "18C and sunny"},
    ]


def assistant_turn(rendered: str, opening: str, closing: str) -> str:
    start = rendered.index(opening) + len(opening)
    return rendered[start : rendered.index(closing, start)]


@pytest.mark.parametrize(("path", "opening", "closing", "with_content"), RENDERED, ids=lambda p: p.name if isinstance(p, Path) else None)
def test_templates_render_tools_and_history_that_parses_back(path: Path, opening: str, closing: str, with_content: bool) -> None:
    template = path.read_text(encoding="utf-8")
    fmt = detect_format(template)
    assert fmt is not None
    calls = [
        ParsedCall("get_weather", {"city": "Paris", "options": {"units": "C", "days": [1, 2.5], "alerts": True, "note": None}}),
        ParsedCall("get_weather", {"city": 'it\'s "Rome"\nItaly \\ 東京'}),
    ]
    rendered = render(path, history(calls, None), [WEATHER])
    system_part = rendered[: rendered.index("What is the weather in Paris?")]
    assert "get_weather" in system_part and "The get_weather function" in system_part
    assert "18C and sunny" in rendered
    assert rendered.endswith(opening)
    assert_parsed(fmt.parse(assistant_turn(rendered, opening, closing)), "", calls)
    if with_content:
        rendered = render(path, history(calls[:1], "Let me look that up."), [WEATHER])
        assert_parsed(fmt.parse(assistant_turn(rendered, opening, closing)), "Let me look that up.", calls[:1])


clean_texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=10),
    st.lists(st.sampled_from(['"', "'", "\\", "\n", "\t", "\r", "</tool_call>", "<|tool_call_end|>", "é", "🙂", "}"]), max_size=4).map(
        "".join
    ),
)
clean_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | clean_texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(clean_texts, inner, max_size=3),
    max_leaves=8,
)


@pytest.mark.parametrize(("path", "opening", "closing", "with_content"), RENDERED, ids=lambda p: p.name if isinstance(p, Path) else None)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_any_rendered_call_parses_back(path: Path, opening: str, closing: str, with_content: bool, data: st.DataObject) -> None:
    fmt = detect_format(path.read_text(encoding="utf-8"))
    assert fmt is not None
    keys = identifiers if fmt is PYTHONIC else clean_texts
    calls = data.draw(
        st.lists(st.builds(ParsedCall, name=identifiers, arguments=st.dictionaries(keys, clean_values, max_size=4)), min_size=1, max_size=2)
    )
    rendered = render(path, history(calls, None), [WEATHER])
    assert_parsed(fmt.parse(assistant_turn(rendered, opening, closing)), "", calls)


def test_smollm2_example_keeps_smollm2s_own_render_without_tools() -> None:
    chat = [{"role": "user", "content": "Hi"}]
    expected = f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(SMOLLM2_EXAMPLE, chat, None) == expected
    own = [{"role": "system", "content": "Be brief."}, *chat]
    assert render(SMOLLM2_EXAMPLE, own, None) == expected.replace(SMOLLM2_SYSTEM, "Be brief.")
    with_tools = render(SMOLLM2_EXAMPLE, chat, [WEATHER])
    assert with_tools.startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}\n") and "<tools>" in with_tools and "</tools>" in with_tools


# --- streaming holdback -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "text", "held"),
    [
        (HERMES, "", ""),
        (HERMES, "Hello", ""),
        (HERMES, "a < b", ""),
        (HERMES, "Hello <", " <"),
        (HERMES, "Hello <tool_c", " <tool_c"),
        (HERMES, "Hello\n", "\n"),
        (HERMES, "Hello\n<tool_call>\n{", "\n<tool_call>\n{"),
        (HERMES, "<tool_call", "<tool_call"),
        (HERMES, "x <tool_call>{}</tool_call> y <tool", " <tool_call>{}</tool_call> y <tool"),
        (HERMES, "Hello <|tool_call_start|>", ""),
        (PYTHONIC, "Sure <|tool", " <|tool"),
        (PYTHONIC, "Sure <tool_call>", ""),
        (PYTHONIC, "Sure <|tool_call_start|>[f(", " <|tool_call_start|>[f("),
        (LLAMA3, "", ""),
        (LLAMA3, "  \n", "  \n"),
        (LLAMA3, ' {"na', ' {"na'),
        (LLAMA3, '{"name": "f"}; {', '{"name": "f"}; {'),
        (LLAMA3, "Hello {", ""),
        (LLAMA3, "Hello ", ""),
    ],
)
def test_holdback(fmt: CallFormat, text: str, held: str) -> None:
    assert holdback(fmt, text) == len(held)
    assert text.endswith(held)


@pytest.mark.parametrize("fmt", [HERMES, PYTHONIC, LLAMA3], ids=lambda f: f.name)
@given(data=st.data())
def test_streamed_content_only_grows_and_matches_the_parse(fmt: CallFormat, data: st.DataObject) -> None:
    content = data.draw(texts)
    assume(fmt.start not in content)
    if fmt.whole_reply:
        content = data.draw(st.sampled_from(["", " ", "\n"]))
    reply = content + data.draw(st.sampled_from(["", " ", "\n\n"])) + fmt.render(data.draw(call_lists(fmt)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=8))) + [len(reply)]
    released = 0
    for cut in cuts:
        so_far = reply[:cut]
        now = len(so_far) - holdback(fmt, so_far)
        assert now >= released  # nothing once streamed is taken back
        released = now
        assert fmt.whole_reply or fmt.start not in reply[:released]
    parsed = fmt.parse(reply)
    assert parsed is not None
    assert reply[:released] == parsed[0]  # the stream sent exactly the content served whole


def test_pythonic_forced_arguments_follow_the_schema() -> None:
    """A flat schema becomes a pattern of keyword arguments: every rendering of valid
    arguments matches it, and an invalid value does not."""
    import re

    from millm_plugins.tools.formats.pythonic import arguments_pattern

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}, "ok": {"type": "boolean"}},
    }
    pattern = arguments_pattern(schema)
    assert pattern is not None
    forced = PYTHONIC.forced([tool("w", schema)], "w")
    for args in ({"city": "Paris", "unit": "c", "days": 3, "ok": True}, {"city": "", "unit": "f", "days": 1, "ok": False}):
        text = PYTHONIC.render([ParsedCall("w", args)])
        inner = text[len(forced.opening) : -len(forced.suffix)]
        assert re.fullmatch(pattern, inner), inner
        assert PYTHONIC.parse(forced.opening + inner + forced.suffix) == ("", [ParsedCall("w", args)])
    escaped = "city='Pa\\'ri', unit='c', days=2, ok=False"  # a quote inside the string, escaped
    assert re.fullmatch(pattern, escaped)
    assert PYTHONIC.parse(forced.opening + escaped + forced.suffix) == ("", [ParsedCall("w", {"city": "Pa'ri", "unit": "c", "days": 2, "ok": False})])
    for bad in ({"city": "toolongcity", "unit": "c", "days": 1, "ok": True}, {"city": "x", "unit": "k", "days": 1, "ok": True}, {"city": "x", "unit": "c", "days": 4, "ok": True}):
        inner = PYTHONIC.render([ParsedCall("w", bad)])[len(forced.opening) : -len(forced.suffix)]
        assert not re.fullmatch(pattern, inner), inner
    # Nested parameters are beyond a flat pattern: only the opening is forced.
    nested = {"type": "object", "properties": {"where": {"type": "object"}}}
    assert arguments_pattern(nested) is None and PYTHONIC.forced([tool("n", nested)], "n").pattern is None


def test_a_forced_pythonic_call_past_the_pattern_budget_is_left_unconstrained() -> None:
    """A forced pythonic call is constrained by one regular expression whose automaton is
    built before its rows run: a string argument costs ~770 automaton states, so four (1.4 s to build) are over
    the budget and the call goes unconstrained; a length range no string fits has no
    pattern; parameters that are no valid schema never constrain (the finished call could
    not be checked against them)."""
    from millm_plugins.structured.budget import pattern_problem
    from millm_plugins.tools.formats.pythonic import arguments_pattern
    from millm_plugins.tools.plugin import _valid_schema

    one = arguments_pattern({"type": "object", "properties": {"a": {"type": "string"}}})
    four = arguments_pattern({"type": "object", "properties": {k: {"type": "string"} for k in "abcd"}})
    assert one is not None and four is not None
    assert pattern_problem(one) is None and pattern_problem(four) is not None
    assert arguments_pattern({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}}) is None
    assert _valid_schema({"type": "object", "properties": {"a": {"type": "string"}}}) and _valid_schema(None)
    assert not _valid_schema({"type": "object", "required": "a"})
