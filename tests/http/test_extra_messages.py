"""``extra_messages``: several conversations in one chat request, each its own choice, run
as rows of one batch; each equals the conversation sent alone (greedy), on both engines,
streamed or not, scored or generated."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from millm_core.testing import RunningServer

FIRST = [{"role": "user", "content": "Name a colour."}]
OTHERS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A fruit?"}],
]


def chat(srv: RunningServer, model: str = "tiny", **body: Any) -> httpx.Response:
    payload = {"model": model, "messages": FIRST, "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=payload, timeout=120)


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


@pytest.mark.parametrize(("which", "model"), [("server", "tiny"), ("gguf_server", "tiny:F32")])
def test_each_conversation_is_a_choice_equal_to_the_conversation_alone(which: str, model: str, request: pytest.FixtureRequest) -> None:
    srv = request.getfixturevalue(which)
    solo = [ok(chat(srv, model, messages=messages)) for messages in (FIRST, *OTHERS)]
    together = ok(chat(srv, model, extra_messages=OTHERS))
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [(c["message"]["content"], c["finish_reason"]) for c in together["choices"]] == [
        (s["choices"][0]["message"]["content"], s["choices"][0]["finish_reason"]) for s in solo
    ]
    assert together["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in solo)
    assert together["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in solo)


def test_streamed_conversations_arrive_as_their_choices(server: RunningServer) -> None:
    whole = ok(chat(server, extra_messages=OTHERS))
    texts = ["", "", ""]
    finished = set()
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json={"model": "tiny", "messages": FIRST, "extra_messages": OTHERS, "max_tokens": 12, "temperature": 0, "stream": True}) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                texts[choice["index"]] += choice["delta"].get("content") or ""
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finished == {0, 1, 2}


def test_a_seed_promises_the_batch_shape(server: RunningServer) -> None:
    body = {"temperature": 1.0, "seed": 11, "max_tokens": 16}
    first = chat(server, extra_messages=OTHERS, **body)
    again = chat(server, extra_messages=OTHERS, **body)
    assert first.headers["x-millm-seed"] == '11;scope="batch-shape"'
    assert ok(first)["choices"] == ok(again)["choices"]
    alone = ok(chat(server, **body))
    assert ok(first)["choices"][0]["message"] == alone["choices"][0]["message"]  # row 0 draws as a request alone
    assert chat(server, **body).headers["x-millm-seed"] == '11;scope="request"'


def test_refusals_and_reports_name_the_conversation(server: RunningServer) -> None:
    both = chat(server, extra_messages=OTHERS, n=2)
    assert (both.status_code, both.json()["error"]["param"]) == (400, "n")
    empty = chat(server, extra_messages=[[]])
    assert (empty.status_code, empty.json()["error"]["param"]) == (400, "extra_messages[0]")
    named = chat(server, extra_messages=[[{"role": "user", "content": "x", "name": "ann"}]])
    assert named.headers["x-millm-ignored-fields"] == '"extra_messages[0][0].name"'
    plain, neutral = ok(chat(server)), ok(chat(server, extra_messages=[]))
    assert neutral["choices"] == plain["choices"]  # an empty list asks for nothing


def test_too_many_rows_are_refused(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(max_rows_per_request=2) as srv:
        resp = chat(srv, extra_messages=OTHERS)
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "too_many_rows")


def test_chat_scoring_scores_each_conversation(server: RunningServer) -> None:
    solo = [ok(chat(server, messages=m, logprobs=True, top_logprobs=3, max_tokens=1))["choices"][0] for m in (FIRST, *OTHERS)]
    together = ok(chat(server, extra_messages=OTHERS, logprobs=True, top_logprobs=3, max_tokens=1))["choices"]
    assert [c["index"] for c in together] == [0, 1, 2]
    assert [c["logprobs"] for c in together] == [c["logprobs"] for c in solo]


def test_activations_read_one_row(server: RunningServer) -> None:
    resp = chat(server, extra_messages=OTHERS, return_sae_activations={"top_k": 4})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "extra_messages")


def test_forced_calls_and_tool_history_in_every_conversation(tools_server: RunningServer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And Lima?"},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(tools_server, "tiny-hermes", extra_messages=[history], tools=tools, tool_choice=named, max_tokens=96)
    body = ok(resp)
    # The extra conversation's history is rendered as the first one's would be (this
    # template reads tool_calls, not tool_call_id: reported for it as for messages).
    assert resp.headers["x-millm-ignored-fields"] == '"extra_messages[0][2].tool_call_id"'
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "tool_calls"]
    alone = ok(chat(tools_server, "tiny-hermes", messages=history, tools=tools, tool_choice=named, max_tokens=96))
    assert body["choices"][1]["message"]["tool_calls"][0]["function"] == alone["choices"][0]["message"]["tool_calls"][0]["function"]
