"""``/v1/responses`` on a real server with the tiny model, through the openai SDK and raw
httpx: inputs render the prompt the equivalent chat request renders (same greedy text,
same prompt token count, which the tokenizer's own chat template confirms), the Response
shape, max_output_tokens → incomplete, the event stream (order, sequence numbers, what the
SDK accumulates), millm's extensions and headers, and errors in OpenAI's shape.

The tiny model has random weights: tests compare shapes and mappings, never meanings.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import http_sfv
import httpx
import jsonschema
import openai
import pytest

from millm_core.api import DatabaseBusy, Finalization, ForwardPlan, Outcome, PassThrough, RequestContext, RowEnd, hookimpl
from millm_core.config import load_settings
from millm_core.server.app import build_host
from millm_plugins.responses.routes import STATE

from .helpers import FaultPlugin, FinalizeRecorder, GatePlugin, chat_ids, scheduler_stats, sdk_validate, wait_until

QUESTION = "Tell me about the sea"


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _chat(server: Any, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny", "messages": messages, "temperature": 0, **body}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _post(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json={"model": "tiny", "temperature": 0, **body}, timeout=60)


def _events(raw: bytes) -> list[dict[str, Any]]:
    """The SSE events, checking that each frame names its event and carries its data."""
    events = []
    for frame in raw.decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        events.append(event)
    return events


def _ignored(headers: httpx.Headers) -> list[str]:
    parsed = http_sfv.List()
    parsed.parse(headers.get("x-millm-ignored-fields", "").encode())
    return [str(item.value) for item in parsed]


def test_a_text_input_is_the_chat_of_one_user_message(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": QUESTION}]
    chat = _chat(server, messages, max_tokens=12)
    reply = _client(server).responses.with_raw_response.create(model="tiny", input=QUESTION, max_output_tokens=12, temperature=0)
    response = reply.parse()
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"] == len(chat_ids(tiny_engine, messages))
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.total_tokens == chat["usage"]["total_tokens"]
    assert response.usage.output_tokens_details.reasoning_tokens == 0 and response.usage.input_tokens_details.cached_tokens == 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert reply.headers["x-millm-model"] == "tiny" and reply.headers["x-millm-steering"] == "none"
    assert "x-millm-ignored-fields" not in reply.headers


def test_items_and_instructions_render_the_same_prompt_as_chat(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},  # no type: a message
    ]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION},
    ]
    chat = _chat(server, messages, max_tokens=10)
    response = _client(server).responses.create(model="tiny", instructions="You are terse.", input=items, max_output_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert response.instructions == "You are terse."
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.input_tokens == chat["usage"]["prompt_tokens"] == len(chat_ids(tiny_engine, messages))


def test_tool_choice_auto_is_the_default_and_asks_for_nothing_without_tools(server) -> None:  # type: ignore[no-untyped-def]
    """This API's default (echoed on every response): clients send it without tools."""
    plain = _post(server, input="hi", max_output_tokens=4, temperature=0)
    auto = _post(server, input="hi", max_output_tokens=4, temperature=0, tool_choice="auto")
    assert auto.status_code == 200, auto.text
    assert auto.json()["output"][0]["content"] == plain.json()["output"][0]["content"] and auto.json()["tool_choice"] == "auto"
    required = _post(server, input="hi", max_output_tokens=4, tool_choice="required")
    assert (required.status_code, required.json()["error"]["param"]) == (400, "tool_choice"), required.text


def test_max_output_tokens_ends_an_incomplete_response(server) -> None:  # type: ignore[no-untyped-def]
    chat = _chat(server, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert chat["choices"][0]["finish_reason"] == "length"
    response = _client(server).responses.create(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 3 and response.usage is not None and response.usage.output_tokens == 3
    assert response.output[-1].status == "incomplete" and response.completed_at is None


def _stop_after(server: Any, tokens: int = 12) -> tuple[str, str]:
    """A stop sequence the greedy answer meets, and the text before it: the response then
    completes (``finish_reason: stop``) rather than running out of tokens."""
    text = _chat(server, [{"role": "user", "content": QUESTION}], max_tokens=tokens)["choices"][0]["message"]["content"]
    for start in range(3, len(text)):
        if text[start].isascii() and text[start].isprintable() and text[start] not in text[:start]:
            return text[start], text[:start]
    pytest.fail(f"no stop character in the greedy answer {text!r}: the tests built on it cannot run")


def test_a_stream_has_the_responses_event_order(server) -> None:  # type: ignore[no-untyped-def]
    stop, before = _stop_after(server)
    resp = _post(server, input=QUESTION, max_output_tokens=12, stream=True, stop=stop)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-millm-model"] == "tiny"
    events = _events(resp.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2]) and events[-2]["item"]["id"] == item_id
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == before == events[-4]["text"]
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["status"] == "completed" and final["completed_at"] is not None
    assert final["output"][0]["content"][0]["text"] == before
    assert final["millm_steering"]  # the chat stream's closing extension chunk, folded in
    assert final["usage"]["output_tokens"] >= 1


def test_the_sdks_stream_accumulates_the_greedy_answer(server) -> None:  # type: ignore[no-untyped-def]
    stop, before = _stop_after(server)
    client = _client(server)
    whole = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12, temperature=0, extra_body={"stop": stop})
    assert whole.status == "completed" and whole.output_text == before
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=12, temperature=0, extra_body={"stop": stop}) as stream:
        snapshots = [event.snapshot for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and snapshots[-1] == before
    # create(stream=True), to a response that runs out of tokens: response.incomplete
    events = list(client.responses.create(model="tiny", input=QUESTION, max_output_tokens=5, temperature=0, stream=True))
    short = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=5, temperature=0)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == short.output_text


def test_millm_extensions_pass_through_and_unknown_fields_are_reported(server) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input": QUESTION, "max_output_tokens": 4, "seed": 7, "class": "agent", "frobnicate": 1,
        "text": {"format": {"type": "text", "colour": "red"}}, "reasoning": {"summary": "auto"},
        "tools": [{"type": "function", "name": "f", "defer_loading": True}], "tool_choice": "none",
        "input_extra": None, "user": "ann",
    }  # fmt: skip
    resp = _post(server, **body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-lane"] == "agent" and resp.headers["x-millm-seed"].startswith("7")
    assert _ignored(resp.headers) == ["text.format.colour", "tools[0].defer_loading", "reasoning.summary", "frobnicate", "input_extra", "user"]
    strict = httpx.post(server.base_url + "/v1/responses", json={"model": "tiny", **body}, headers={"X-miLLM-Strict": "true"})
    assert strict.status_code == 400 and strict.json()["error"]["code"] == "unused_fields_refused"
    assert strict.json()["error"]["param"] == "text.format.colour"


def test_unknown_keys_inside_input_items_and_parts_are_reported_once(server) -> None:  # type: ignore[no-untyped-def]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION, "extra": 1}], "mood": "calm"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris.", "zz": 2}]},
        {"role": "user", "content": QUESTION},
    ]
    resp = _post(server, input=items, max_output_tokens=2)
    assert resp.status_code == 200, resp.text
    # In body order: an item's parts before its later keys.
    assert _ignored(resp.headers) == ["input[0].content[0].extra", "input[0].mood", "input[1].content[0].zz"]


def test_every_response_and_event_fits_the_sdks_types(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(FaultPlugin(), "fault")
    with make_server(host=host) as srv:
        stop, _ = _stop_after(srv)
        for body in ({"max_output_tokens": 12, "stop": stop}, {"max_output_tokens": 3}):  # completed, incomplete
            response = _post(srv, input=QUESTION, **body).json()
            sdk_validate(response)
            events = _events(_post(srv, input=QUESTION, stream=True, **body).content)
            assert events[-1]["type"] in ("response.completed", "response.incomplete")
            sdk_validate(events[-1]["response"], events)
        resp = httpx.post(
            srv.base_url + "/v1/responses",
            json={"model": "tiny", "input": QUESTION, "max_output_tokens": 20, "stream": True},
            headers={"X-Test-Fault": "raise:3"},
            timeout=60,
        )
        failed = _events(resp.content)
        assert failed[-1]["type"] == "response.failed"
        sdk_validate(failed[-1]["response"], failed)


class _Marker:
    """Adds a body extension to every reply, as probes and activations do, one named like a
    Response field, and a key on each choice (as the reasoning plugin's
    ``thinking_budget_forced_at``)."""

    @hookimpl
    def millm_finalize(self, ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
        out.extend("marker", {"tokens": outcome.completion_tokens}, order=40)
        out.extend("metadata", "the plugin's", order=41)

    @hookimpl
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        plan.add_processor(lambda _row: _ChoiceKey())


class _ChoiceKey(PassThrough):
    def end(self, finish_reason: str) -> RowEnd:
        return RowEnd(choice={"marker_choice": finish_reason})


def test_body_extensions_and_choice_keys_become_top_level_keys(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(_Marker(), "marker")
    with make_server(host=host) as srv:
        whole = _post(srv, input=QUESTION, max_output_tokens=4, metadata={"run": "1"}).json()
        assert whole["marker"] == {"tokens": 4} and whole["marker_choice"] == "length"
        # Never dropped, never replacing the Response's own field: kept apart.
        assert whole["metadata"] == {"run": "1"} and whole["millm_extensions"] == {"metadata": "the plugin's"}
        final = _events(_post(srv, input=QUESTION, max_output_tokens=4, metadata={"run": "1"}, stream=True).content)[-1]["response"]
        assert final["marker"] == {"tokens": 4} and final["millm_steering"] and final["marker_choice"] == "length"
        assert final["metadata"] == {"run": "1"} and final["millm_extensions"] == {"metadata": "the plugin's"}


def test_a_response_the_database_cannot_keep_is_answered_with_store_false(make_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with make_server() as srv:
        store = srv.app.state.millm.app.stash[STATE].store

        def busy(response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
            raise DatabaseBusy("the database is locked")

        monkeypatch.setattr(store, "put", busy)
        resp = _post(srv, input=QUESTION, max_output_tokens=4)
        assert resp.status_code == 200 and resp.json()["store"] is False and resp.json()["output"]
        events = _events(_post(srv, input=QUESTION, max_output_tokens=4, stream=True).content)
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["store"] is False
        monkeypatch.undo()
        for rid in (resp.json()["id"], events[-1]["response"]["id"]):
            assert httpx.get(srv.base_url + f"/v1/responses/{rid}").status_code == 404
        assert _post(srv, input=QUESTION, max_output_tokens=4).json()["store"] is True


def test_text_format_json_schema_is_structured_output(server) -> None:  # type: ignore[no-untyped-def]
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "rough"]}}, "required": ["mood"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "sea", "schema": schema, "strict": True}
    resp = _post(server, input=QUESTION, max_output_tokens=40, text={"format": fmt})
    assert resp.status_code == 200, resp.text
    response = resp.json()
    assert response["text"] == {"format": fmt} and response["status"] == "completed"
    jsonschema.validate(json.loads(response["output"][0]["content"][0]["text"]), schema)
    bad = _post(server, input=QUESTION, text={"format": {**fmt, "schema": {"type": "object", "patternProperties": {"a": {}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("text.format.schema")


ERRORS: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("unknown model", {"model": "nope"}, 404, "model_not_found", "model"),
    ("out of range", {"temperature": 7}, 400, "invalid_parameter", "temperature"),
    ("too long", {"max_output_tokens": 10**6}, 400, "context_length_exceeded", "max_output_tokens"),
    ("no input", {"input": None}, 400, "invalid_parameter", "input"),
    ("empty input", {"input": []}, 400, "invalid_parameter", "input"),
    ("bad item", {"input": [{"type": "message", "role": "robot", "content": "x"}]}, 400, "invalid_parameter", "input[0].role"),
    ("item type", {"input": [{"type": "item_reference", "id": "x"}]}, 400, "unsupported_value", "input[0].type"),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "unsupported_value", "input[0].content[0].type"),
    ("built-in tool", {"tools": [{"type": "web_search"}]}, 400, "unsupported_value", "tools[0].type"),
    ("tool choice", {"tool_choice": {"type": "file_search"}}, 400, "unsupported_value", "tool_choice.type"),
    ("unknown function", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "invalid_parameter", "tool_choice"),
    ("background", {"background": True}, 400, "unsupported_value", "background"),
    ("truncation", {"truncation": "auto"}, 400, "unsupported_value", "truncation"),
    ("include", {"include": ["message.output_text.logprobs"]}, 400, "invalid_parameter", "include[0]"),
    ("verbosity", {"text": {"verbosity": "low"}}, 400, "unsupported_value", "text.verbosity"),
    ("n", {"n": 2}, 400, "unsupported_value", "n"),
    ("chat's name", {"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_parameter", "messages"),
    ("chat's budget", {"max_tokens": 3}, 400, "invalid_parameter", "max_tokens"),
    ("nothing honours it", {"logit_bias": {"5": 3}}, 400, "field_not_honoured", "logit_bias"),
    ("previous id", {"previous_response_id": "resp_nope"}, 404, "response_not_found", "previous_response_id"),
]


@pytest.mark.parametrize(("case", "body", "status", "code", "param"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_in_openais_shape_and_name_the_field(server, case: str, body: dict[str, Any], status: int, code: str, param: str | None) -> None:  # type: ignore[no-untyped-def]
    resp = _post(server, **{"input": QUESTION, **body})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param)
    if case != "chat's name":  # the message too names this API's fields, not chat's
        assert "'messages" not in error["message"], error["message"]


def test_the_sdk_raises_its_own_errors(server) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tiny", input=QUESTION, tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert bad.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=QUESTION)
    broken = httpx.post(server.base_url + "/v1/responses", content=b'{"model": "tiny", "input": [', headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"


def test_a_stream_that_fails_after_its_200_ends_with_response_failed(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(FaultPlugin(), "fault")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 20, "temperature": 0, "stream": True}
        resp = httpx.post(srv.base_url + "/v1/responses", json=body, headers={"X-Test-Fault": "raise:3"}, timeout=60)
        events = _events(resp.content)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "internal_error"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"  # OpenAI's code; the error event has millm's
        with _client(srv).responses.stream(model="tiny", input=QUESTION, max_output_tokens=20, extra_headers={"X-Test-Fault": "raise:3"}) as stream:
            seen = list(stream)
        assert [e.type for e in seen[-2:]] == ["error", "response.failed"]
        assert seen[-1].response.status == "failed" and seen[-1].response.error.code == "server_error"  # type: ignore[union-attr]


def test_a_client_leaving_a_stream_frees_its_rows_and_is_finalized(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.02)  # 20 ms a token: 400 tokens would take 8 s
    slow.gate.set()
    host.register(slow, "slow")
    recorder = FinalizeRecorder()
    host.register(recorder, "recorder")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/responses", json=body) as resp:
            lines = resp.iter_lines()
            first = [next(lines) for _ in range(12)]
            assert scheduler_stats(srv.base_url)["active_rows"] == 1
        created = json.loads(first[1][len("data: ") :])
        assert created["type"] == "response.created"
        assert wait_until(lambda: scheduler_stats(srv.base_url)["cancelled_rows"] == 1)
        stats = scheduler_stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["generated_tokens"] < 200
        # The chat stream's own end ran: its finalize hooks heard it was interrupted.
        assert wait_until(lambda: recorder.cancelled == [True]), recorder.cancelled
        stored = httpx.get(srv.base_url + f"/v1/responses/{created['response']['id']}")
        assert stored.status_code == 404  # nothing half-done was stored


def test_a_client_leaving_a_non_streamed_response_frees_its_rows(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.02)
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host) as srv:
        store = srv.app.state.millm.app.stash[STATE].store
        port = int(srv.base_url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "input": QUESTION, "max_output_tokens": 400, "temperature": 0}).encode()
        request = (
            b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request)
            assert wait_until(lambda: scheduler_stats(srv.base_url)["active_rows"] == 1)
        assert wait_until(lambda: scheduler_stats(srv.base_url)["cancelled_rows"] == 1)
        stats = scheduler_stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["generated_tokens"] < 200
        assert store.count() == 0  # nothing was stored for the client that left


def test_the_routes_are_in_the_openapi_document(server) -> None:  # type: ignore[no-untyped-def]
    document = httpx.get(server.base_url + "/v1/openapi.json").json()
    assert set(document["paths"]["/v1/responses"]) == {"post"}
    assert set(document["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    post = document["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "ResponseObject" in document["components"]["schemas"]
