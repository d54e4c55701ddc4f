"""``/v1/responses`` on a reasoning model (the tiny model with a Qwen3-style template, served
as ``tiny-think``, with the reasoning plugin): chat's ``reasoning_content`` becomes a
reasoning item, streamed as reasoning-text events; reasoning tokens, tokens the loop guard
took back and a forced close are reported; reasoning cut by the budget ends the same
streamed or not; encrypted reasoning round trips (the blob opens with the database's key),
across a restart when the key is kept in the database, and is refused by another server;
what a stored conversation carries unused is reported once, never on its follow-ups.

``chat_template_kwargs: {"open_thinking": true}`` (a chat extension, passed through
unchanged) opens the block in the prompt, and a thinking budget forces its close, so a
model with random weights reasons and then answers. Expectations come from the chat
reply to the same request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from millm_core.config import load_settings
from millm_core.server.app import build_host

from ..reasoning.helpers import ScriptPlugin
from .helpers import open_reasoning, sdk_validate

QUESTION = "What is two plus two?"
THINK = {"thinking_budget": 5, "chat_template_kwargs": {"open_thinking": True}}


def _chat(server: Any, **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny-think", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, **THINK, **body}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _respond(server: Any, **body: Any) -> httpx.Response:
    payload = {"model": "tiny-think", "input": QUESTION, "temperature": 0, **THINK, **body}
    return httpx.post(server.base_url + "/v1/responses", json=payload, timeout=120)


def test_the_reasoning_is_an_output_item_before_the_message(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    chat = _chat(reasoning_server, max_tokens=20)
    choice = chat["choices"][0]
    assert choice["message"]["reasoning_content"] and choice["thinking_budget_forced_at"] == 5
    resp = _respond(reasoning_server, max_output_tokens=20)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-reasoning"].startswith("on;budget=5")
    response = resp.json()
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": choice["message"]["reasoning_content"]}]
    assert "encrypted_content" not in reasoning
    assert message["type"] == "message" and message["content"][0]["text"] == choice["message"]["content"]
    assert response["thinking_budget_forced_at"] == 5
    details = chat["usage"]["completion_tokens_details"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == details["reasoning_tokens"] > 0


def test_reasoning_streams_as_reasoning_text_events(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    whole = _respond(reasoning_server, max_output_tokens=20).json()
    resp = _respond(reasoning_server, max_output_tokens=20, stream=True, include=["reasoning.encrypted_content"])
    events = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in resp.text.split("\n\n") if frame]
    kinds = [e["type"] for e in events]
    reasoning_deltas, text_deltas = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.reasoning_text.delta"] * reasoning_deltas,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * text_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    reasoning_text = whole["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning_text
    done = events[4 + reasoning_deltas + 2]
    assert done["item"]["type"] == "reasoning" and done["item"]["encrypted_content"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == reasoning_text and final["output"][1]["content"] == whole["output"][1]["content"]
    assert final["thinking_budget_forced_at"] == 5
    assert final["usage"]["output_tokens_details"] == whole["usage"]["output_tokens_details"]
    sdk = list(openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="x", max_retries=0).responses.create(
        model="tiny-think", input=QUESTION, temperature=0, max_output_tokens=20, stream=True, extra_body=THINK))  # fmt: skip
    assert "".join(e.delta for e in sdk if e.type == "response.reasoning_text.delta") == reasoning_text  # type: ignore[union-attr]
    sdk_validate(whole)
    sdk_validate(final, events)


def _follow_up(reasoning_item: dict[str, Any], message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}, reasoning_item, message, {"role": "user", "content": "Are you sure?"}]


def _input_tokens(server: Any, items: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json={"model": "tiny-think", "input": items, "max_output_tokens": 1}, timeout=120)


def test_encrypted_reasoning_round_trips_and_renders_as_the_reasoning(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    response = _respond(reasoning_server, max_output_tokens=20, include=["reasoning.encrypted_content"], store=False).json()
    reasoning, message = response["output"]
    sealed = reasoning["encrypted_content"]
    [(key,)] = reasoning_server.app.state.millm.app.store.query("SELECT key FROM responses_key")
    assert open_reasoning(sealed, bytes(key)) == reasoning["content"][0]["text"]  # sealed under the database's key
    opened = _input_tokens(reasoning_server, _follow_up({"type": "reasoning", "summary": [], "encrypted_content": sealed}, message))
    plain = _input_tokens(reasoning_server, _follow_up({k: v for k, v in reasoning.items() if k != "encrypted_content"}, message))
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": message["content"][0]["text"], "reasoning_content": reasoning["content"][0]["text"]},
        {"role": "user", "content": "Are you sure?"},
    ]
    chat = httpx.post(reasoning_server.base_url + "/v1/chat/completions", json={"model": "tiny-think", "messages": messages, "max_tokens": 1}, timeout=120)
    assert opened.status_code == plain.status_code == 200
    assert opened.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    tampered = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    refused = _input_tokens(reasoning_server, _follow_up({"type": "reasoning", "summary": [], "encrypted_content": tampered}, message))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[1].encrypted_content"


def test_the_key_kept_in_the_database_outlives_the_server(make_server, reasoning_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(models=[reasoning_model], db=db) as first:
        response = _respond(first, max_output_tokens=20, include=["reasoning.encrypted_content"]).json()
    reasoning, message = response["output"]
    item = {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]}
    with make_server(models=[reasoning_model], db=db) as restarted:
        assert _input_tokens(restarted, _follow_up(item, message)).status_code == 200
        stored = httpx.get(restarted.base_url + f"/v1/responses/{response['id']}")
        assert stored.status_code == 200 and stored.json() == response  # stored responses outlive it too
    with make_server(models=[reasoning_model], db=str(tmp_path / "other.db")) as other:
        foreign = _input_tokens(other, _follow_up(item, message))
        assert foreign.status_code == 400 and foreign.json()["error"]["code"] == "invalid_encrypted_content"


@pytest.mark.parametrize(("effort", "header"), [("none", "off"), ("high", "on")])
def test_reasoning_effort_is_chats_reasoning_effort(reasoning_server, effort: str, header: str) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(
        reasoning_server.base_url + "/v1/responses",
        json={"model": "tiny-think", "input": QUESTION, "max_output_tokens": 4, "reasoning": {"effort": effort}},
        timeout=120,
    )
    chat = httpx.post(
        reasoning_server.base_url + "/v1/chat/completions",
        json={"model": "tiny-think", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "reasoning_effort": effort},
        timeout=120,
    )
    assert resp.status_code == chat.status_code == 200, resp.text
    assert resp.headers["x-millm-reasoning"].split(";")[0] == chat.headers["x-millm-reasoning"].split(";")[0] == header
    assert resp.json()["reasoning"] == {"effort": effort}
    # what chat reports unused as reasoning_effort is reported here by this API's name
    renamed = chat.headers.get("x-millm-ignored-fields", "").replace('"reasoning_effort"', '"reasoning.effort"')
    assert resp.headers.get("x-millm-ignored-fields", "") == renamed


def test_reasoning_cut_by_the_budget_is_the_incomplete_item_streamed_or_not(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    body = {"thinking_budget": 50, "max_output_tokens": 4}
    whole = _respond(reasoning_server, **body).json()
    resp = _respond(reasoning_server, stream=True, **body)
    events = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in resp.text.split("\n\n") if frame]
    final = events[-1]["response"]
    for response in (whole, final):
        assert response["status"] == "incomplete"
        [reasoning] = response["output"]  # no empty message after it
        assert reasoning["type"] == "reasoning" and reasoning["status"] == "incomplete" and reasoning["content"][0]["text"]
    assert final["output"][0]["content"] == whole["output"][0]["content"]
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete"]
    sdk_validate(whole)
    sdk_validate(final, events)


def test_tokens_the_loop_guard_took_back_are_rewound_tokens(make_server, reasoning_model) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(ScriptPlugin(), "script")
    [token] = reasoning_model.engine.encode(" no", add_special_tokens=False)[:1]
    headers = {"x-script": json.dumps([token] * 20)}  # a loop: the guard takes a repeat back
    with make_server(host=host, models=[reasoning_model]) as srv:
        payload = {"model": "tiny-think", "temperature": 0, "chat_template_kwargs": {"open_thinking": True}}
        chat = httpx.post(srv.base_url + "/v1/chat/completions", json={**payload, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 30},
                          headers=headers, timeout=120).json()  # fmt: skip
        details = chat["usage"]["completion_tokens_details"]
        assert details["rewound_tokens"] >= 1
        whole = httpx.post(srv.base_url + "/v1/responses", json={**payload, "input": QUESTION, "max_output_tokens": 30}, headers=headers, timeout=120).json()
        streamed = httpx.post(srv.base_url + "/v1/responses", json={**payload, "input": QUESTION, "max_output_tokens": 30, "stream": True},
                              headers=headers, timeout=120)  # fmt: skip
        final = [json.loads(f.split("\ndata: ", 1)[1]) for f in streamed.text.split("\n\n") if f][-1]["response"]
    for response in (whole, final):
        assert response["usage"]["output_tokens_details"] == details  # {reasoning_tokens, rewound_tokens}
        assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]


def test_what_a_stored_conversation_carries_unused_is_not_reported_again(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    summary = [{"type": "summary_text", "text": "Adding."}]
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "reasoning", "summary": summary, "content": [{"type": "reasoning_text", "text": "Two and two."}]},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "Sure?"},
    ]
    first = httpx.post(reasoning_server.base_url + "/v1/responses", json={"model": "tiny-think", "input": items, "max_output_tokens": 4}, timeout=120)
    assert first.status_code == 200 and first.headers["x-millm-ignored-fields"] == '"input[1].summary"'  # beside content: never rendered
    strict = {"X-miLLM-Strict": "true"}
    # On the same model, and on one whose template has no reasoning (tiny): the stored
    # reasoning is not reported again, and strict mode lets the conversation go on.
    for model in ("tiny-think", "tiny"):
        body = {"model": model, "previous_response_id": first.json()["id"], "input": "Why?", "max_output_tokens": 2}
        follow = httpx.post(reasoning_server.base_url + "/v1/responses", json=body, headers=strict, timeout=120)
        assert follow.status_code == 200, (model, follow.text)
        assert "x-millm-ignored-fields" not in follow.headers
    sent = httpx.post(reasoning_server.base_url + "/v1/responses", json={"model": "tiny", "input": items[1:], "max_output_tokens": 2}, timeout=120)
    assert sent.headers["x-millm-ignored-fields"] == '"input[0].summary", "input[0]"'  # sent now: reported
