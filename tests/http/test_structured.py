"""Structured output over HTTP on a real server: ``response_format`` json_object and
json_schema with the tiny model (transformers) and its GGUF copy, streamed and not, in
shared batches, and the refusals.

The schemas are bounded (enums, booleans, short strings), so that a random-weight model
must close the document within the token budget: a ``"stop"`` is then owed, and the
document must parse and validate whatever the weights say.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import uuid
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from millm_core.testing import RunningServer

from .helpers import automaton_builds, scheduler_stats, sse_frames

BOUNDED = {
    "type": "object",
    "properties": {
        "label": {"enum": ["humor", "not_humor"]},
        "sure": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["label", "sure", "note", "tags"],
    "additionalProperties": False,
}
JUDGE = {"type": "json_schema", "json_schema": {"name": "judge_v1", "strict": True, "schema": BOUNDED}}
MESSAGES = [{"role": "user", "content": "Is this funny? A horse walks into a bar."}]


def _chat(server: RunningServer, **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 120, "temperature": 0, **body}
    return httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=120)


def _steps(server: RunningServer) -> int:
    return int(scheduler_stats(server.base_url)["steps"])


def test_a_schema_constrained_reply_is_closed_and_validates(server: RunningServer) -> None:
    resp = _chat(server, response_format=JUDGE)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-constrained"] == 'json_schema;name="judge_v1"'
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), BOUNDED)


def test_sampled_choices_are_each_constrained(server: RunningServer) -> None:
    resp = _chat(server, response_format=JUDGE, n=4, temperature=1.0, seed=5)
    documents = []
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        document = json.loads(choice["message"]["content"])
        jsonschema.validate(document, BOUNDED)
        documents.append(json.dumps(document, sort_keys=True))
    assert len(set(documents)) > 1  # sampled at temperature 1: the constraint does not collapse the choices


def test_json_object_gives_an_object(server: RunningServer) -> None:
    resp = _chat(server, response_format={"type": "json_object"}, max_tokens=60)
    assert resp.headers["x-millm-constrained"] == "json_object"
    choice = resp.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.lstrip().startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_stream_is_the_document_in_deltas(server: RunningServer) -> None:
    whole = _chat(server, response_format=JUDGE).json()["choices"][0]["message"]["content"]
    resp = _chat(server, response_format=JUDGE, stream=True)
    assert resp.headers["x-millm-constrained"] == 'json_schema;name="judge_v1"'
    chunks = [json.loads(f) for f in sse_frames(resp.content) if f != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == ["stop"]


def test_a_cut_document_says_length(server: RunningServer) -> None:
    choice = _chat(server, response_format=JUDGE, max_tokens=3).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(choice["message"]["content"])


def test_constrained_and_free_rows_share_a_batch_and_keep_their_solo_output(server: RunningServer) -> None:
    free = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 40}
    solo_constrained = _chat(server, response_format=JUDGE).json()["choices"][0]["message"]["content"]
    solo_free = _chat(server, **free).json()["choices"][0]["message"]["content"]
    steps_before = _steps(server)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(_chat, server, **({"response_format": JUDGE} if i % 2 else free)) for i in range(6)]
        results = [job.result() for job in jobs]
    tokens = sum(resp.json()["usage"]["completion_tokens"] for resp in results)
    assert _steps(server) - steps_before < tokens  # rows shared decode steps (one step per token otherwise)
    for i, resp in enumerate(results):
        content = resp.json()["choices"][0]["message"]["content"]
        assert content == (solo_constrained if i % 2 else solo_free)
        assert resp.headers["x-millm-backend"] == "batched"


def test_the_openai_sdk_parses_a_structured_reply(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=JUDGE, max_tokens=120, temperature=0)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), BOUNDED)


@pytest.mark.parametrize(
    ("keyword", "schema", "pointer"),
    [
        ("multipleOf", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}, "/properties/n/multipleOf"),
        ("format", {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}, "/properties/d/format"),
        ("oneOf", {"oneOf": [{"type": "object"}, {"type": "array"}]}, "/oneOf"),
        ("$ref", {"$ref": "https://example.com/s.json"}, "/$ref"),
    ],
)
def test_unsupported_schema_keywords_are_refused_by_pointer(server: RunningServer, keyword: str, schema: dict[str, Any], pointer: str) -> None:
    resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "response_format_unsupported"
    assert keyword in error["message"] and pointer in error["message"]


def test_refused_combinations_name_response_format(server: RunningServer) -> None:
    stop = _chat(server, response_format=JUDGE, stop=["}"])
    assert stop.status_code == 400 and stop.json()["error"]["param"] == "response_format"
    completions = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}})
    assert completions.status_code == 400
    assert (completions.json()["error"]["param"], completions.json()["error"]["code"]) == ("response_format", "field_not_honoured")
    scoring = _chat(server, response_format=JUDGE, logprobs=True, max_tokens=1)
    assert scoring.status_code == 400 and "response_format" in scoring.json()["error"]["message"]
    # the neutral value asks for nothing and is accepted anywhere
    assert _chat(server, response_format={"type": "text"}, max_tokens=2).status_code == 200


def test_gguf_honours_response_format(gguf_server: RunningServer) -> None:
    resp = _chat(gguf_server, model="tiny:F32", response_format=JUDGE)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), BOUNDED)


def test_a_pattern_too_costly_to_compile_is_refused_up_front(server: RunningServer) -> None:
    """A pattern's automaton grows with its repeat counts and would be built between decode
    steps, stalling every row: a count past the bound is a 400 at validation."""
    costly = (
        "^[a-z]{0,20000}$",  # a long count
        ".*a.{12}b",  # a count beside an unbounded repeat (2^12 states)
        "((ab){90}){90}",  # nested counts multiply (minutes to build)
        "a{,8000}",  # the {,n} form
        "a{300,}",  # an open repeat's own count
        ".*a.{12,}b",  # an open repeat's count beside another unbounded one
        "a{99999999999}",  # past C's integers (was a 500)
        "\\\\{3000}",  # an escaped backslash, repeated
        "[a-z]{0,256}[0-9]{0,256}[a-z]{0,256}[0-9]{0,256}[a-z]{0,256}[0-9]{0,256}[a-z]{0,256}",  # each count allowed, their sum not
    )
    for pattern in ("^.{12,}$", "^[a-z]+@[a-z]+\\.[a-z]{2,}$", "^[A-Za-z0-9_-]{1,64}$"):  # cheap: served
        schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
        served = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, max_tokens=2)
        assert served.status_code == 200, (pattern, served.text)
    for pattern in costly:
        schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
        resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "response_format_unsupported" and "/properties/code/pattern" in error["message"], pattern


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "/properties/a/enum"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}}, "/properties/a/minimum"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": False}, "/required"),
        ({"type": "object", "properties": {"a": {"type": "integer", "enum": ["x"]}}, "required": ["a"]}, "/properties/a/enum"),
        ({"type": "object", "properties": {"a": {"type": "string", "const": 3}}, "required": ["a"]}, "/properties/a/const"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1.5, "maximum": 1.7}}, "required": ["a"]}, "/properties/a/minimum"),
    ],
)
def test_a_schema_no_value_satisfies_is_refused_up_front(server: RunningServer, schema: dict[str, Any], where: str) -> None:
    """Rather than a 500 once the model has written what it could (the constraint dead-ends
    or the final check fails)."""
    resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "response_format_unsupported" and where in error["message"], error


def test_a_document_outside_a_numeric_range_is_never_a_stop(server: RunningServer) -> None:
    """minimum/maximum are checked when the document closes (the mask has no numeric
    bounds): a random model writes numbers outside [5, 6], and each such reply is a 500
    (non-streamed) or an error event in place of the final chunk (streamed), never a
    "stop" with an invalid document."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 6}}, "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    outcomes = []
    for seed in range(6):
        resp = _chat(server, response_format=fmt, temperature=1.0, seed=seed, max_tokens=40)
        if resp.status_code == 200:
            choice = resp.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            outcomes.append("ok")
        else:
            assert (resp.status_code, resp.json()["error"]["code"]) == (500, "constrained_output_invalid")
            outcomes.append("invalid")
            streamed = _chat(server, response_format=fmt, temperature=1.0, seed=seed, max_tokens=40, stream=True)
            frames = [json.loads(f) for f in sse_frames(streamed.content) if f != "[DONE]"]
            assert frames[-1]["error"]["code"] == "constrained_output_invalid"
            assert not any(f.get("choices") and f["choices"][0].get("finish_reason") == "stop" for f in frames)
    assert "invalid" in outcomes  # the random model did leave the range: the check ran


def _pattern_format(pattern: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# Characters spelled out after ".*": within the repeat-count budget (it reads counts), yet
# their automata take about 2 s (eleven) and 8 s (twelve) to build here.
SLOWER = ".*a...........b"
SLOWEST = ".*a............b"


def test_a_slow_automaton_refuses_its_request_at_the_wait_and_serves_once_built(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waits for its pattern's automaton at most ``BUILD_WAIT_S``, then is
    refused; the build goes on in the build process, and once it is done the pattern is
    served from it."""
    from millm_plugins.structured import automata

    monkeypatch.setattr(automata, "BUILD_WAIT_S", 0.3)
    refused = _chat(server, response_format=_pattern_format(SLOWER), max_tokens=2)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "response_format_unsupported" and "takes more than 0.3 s to build" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"
    assert _chat(server, max_tokens=4).status_code == 200
    deadline = time.monotonic() + 120
    while (served := _chat(server, response_format=_pattern_format(SLOWER), max_tokens=2)).status_code != 200:
        assert served.status_code == 400 and time.monotonic() < deadline, served.text
        time.sleep(0.5)
    assert served.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_a_build_past_its_limit_is_stopped_and_its_pattern_refused_from_then_on(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build process is stopped at ``BUILD_LIMIT_S`` (a pattern can ask for years of
    work); the pattern is refused at once from then on, and the next pattern builds in a
    fresh process."""
    from millm_plugins.structured import automata

    monkeypatch.setattr(automata, "BUILD_LIMIT_S", 1.0)
    first = _chat(server, response_format=_pattern_format(SLOWEST), max_tokens=2)
    assert first.status_code == 400, first.text
    assert "takes more than 1 s to build" in first.json()["error"]["message"]
    started = time.monotonic()
    again = _chat(server, response_format=_pattern_format(SLOWEST), max_tokens=2)
    assert again.status_code == 400 and again.json()["error"]["message"] == first.json()["error"]["message"]
    assert time.monotonic() - started < 1.0  # refused from what was kept, not built again
    fresh = _chat(server, response_format=_pattern_format(f"[a-z]-{uuid.uuid4().hex[:8]}"), max_tokens=2)
    assert fresh.status_code == 200, fresh.text


def test_no_automaton_is_built_in_the_server_process(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every automaton a constrained request needs is built by the build process, handed
    over by the automata thread before the request's rows join a batch: none on the model
    thread, none in the server process at all."""
    seen = automaton_builds(monkeypatch)
    resp = _chat(server, response_format=_pattern_format(f"[a-z]{{2}}-[0-9]{{3}}-{uuid.uuid4().hex[:8]}"), max_tokens=12)
    assert resp.status_code == 200, resp.text
    assert seen["process"] and all(name.startswith("millm-constraint-automata") for name in seen["process"]), seen
    assert seen["here"] == []


def test_a_build_process_that_cannot_start_is_a_503_and_not_held_against_the_pattern(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's fault, not the pattern's: 503 (retry later), and the pattern is built
    once the process can start."""
    pattern = f"[a-z]{{2}}-{uuid.uuid4().hex[:8]}"
    with make_server() as srv:
        real = sys.executable
        monkeypatch.setattr(sys, "executable", "/nonexistent/python")
        refused = _chat(srv, response_format=_pattern_format(pattern), max_tokens=2)
        monkeypatch.setattr(sys, "executable", real)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "constraint_automata_unavailable"
        served = _chat(srv, response_format=_pattern_format(pattern), max_tokens=2)
        assert served.status_code == 200, served.text


def test_one_request_starts_at_most_its_share_of_builds_and_progresses_on_retry(make_server: Any) -> None:
    """A schema with more new patterns than PER_REQUEST starts that many builds and gets a
    503 to retry, so one request never fills the build queue; each retry starts the next
    share, and the request is then served."""
    from millm_plugins.structured import automata

    tag = uuid.uuid4().hex[:8]
    patterns = [f"[a-z]{{{i}}}-{tag}" for i in range(1, 2 * automata.PER_REQUEST + 2)]  # 9: three tries
    properties = {f"p{i}": {"type": "string", "pattern": pattern} for i, pattern in enumerate(patterns)}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": properties}}}
    with make_server() as srv:
        answers = []
        for _ in range(6):
            resp = _chat(srv, response_format=fmt, max_tokens=2)
            answers.append(resp.status_code)
            if resp.status_code == 200:
                break
            assert resp.json()["error"]["code"] == "constraint_automata_busy", resp.text
            assert f"a request starts at most {automata.PER_REQUEST} builds" in resp.json()["error"]["message"]
            time.sleep(0.5)  # the started builds finish (milliseconds each)
        assert answers == [503, 503, 200]


def test_new_patterns_past_the_build_queue_get_a_503(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds are bounded (a client sending many slow patterns and leaving cannot queue
    hours of work): past ``MAX_QUEUED`` waiting or running builds a new pattern is a 503;
    one already built is served meanwhile."""
    from millm_plugins.structured import automata

    tag = uuid.uuid4().hex[:8]
    with make_server() as srv:
        built = f"[a-z]-{tag}"
        assert _chat(srv, response_format=_pattern_format(built), max_tokens=2).status_code == 200
        monkeypatch.setattr(automata, "MAX_QUEUED", 1)
        monkeypatch.setattr(automata, "BUILD_WAIT_S", 0.0)
        slow = _chat(srv, response_format=_pattern_format(f".*a..........b{tag}"), max_tokens=2)  # about 0.5 s to build
        assert slow.status_code == 400, slow.text  # not waited for; it builds on
        busy = _chat(srv, response_format=_pattern_format(f"[0-9]-{tag}"), max_tokens=2)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "constraint_automata_busy", busy.text
        assert _chat(srv, response_format=_pattern_format(built), max_tokens=2).status_code == 200


def test_the_patterns_of_one_request_share_its_builds_across_plugins() -> None:
    """The structured-output and tools plugins each ask for their patterns with the same
    request context: together they start at most PER_REQUEST builds."""
    import types

    from millm_core.api import ServiceUnavailable, Stash
    from millm_plugins.structured import automata

    def request_context() -> Any:  # what wait() reads of a request's context: its stash
        return types.SimpleNamespace(stash=Stash())

    tag = uuid.uuid4().hex[:8]
    builds = automata.Automata()
    try:
        ctx = request_context()
        first = [f"[a-c]{{{i}}}-{tag}" for i in range(1, automata.PER_REQUEST)]  # one short of the share
        builds.wait(first, {}, ValueError, ctx)
        with pytest.raises(ServiceUnavailable):  # two more for the same request: one fits
            builds.wait([f"[d-f]-{tag}", f"[g-h]-{tag}"], {}, ValueError, ctx)
        other = request_context()  # another request has a share of its own
        builds.wait([f"[g-h]-{tag}", f"[i-j]-{tag}"], {}, ValueError, other)
    finally:
        builds.shutdown()


@pytest.mark.parametrize("pattern", ["^(?!abc)[a-c]{3}$", "^[a-c](?!z)[a-c]{2}$", "^(?=b)[a-z]{3}$", "(?<!a)b"])
def test_a_pattern_with_a_lookaround_is_refused_before_anything_runs(server: RunningServer, pattern: str) -> None:
    """A lookahead was served and not enforced at all (nor the maxLength beside it): the
    model wrote "abcdefg..." until max_tokens; a positive one failed with a 500 after."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern, "maxLength": 5}}, "required": ["a"], "additionalProperties": False}
    steps = _steps(server)
    resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("response_format_unsupported", "response_format.json_schema.schema")
    assert "/properties/a/pattern" in error["message"] and "lookahead or lookbehind" in error["message"]
    assert _steps(server) == steps  # nothing ran


@pytest.mark.parametrize("value", [{"enum": [{"x": 1}, [1, 2]]}, {"const": {"x": 1}}, {"const": {"x": ["a", "a"], "y": None}}])
def test_enum_and_const_objects_are_enforced(server: RunningServer, gguf_server: RunningServer, value: dict[str, Any]) -> None:
    """They were loosened to any object: the model wrote keys until max_tokens, or closed
    an object the final check refused (a 500)."""
    schema = {"type": "object", "properties": {"a": value}, "required": ["a"], "additionalProperties": False}
    for srv, model in ((server, "tiny"), (gguf_server, "tiny:F32")):
        resp = _chat(srv, model=model, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_an_array_literal_the_mask_cannot_write_is_refused_by_pointer(server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, ["x", "y"]]}}}
    resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "response_format_unsupported" and "/properties/a/enum/1" in error["message"], error


def test_a_schema_description_is_reported_unused(server: RunningServer) -> None:
    """OpenAI shows ``json_schema.description`` to the model; millm does not."""
    fmt = {"type": "json_schema", "json_schema": {"name": "judge_v1", "schema": BOUNDED, "description": "how funny it is"}}
    resp = _chat(server, response_format=fmt, max_tokens=2)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-ignored-fields"] == '"response_format.json_schema.description"'
    assert "x-millm-ignored-fields" not in _chat(server, response_format=JUDGE, max_tokens=2).headers


@pytest.mark.parametrize(("pattern", "reason"), [(r"^x[^\s\S]$", "no string matches"), ("(?m)ab", "MULTILINE")])
def test_a_pattern_found_unservable_when_built_is_refused_before_its_rows_run(server: RunningServer, pattern: str, reason: str) -> None:
    """Found when the automaton is built (before the rows run): a pattern no string matches
    (the constraint dead-ended: a 500 after generating), an inline flag interegular lacks."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}
    resp = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "response_format_unsupported" and reason in error["message"], error
