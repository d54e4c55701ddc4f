"""Function calling over HTTP on a real server with the tiny model: tools rendered by the
model's template, forced calls constrained to the function's parameters, tool calls in
the OpenAI shape (streamed and not), history, refusals, and batch independence.

A random-weight model never chooses to call a tool by itself, so every call here is a
forced one (``tool_choice`` required or named): the opening is part of the prompt and the
arguments are constrained, so the call must parse and validate whatever the weights say.
"""

from __future__ import annotations

import concurrent.futures
import json
import uuid
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from millm_core.testing import RunningServer

from .helpers import automaton_builds

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(server: RunningServer, **body: Any) -> httpx.Response:
    payload = {"model": "tiny-hermes", "messages": MESSAGES, "max_tokens": 96, "temperature": 0, **body}
    return httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=120)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    """A tool call in OpenAI's shape whose arguments validate against the function's schema."""
    assert call.id.startswith("call_") and call.type == "function"
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    return dict(arguments)


@pytest.mark.parametrize("model", ["tiny-hermes", "tiny-llama3", "tiny-lfm2"])
def test_a_named_call_is_forced_and_its_arguments_validate(tools_server: RunningServer, model: str) -> None:
    reply = _client(tools_server).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=96, temperature=0  # type: ignore[arg-type]
    )
    completion = reply.parse()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls or []) == 1
    _check_call((choice.message.tool_calls or [])[0], "get_weather")
    assert reply.headers["x-millm-constrained"] == "tool_arguments"


@pytest.mark.parametrize("model", ["tiny-hermes", "tiny-llama3", "tiny-lfm2"])
def test_required_calls_one_of_the_offered_functions(tools_server: RunningServer, model: str) -> None:
    for seed in (1, 2, 3):
        resp = _chat(tools_server, model=model, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] in PARAMS
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


def test_each_choice_gets_its_own_forced_call(tools_server: RunningServer) -> None:
    resp = _chat(tools_server, tools=TOOLS, tool_choice=NAMED, n=3, temperature=1.0, seed=11)
    choices = resp.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls"] * 3
    ids = {c["message"]["tool_calls"][0]["id"] for c in choices}
    assert len(ids) == 3  # every call has its own id
    for choice in choices:
        jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), PARAMS["get_weather"])


def test_a_streamed_call_arrives_whole_in_one_delta_before_the_final_chunk(tools_server: RunningServer) -> None:
    stream = _client(tools_server).chat.completions.create(
        model="tiny-hermes", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=96, temperature=0, stream=True  # type: ignore[arg-type]
    )
    chunks = list(stream)
    with_calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(with_calls) == 1
    (call,) = with_calls[0].choices[0].delta.tool_calls or []
    assert call.index == 0 and call.id and call.id.startswith("call_") and call.type == "function"
    assert call.function is not None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments or ""), PARAMS["get_weather"])
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["tool_calls"]
    assert chunks.index(with_calls[0]) < chunks.index(finals[0])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""  # the call is not content
    # The same call as the non-streamed greedy request.
    whole = _chat(tools_server, tools=TOOLS, tool_choice=NAMED).json()["choices"][0]["message"]["tool_calls"][0]
    assert whole["function"]["arguments"] == call.function.arguments


def test_tool_choice_none_does_not_show_the_tools(tools_server: RunningServer) -> None:
    plain = _chat(tools_server, max_tokens=1).json()["usage"]["prompt_tokens"]
    hidden = _chat(tools_server, tools=TOOLS, tool_choice="none", max_tokens=1).json()["usage"]["prompt_tokens"]
    shown = _chat(tools_server, tools=TOOLS, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert hidden == plain
    assert shown > plain + 20  # the template lists the tools' JSON in the system turn


def test_tool_choice_without_tools_asks_for_something_only_when_it_is_not_none(tools_server: RunningServer) -> None:
    """As OpenAI: "auto" (or "required", or a name) without tools is a 400 naming
    tool_choice; "none" alone asks for nothing and is served."""
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = httpx.post(tools_server.base_url + "/v1/chat/completions", json={"model": "tiny-hermes", "messages": MESSAGES, "max_tokens": 2, "tool_choice": choice}, timeout=60)
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, "tool_choice"), resp.text
    none = httpx.post(tools_server.base_url + "/v1/chat/completions", json={"model": "tiny-hermes", "messages": MESSAGES, "max_tokens": 2, "tool_choice": "none"}, timeout=60)
    assert none.status_code == 200, none.text


def test_auto_with_a_model_that_writes_no_call_returns_content(tools_server: RunningServer) -> None:
    resp = _chat(tools_server, tools=TOOLS, max_tokens=8)
    choice = resp.json()["choices"][0]
    assert resp.status_code == 200
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")
    assert "x-millm-constrained" not in resp.headers


def test_strict_is_reported_where_no_call_is_constrained(tools_server: RunningServer) -> None:
    """``strict: true`` holds arguments to the schema only where the call is constrained (a
    forced call): with ``auto`` it is reported, never silently dropped."""
    strict = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, CLOCK]
    auto = _chat(tools_server, tools=strict, max_tokens=4)
    assert auto.status_code == 200 and auto.headers["x-millm-ignored-fields"] == '"tools[0].function.strict"', auto.headers
    forced = _chat(tools_server, tools=strict, tool_choice=NAMED)
    assert forced.headers["x-millm-constrained"] == "tool_arguments" and "x-millm-ignored-fields" not in forced.headers


def test_tool_history_is_rendered_by_the_template(tools_server: RunningServer) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]  # fmt: skip
    with_history = _chat(tools_server, messages=history, tools=TOOLS, max_tokens=1)
    assert with_history.status_code == 200, with_history.text
    # The Hermes template renders the calls but never reads tool_call_id: that one is said to be unused.
    assert with_history.headers["x-millm-ignored-fields"] == '"messages[2].tool_call_id"'
    # Arguments sent as an object render the same as the JSON string.
    as_object = json.loads(json.dumps(history))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    same = _chat(tools_server, messages=as_object, tools=TOOLS, max_tokens=1)
    assert same.json()["usage"]["prompt_tokens"] == with_history.json()["usage"]["prompt_tokens"]
    without = _chat(tools_server, messages=history[:1], tools=TOOLS, max_tokens=1)
    # The call and the result are in the prompt: its JSON and the tool's answer add tokens.
    assert with_history.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"] + 10


def test_tool_history_on_a_model_without_a_template_is_refused(tools_server: RunningServer) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "x"}]  # fmt: skip
    resp = _chat(tools_server, model="tiny-no-template", messages=history)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages"


def test_a_forced_name_the_format_cannot_write_is_refused(tools_server: RunningServer) -> None:
    hyphen = {"type": "function", "function": {"name": "get-weather"}}
    resp = _chat(tools_server, model="tiny-lfm2", tools=[hyphen], tool_choice={"type": "function", "function": {"name": "get-weather"}})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice", "invalid_parameter"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "invalid_parameter"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "invalid_parameter"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "invalid_parameter"),
        ({"response_format": {"type": "json_object"}}, "tools", "field_not_honoured"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "invalid_parameter"),
        ({"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs.tools", "invalid_parameter"),
    ],
)
def test_bad_tool_requests_are_refused_by_name(tools_server: RunningServer, body: dict[str, Any], param: str, code: str) -> None:
    resp = _chat(tools_server, **{"tools": TOOLS, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_a_template_that_takes_no_tools_is_refused_before_anything_runs(server: RunningServer) -> None:
    for stream in (False, True):
        resp = _chat(server, model="tiny", tools=TOOLS, stream=stream)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("tools", "field_not_honoured")
        assert "--chat-template" in error["message"]
    # tool_choice "none" shows no tools, so nothing needs the template
    assert _chat(server, model="tiny", tools=TOOLS, tool_choice="none", max_tokens=1).status_code == 200


def test_tools_on_text_completions_are_refused(tools_server: RunningServer) -> None:
    resp = httpx.post(tools_server.base_url + "/v1/completions", json={"model": "tiny-hermes", "prompt": "x", "tools": TOOLS})
    assert resp.status_code == 400
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == ("tools", "field_not_honoured")


def test_stop_never_matches_inside_a_call(tools_server: RunningServer) -> None:
    plain = _chat(tools_server, tools=TOOLS, tool_choice=NAMED).json()["choices"][0]
    arguments = plain["message"]["tool_calls"][0]["function"]["arguments"]
    stopped = _chat(tools_server, tools=TOOLS, tool_choice=NAMED, stop=["city", "{"]).json()["choices"][0]
    assert stopped["finish_reason"] == "tool_calls"
    assert stopped["message"]["tool_calls"][0]["function"]["arguments"] == arguments


def test_a_forced_call_is_the_same_beside_other_requests(tools_server: RunningServer) -> None:
    """Constrained rows share decode steps with unconstrained ones; each row's output is
    its solo output."""
    forced = {"tools": TOOLS, "tool_choice": NAMED}
    plain = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 40}
    solo_forced = _chat(tools_server, **forced).json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    solo_plain = _chat(tools_server, **plain).json()["choices"][0]["message"]["content"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(_chat, tools_server, **(forced if i % 2 else plain)) for i in range(6)]
        results = [job.result().json() for job in jobs]
    for i, body in enumerate(results):
        message = body["choices"][0]["message"]
        if i % 2:
            assert message["tool_calls"][0]["function"]["arguments"] == solo_forced
        else:
            assert message["content"] == solo_plain


def test_the_example_smollm2_template_serves_tools(tools_server: RunningServer) -> None:
    """examples/templates/smollm2-hermes-tools.jinja (what docs/tools.md tells operators
    to serve SmolLM2 with) takes tools and writes Hermes calls."""
    resp = _chat(tools_server, model="tiny", tools=TOOLS, tool_choice=NAMED)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def gguf_tools_server(make_server) -> Any:  # type: ignore[no-untyped-def]
    """The tiny model as GGUF (llama.cpp), served with the Hermes fixture template."""
    import os

    from millm_engines.gguf.testing import tiny_gguf
    from millm_engines.transformers.testing import tiny_model_dir

    from ..conftest import TEMPLATES
    from ..gguf.helpers import load_gguf

    model = load_gguf(tiny_gguf(tiny_model_dir(context=2048)), "tiny-gguf", chat_template=os.path.join(TEMPLATES, "hermes.jinja"))
    with make_server(models=[model]) as srv:
        yield srv


def test_gguf_serves_forced_calls_and_tool_history(gguf_tools_server: RunningServer) -> None:
    """Beyond the API contract (which refuses tools on GGUF): llama.cpp models render the
    tools and the history with their template and make forced calls like transformers."""
    resp = _chat(gguf_tools_server, model="tiny-gguf", tools=TOOLS, tool_choice=NAMED)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), PARAMS["get_weather"])
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]}, {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    follow = _chat(gguf_tools_server, model="tiny-gguf", messages=history, tools=TOOLS, max_tokens=4)
    assert follow.status_code == 200 and follow.headers["x-millm-ignored-fields"] == '"messages[2].tool_call_id"'
    assert follow.json()["usage"]["prompt_tokens"] > resp.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("model", ["tiny-hermes", "tiny-lfm2"])
def test_a_forced_calls_automaton_is_built_off_the_model_thread(tools_server: RunningServer, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced call's argument automata (a JSON schema's ``pattern``; a pythonic call's
    whole pattern) are built by the build process before its rows run, never in the server
    process."""
    seen = automaton_builds(monkeypatch)
    tag = uuid.uuid4().hex[:8]  # a pattern no earlier request built
    code = {"type": "string", "pattern": f"[a-z]{{2}}{tag}"} if model == "tiny-hermes" else {"enum": [f"a{tag}", f"b{tag}"]}
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"code": code}, "required": ["code"]}}}
    resp = _chat(tools_server, model=model, tools=[lookup], tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-constrained"] == "tool_arguments"
    assert seen["process"] and all(name.startswith("millm-constraint-automata") for name in seen["process"]), seen
    assert seen["here"] == []


def test_a_forced_call_whose_automaton_cannot_be_built_in_time_goes_unconstrained(tools_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a pattern over the count budget does: the call is still forced and parsed, the
    arguments are written freely (no X-miLLM-Constrained), and strict is reported."""
    from millm_plugins.structured import automata

    monkeypatch.setattr(automata, "BUILD_WAIT_S", 0.0)
    code = {"type": "string", "pattern": f".*a..........b{uuid.uuid4().hex[:8]}"}  # about 0.5 s to build
    lookup = {
        "type": "function",
        "function": {"name": "lookup", "strict": True, "parameters": {"type": "object", "properties": {"code": code}, "required": ["code"]}},
    }
    resp = _chat(tools_server, tools=[lookup], tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=24)
    assert resp.status_code == 200, resp.text
    assert "x-millm-constrained" not in resp.headers
    assert "tools[0].function.strict" in resp.headers.get("x-millm-ignored-fields", "")


@pytest.mark.parametrize("parameters", [{"type": "string", "enum": ["Paris", "Rome"]}, {"type": "array", "items": {"type": "string"}}, {"type": ["object", "null"]}])
@pytest.mark.parametrize("tool_choice", [NAMED, "required", "auto"])
def test_parameters_that_are_no_object_schema_are_refused(tools_server: RunningServer, parameters: dict[str, Any], tool_choice: Any) -> None:
    """As OpenAI refuses them. A forced call to one came back as a 200 with no tool_calls and
    a headless fragment of the call as content (arguments must be an object)."""
    odd = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    resp = _chat(tools_server, tools=[odd], tool_choice=tool_choice)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("tools[0].function.parameters", "invalid_parameter"), error
    assert 'type "object"' in error["message"]


@pytest.mark.parametrize("model", ["tiny-hermes", "tiny-llama3", "tiny-lfm2"])
def test_a_function_without_parameters_is_called_with_no_arguments(tools_server: RunningServer, model: str) -> None:
    """OpenAI reads omitted parameters as a function taking none: a forced call closes as {}
    (it was an open object, which a model could fill until max_tokens)."""
    ping = {"type": "function", "function": {"name": "ping"}}
    for choice in ({"type": "function", "function": {"name": "ping"}}, "required"):
        resp = _chat(tools_server, model=model, tools=[ping], tool_choice=choice)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-millm-constrained"] == "tool_arguments"
        body = resp.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls", body
        assert json.loads(body["message"]["tool_calls"][0]["function"]["arguments"]) == {}


def test_a_forced_call_with_an_open_object_is_an_object(tools_server: RunningServer) -> None:
    """``parameters: {"type": "object"}`` is constrained like json_object (the suffix after
    the arguments no longer costs the free-text shortcut: see test_constraint)."""
    anything = {"type": "function", "function": {"name": "anything", "parameters": {"type": "object"}}}
    resp = _chat(tools_server, tools=[anything], tool_choice={"type": "function", "function": {"name": "anything"}}, max_tokens=40)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-constrained"] == "tool_arguments"
    message = resp.json()["choices"][0]["message"]
    if message.get("tool_calls"):
        assert isinstance(json.loads(message["tool_calls"][0]["function"]["arguments"]), dict)
    else:  # cut by max_tokens: the whole text of the call, its opening included
        assert message["content"].startswith('<tool_call>\n{"name": "anything", "arguments": {'), message


def test_an_unparsed_forced_call_is_content_with_its_opening(tools_server: RunningServer) -> None:
    """Arguments beyond what can be constrained (``format``) are written freely; when they
    do not make a call, the reply is the whole text of the turn, the forced opening first
    (it was the fragment after it alone), on chat completions and on responses."""
    mail: dict[str, Any] = {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}, "required": ["to"]}
    send: dict[str, Any] = {"type": "function", "function": {"name": "send", "parameters": mail}}
    named = {"type": "function", "function": {"name": "send"}}
    opening = '<tool_call>\n{"name": "send", "arguments": '
    resp = _chat(tools_server, tools=[send], tool_choice=named, max_tokens=12)
    assert resp.status_code == 200, resp.text
    assert "x-millm-constrained" not in resp.headers
    choice = resp.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length", choice
    assert choice["message"]["content"].startswith(opening) and len(choice["message"]["content"]) > len(opening)
    streamed = _client(tools_server).chat.completions.create(  # type: ignore[call-overload]
        model="tiny-hermes", messages=MESSAGES, tools=[send], tool_choice=named, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice["message"]["content"]
    responses = httpx.post(
        tools_server.base_url + "/v1/responses",
        json={"model": "tiny-hermes", "input": MESSAGES[0]["content"], "tools": [{"type": "function", **send["function"]}],
              "tool_choice": {"type": "function", "name": "send"}, "max_output_tokens": 12, "temperature": 0},
        timeout=120,
    )  # fmt: skip
    assert responses.status_code == 200, responses.text
    texts = [part["text"] for item in responses.json()["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [choice["message"]["content"]], responses.json()


def test_a_tool_message_without_its_call_id_is_refused(tools_server: RunningServer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    resp = _chat(tools_server, messages=history, tools=TOOLS, max_tokens=2)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages[2].tool_call_id"
    later = _chat(tools_server, messages=MESSAGES, extra_messages=[history], max_tokens=2)
    assert later.status_code == 400 and later.json()["error"]["param"] == "extra_messages[0][2].tool_call_id", later.text


def test_a_lookahead_in_forced_arguments_leaves_them_unconstrained_and_says_so(tools_server: RunningServer) -> None:
    """A lookahead the constraint cannot enforce was served as constrained (the header set,
    nothing held): as for any syntax beyond the subset, the call is forced, its arguments
    written freely, the header absent and strict reported."""
    city = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^(?!Paris)[A-Za-z]{3}$"}}, "required": ["city"]}
    lookup = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": city}}
    resp = _chat(tools_server, tools=[lookup], tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=12)
    assert resp.status_code == 200, resp.text
    assert "x-millm-constrained" not in resp.headers
    assert resp.headers["x-millm-ignored-fields"] == '"tools[0].function.strict"'
