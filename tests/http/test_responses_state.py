"""``/v1/responses`` with state: ``previous_response_id`` continues a stored conversation
exactly as sending the whole history would; ``GET``/``DELETE /v1/responses/{id}``; the
bound on stored responses; function calls and their outputs round trip; encrypted
reasoning input opens only when this server sealed it.

Expected prompts come from chat requests with the same messages (and, for the plain tiny
model, from the tokenizer's own chat template), never from an earlier run.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .helpers import chat_ids, seal_reasoning
from .test_tools import WEATHER as CHAT_WEATHER

QUESTION = "Tell me about the sea"
FOLLOW_UP = "And then what?"


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _chat(server: Any, model: str, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    payload = {"model": model, "messages": messages, "temperature": 0, **body}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _post(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json={"model": "tiny", "temperature": 0, **body}, timeout=120)


def test_previous_response_id_continues_as_the_whole_history_would(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    first = client.responses.create(model="tiny", instructions="Be terse.", input=QUESTION, max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=FOLLOW_UP, max_output_tokens=6, temperature=0)
    history = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],  # the output items, sent back as they came
        {"role": "user", "content": FOLLOW_UP},
    ]
    whole = client.responses.create(model="tiny", input=history, max_output_tokens=6, temperature=0)  # type: ignore[arg-type]
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": FOLLOW_UP}]
    chat = _chat(server, "tiny", messages, max_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None  # instructions are not carried over
    assert second.output_text == whole.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens == len(chat_ids(tiny_engine, messages))
    third = client.responses.create(model="tiny", previous_response_id=second.id, input="More", max_output_tokens=4, temperature=0)
    longer = [*messages, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More"}]
    assert third.usage is not None and third.usage.input_tokens == len(chat_ids(tiny_engine, longer))


def test_stored_responses_are_retrieved_and_deleted(server) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    response = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, temperature=0, metadata={"run": "7"})
    assert response.metadata == {"run": "7"} and response.store is True
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    # Streaming it again is not served: refused by name, never an empty stream.
    with pytest.raises(openai.BadRequestError) as again:
        list(client.responses.retrieve(response.id, stream=True))
    assert (again.value.body["code"], again.value.body["param"]) == ("field_not_honoured", "stream")  # type: ignore[index]
    url = server.base_url + f"/v1/responses/{response.id}"
    for query, code in (("stream=false", None), ("starting_after=3", "field_not_honoured"), ("include[]=x", "field_not_honoured"), ("foo=1", "unknown_parameter")):
        got = httpx.get(f"{url}?{query}")
        assert (got.status_code, (got.json().get("error") or {}).get("code")) == ((200, None) if code is None else (400, code)), query
    assert httpx.delete(url + "?foo=1").json()["error"]["code"] == "unknown_parameter"
    deleted = httpx.delete(server.base_url + f"/v1/responses/{response.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    gone = _post(server, previous_response_id=response.id, input=FOLLOW_UP)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_as_it_ended(server) -> None:  # type: ignore[no-untyped-def]
    client = _client(server)
    events = list(client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, temperature=0, stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_the_oldest_stored_responses_are_evicted(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(responses_max_stored=2) as srv:
        ids = [_post(srv, input=f"{QUESTION} {i}", max_output_tokens=2).json()["id"] for i in range(3)]
        found = [httpx.get(srv.base_url + f"/v1/responses/{rid}").status_code for rid in ids]
        assert found == [404, 200, 200]
        assert httpx.get(srv.base_url + f"/v1/responses/{ids[0]}").json()["error"]["code"] == "response_not_found"
    # Nothing is kept: a response says so (store: false), streamed or not.
    for bound in ({"responses_max_stored": 0}, {"responses_max_stored_bytes": 0}, {"responses_max_stored_bytes": 100}):
        with make_server(**bound) as srv:
            response = _post(srv, input=QUESTION, max_output_tokens=2).json()
            assert response["store"] is False, bound
            assert httpx.get(srv.base_url + f"/v1/responses/{response['id']}").status_code == 404
            final = _stream_events(srv, input=QUESTION, max_output_tokens=2)[-1]["response"]
            assert final["store"] is False, bound


def _stream_events(server: Any, **body: Any) -> list[dict[str, Any]]:
    resp = _post(server, stream=True, **body)
    assert resp.status_code == 200, resp.text
    return [json.loads(frame.split("\ndata: ", 1)[1]) for frame in resp.text.split("\n\n") if frame]


def test_a_streamed_response_with_store_false_is_not_stored(server) -> None:  # type: ignore[no-untyped-def]
    events = _stream_events(server, input=QUESTION, max_output_tokens=3, store=False)
    assert events[0]["response"]["store"] is False and events[-1]["response"]["store"] is False
    rid = events[-1]["response"]["id"]
    assert httpx.get(server.base_url + f"/v1/responses/{rid}").status_code == 404
    follow = _post(server, previous_response_id=rid, input=FOLLOW_UP, max_output_tokens=2)
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"


def test_a_follow_up_may_send_instructions_alone(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    first = _post(server, input=QUESTION, max_output_tokens=4).json()
    follow = _post(server, previous_response_id=first["id"], instructions="Be terse.", max_output_tokens=4)
    assert follow.status_code == 200, follow.text
    text = first["output"][0]["content"][0]["text"]
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": QUESTION}, {"role": "assistant", "content": text}]
    chat = _chat(server, "tiny", messages, max_tokens=4)
    assert follow.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert follow.json()["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


# The chat tests' function, in the Responses shape (the same fields, one level up).
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}  # type: ignore[dict-item]


def test_a_forced_function_call_and_its_output_round_trip(tools_server) -> None:  # type: ignore[no-untyped-def]
    client = _client(tools_server)
    ask = {"model": "tiny-hermes", "tools": [WEATHER], "max_output_tokens": 96, "temperature": 0}
    called = client.responses.with_raw_response.create(input=QUESTION, tool_choice={"type": "function", "name": "get_weather"}, **ask)  # type: ignore[arg-type]
    response = called.parse()
    assert called.headers["x-millm-constrained"] == "tool_arguments"
    assert response.status == "completed" and response.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[union-attr]
    chat_call = _chat(tools_server, "tiny-hermes", [{"role": "user", "content": QUESTION}], tools=[CHAT_WEATHER],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96)  # fmt: skip
    assert chat_call["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == call.arguments  # type: ignore[union-attr]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 c"}  # type: ignore[union-attr]
    continued = client.responses.create(previous_response_id=response.id, input=[result], **ask)  # type: ignore[arg-type]
    whole = client.responses.create(input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result], **ask)  # type: ignore[arg-type]
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",  # type: ignore[union-attr]
                                                             "function": {"name": "get_weather", "arguments": call.arguments}}]},  # type: ignore[union-attr]
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 c"},  # type: ignore[union-attr]
    ]  # fmt: skip
    chat = _chat(tools_server, "tiny-hermes", messages, tools=[CHAT_WEATHER], max_tokens=96)
    assert continued.usage is not None and whole.usage is not None
    assert continued.usage.input_tokens == whole.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert continued.output_text == whole.output_text == (chat["choices"][0]["message"]["content"] or "")


def test_a_streamed_function_call(tools_server) -> None:  # type: ignore[no-untyped-def]
    client = _client(tools_server)
    ask = {"model": "tiny-hermes", "input": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 96, "temperature": 0}
    whole = client.responses.create(**ask)  # type: ignore[arg-type]
    with client.responses.stream(**ask) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert [c.arguments for c in calls] == [c.arguments for c in whole.output if c.type == "function_call"]  # type: ignore[union-attr]
    assert kinds[-5:] == [
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip


# ------------------------------------------------------------------ encrypted reasoning input

KEY = bytes(range(32))
REASONING = "The user asks about the sea; waves come to mind."


def _seal(text: str, key: bytes = KEY) -> str:
    return seal_reasoning(text, key)


@pytest.fixture(scope="module")
def keyed_server(make_server, reasoning_model, tmp_path_factory):  # type: ignore[no-untyped-def]
    key_file = tmp_path_factory.mktemp("key") / "responses.key"
    key_file.write_text(KEY.hex())
    with make_server(models=[reasoning_model], responses_key_file=str(key_file)) as srv:
        yield srv


def _turn(reasoning_item: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": QUESTION},
        {"type": "reasoning", "summary": [], **reasoning_item},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Waves."}]},
        {"role": "user", "content": FOLLOW_UP},
    ]


def _input_tokens(server: Any, items: list[dict[str, Any]]) -> int:
    resp = httpx.post(server.base_url + "/v1/responses", json={"model": "tiny-think", "input": items, "max_output_tokens": 1}, timeout=120)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["input_tokens"])


def test_an_encrypted_reasoning_item_is_opened_and_rendered(keyed_server) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Waves.", "reasoning_content": REASONING},
        {"role": "user", "content": FOLLOW_UP},
    ]
    rendered = _chat(keyed_server, "tiny-think", messages, max_tokens=1)["usage"]["prompt_tokens"]
    without = _chat(keyed_server, "tiny-think", [messages[0], {k: v for k, v in messages[1].items() if k != "reasoning_content"}, messages[2]], max_tokens=1)
    assert rendered > without["usage"]["prompt_tokens"]  # the template renders the reasoning
    assert _input_tokens(keyed_server, _turn({"encrypted_content": _seal(REASONING)})) == rendered
    assert _input_tokens(keyed_server, _turn({"content": [{"type": "reasoning_text", "text": REASONING}]})) == rendered


@pytest.mark.parametrize(("blob", "says"), [("tampered", "was altered"), ("foreign", "another key"), ("garbage", "not encrypted reasoning")])
def test_a_blob_this_server_did_not_seal_is_refused_naming_the_item_and_why(keyed_server, blob: str, says: str) -> None:  # type: ignore[no-untyped-def]
    sealed = _seal(REASONING)
    raw = bytearray(base64.urlsafe_b64decode(sealed))
    raw[20] ^= 1
    bad = {
        "tampered": base64.urlsafe_b64encode(bytes(raw)).decode(),
        "foreign": _seal(REASONING, key=bytes(32)),
        "garbage": "not a sealed blob",
    }[blob]
    resp = httpx.post(keyed_server.base_url + "/v1/responses", json={"model": "tiny-think", "input": _turn({"encrypted_content": bad})}, timeout=60)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "input[1].encrypted_content" and error["code"] == "invalid_encrypted_content"
    assert says in error["message"], error["message"]


def test_a_new_key_refuses_old_blobs_by_name_and_stored_conversations_go_on(make_server, reasoning_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    keys = {}
    for name, key in (("old", KEY), ("new", bytes(range(32, 64)))):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_text(key.hex())
    ask = {"model": "tiny-think", "max_output_tokens": 6, "temperature": 0}
    with make_server(models=[reasoning_model], db=db, responses_key_file=str(keys["old"])) as old:
        # Sent sealed, and answered with sealed reasoning of its own.
        first = httpx.post(old.base_url + "/v1/responses", json={**ask, "input": _turn({"encrypted_content": _seal(REASONING)}),
                                                                 "include": ["reasoning.encrypted_content"]}, timeout=120).json()  # fmt: skip
        assert first["output"][0]["type"] == "reasoning" and first["output"][0]["encrypted_content"]
        before = httpx.post(old.base_url + "/v1/responses", json={**ask, "previous_response_id": first["id"], "input": "More"}, timeout=120)
    with make_server(models=[reasoning_model], db=db, responses_key_file=str(keys["new"])) as new:
        after = httpx.post(new.base_url + "/v1/responses", json={**ask, "previous_response_id": first["id"], "input": "More"}, timeout=120)
        assert after.status_code == 200, after.text  # rendered from the stored text: no blob is opened again
        assert after.json()["usage"]["input_tokens"] == before.json()["usage"]["input_tokens"]
        reasoning = {k: v for k, v in first["output"][0].items() if k != "content"}
        again = httpx.post(new.base_url + "/v1/responses", json={**ask, "input": [*_turn({})[:1], reasoning, *_turn({})[2:]]}, timeout=120)
        assert again.status_code == 400 and "another key" in again.json()["error"]["message"]
