"""``/v1/responses`` on a reasoning model (the tiny model with a Qwen3-style template, served
as ``tiny-think``, with the reasoning plugin): chat's ``reasoning_content`` becomes a
reasoning item, streamed as reasoning-text events; reasoning tokens and a forced close are
reported; encrypted reasoning round trips, across a restart when the key is kept in the
database, and is refused by another server.

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


def _follow_up(reasoning_item: dict[str, Any], message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}, reasoning_item, message, {"role": "user", "content": "Are you sure?"}]


def _input_tokens(server: Any, items: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/responses", json={"model": "tiny-think", "input": items, "max_output_tokens": 1}, timeout=120)


def test_encrypted_reasoning_round_trips_and_renders_as_the_reasoning(reasoning_server) -> None:  # type: ignore[no-untyped-def]
    response = _respond(reasoning_server, max_output_tokens=20, include=["reasoning.encrypted_content"], store=False).json()
    reasoning, message = response["output"]
    sealed = reasoning["encrypted_content"]
    assert isinstance(sealed, str) and reasoning["content"][0]["text"] not in sealed
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
