"""The reasoning plugin on a real server: the tiny model with a Qwen3-style template
(tests/fixtures/templates/think.jinja). Its weights are random, so budgets, redirects and
loops are provoked by a plugin that forces scripted tokens; every expectation comes from
a second copy of the model stepped directly with the same biases."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from millm_core.config import load_settings
from millm_core.registry import ServedModel
from millm_core.server.app import build_host
from millm_core.testing import RunningServer
from millm_engines.transformers.testing import tiny_model_dir

from ..conftest import TEMPLATES, _load
from .helpers import CLOSE, FORCE, ScriptPlugin, forcing, reference, split, texts

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
OPEN = {"open_thinking": True}


def _think(name: str) -> ServedModel:
    settings = load_settings({"log_level": "warning", "chat_template": os.path.join(TEMPLATES, "think.jinja")}, environ={})
    return _load(tiny_model_dir(context=2048), name, settings)


@pytest.fixture(scope="module")
def ref() -> Any:
    """A second copy of the served model, stepped directly by the tests."""
    return _think("ref").engine


@pytest.fixture(scope="module")
def srv(make_server, tiny_model: ServedModel) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    """``tiny-think``: a template whose model opens its block itself (``open_thinking``
    opens it in the prompt), beside ``tiny`` (no reasoning block)."""
    host = build_host(load_settings(environ={}))
    host.register(ScriptPlugin(), "script")
    with make_server(host=host, models=[_think("tiny-think"), tiny_model]) as server:
        yield server


def chat(srv: RunningServer, script: list[int | None] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": "tiny-think", "messages": MESSAGES, "temperature": 0, "max_tokens": 24, **body}
    headers = {"x-script": json.dumps(script)} if script is not None else {}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=payload, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def stream(srv: RunningServer, **body: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """(reasoning, content, chunks) of a streamed chat."""
    payload = {"model": "tiny-think", "messages": MESSAGES, "temperature": 0, "max_tokens": 24, "stream": True, **body}
    chunks = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=payload, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    return "".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas), chunks


def prompt(ref: Any, **kwargs: Any) -> list[int]:
    return list(ref.render_chat(MESSAGES, **kwargs))


def close_ids(ref: Any, reasoning_text: str) -> list[int]:
    """The close the plugin forces after reasoning text (a newline first unless it ends a line)."""
    prefix = "" if not reasoning_text or reasoning_text.endswith("\n") else "\n"
    return list(ref.encode(prefix + CLOSE + "\n\n", add_special_tokens=False))


def request_line(logs: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request's log line (written as its response ends: waited for)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [e for e in logs if e["event"] == "request" and e.get("path") == "/v1/chat/completions"]
        if lines:
            return lines[-1]
        time.sleep(0.01)
    raise AssertionError("no request log line")


def message(resp: httpx.Response) -> dict[str, Any]:
    return dict(resp.json()["choices"][0]["message"])


def test_the_reasoning_comes_apart_from_the_answer_streamed_or_not(srv: RunningServer, ref: Any) -> None:
    expected_ids = reference(ref, prompt(ref, **OPEN), 24)
    assert CLOSE not in texts(ref, expected_ids), "the random model closed its block by chance: pick another prompt"
    reasoning, answer = split(texts(ref, expected_ids))
    resp = chat(srv, chat_template_kwargs=OPEN)
    got = message(resp)
    assert (got.get("reasoning_content"), got["content"]) == (reasoning, answer)
    usage = resp.json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 24}
    assert resp.headers["x-millm-reasoning"] == "on;loop-guard=rewind;redirect=?1"
    streamed_reasoning, streamed_answer, chunks = stream(srv, chat_template_kwargs=OPEN)
    assert (streamed_reasoning, streamed_answer) == (reasoning, answer)
    [usage_chunk] = [c for c in chunks if c.get("usage")]
    assert usage_chunk["usage"]["completion_tokens_details"] == {"reasoning_tokens": 24}


def test_the_openai_sdk_reads_the_reasoning(srv: RunningServer, ref: Any) -> None:
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    done = client.chat.completions.create(
        model="tiny-think", messages=MESSAGES, temperature=0, max_tokens=12, extra_body={"chat_template_kwargs": OPEN}  # type: ignore[arg-type]
    )
    reasoning, _ = split(texts(ref, reference(ref, prompt(ref, **OPEN), 12)))
    assert getattr(done.choices[0].message, "reasoning_content", None) == reasoning
    assert done.usage is not None and done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == 12


def test_a_spent_budget_forces_the_close_and_the_model_answers(srv: RunningServer, ref: Any) -> None:
    ids = prompt(ref, **OPEN)
    first = reference(ref, ids, 6)
    close = close_ids(ref, texts(ref, first))
    expected_ids = reference(ref, ids, 40, forcing(6, close))
    reasoning, answer = split(texts(ref, expected_ids))
    assert answer, "the forced close must leave room for an answer"
    resp = chat(srv, chat_template_kwargs=OPEN, thinking_budget=6, max_tokens=40)
    got = message(resp)
    assert (got.get("reasoning_content"), got["content"]) == (reasoning, answer)
    choice = resp.json()["choices"][0]
    assert choice["thinking_budget_forced_at"] == 6
    # Reasoning tokens run to the one that completes the close marker.
    closing = next(i for i in range(1, len(close) + 1) if CLOSE in texts(ref, first + close[:i]))
    assert resp.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6 + closing
    assert resp.headers["x-millm-reasoning"].startswith("on;budget=6;")
    # Streaming: the same split, and the forced close reported on the finish chunk.
    streamed_reasoning, streamed_answer, chunks = stream(srv, chat_template_kwargs=OPEN, thinking_budget=6, max_tokens=40)
    assert (streamed_reasoning, streamed_answer) == (reasoning, answer)
    finish = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert [c["choices"][0].get("thinking_budget_forced_at") for c in finish] == [6]


def test_the_budget_leaves_the_answer_reserve_and_max_effort_lifts_it(srv: RunningServer) -> None:
    # max_tokens 20: the reserve (2048) is capped at half, so a budget of 50 becomes 10.
    resp = chat(srv, chat_template_kwargs=OPEN, thinking_budget=50, max_tokens=20)
    assert resp.json()["choices"][0]["thinking_budget_forced_at"] == 10
    unbounded = chat(srv, chat_template_kwargs=OPEN, thinking_budget=5, reasoning_effort="max", max_tokens=20)
    assert "thinking_budget_forced_at" not in unbounded.json()["choices"][0]
    assert "budget=" not in unbounded.headers["x-millm-reasoning"]
    assert unbounded.headers["x-millm-ignored-fields"] == '"thinking_budget"'  # "max" lifts it: unused, said so
    off = chat(srv, chat_template_kwargs={"enable_thinking": False}, thinking_budget=5, reasoning_effort="max", max_tokens=4)
    assert off.headers["x-millm-ignored-fields"] == '"thinking_budget", "reasoning_effort"'  # each named once
    assert "x-millm-ignored-fields" not in resp.headers
    none = chat(srv, chat_template_kwargs=OPEN, thinking_budget=0, max_tokens=20)
    assert "thinking_budget_forced_at" not in none.json()["choices"][0]


def test_an_end_of_turn_inside_the_reasoning_becomes_its_close(srv: RunningServer, ref: Any, info_logs: None) -> None:
    ids = prompt(ref, **OPEN)
    [eos] = sorted(ref.eos_token_ids)
    first = reference(ref, ids, 3)
    close = close_ids(ref, texts(ref, first))
    expected_ids = reference(ref, ids, 30, forcing(3, close))
    reasoning, answer = split(texts(ref, expected_ids))
    with capture_logs() as logs:
        resp = chat(srv, [None, None, None, eos], chat_template_kwargs=OPEN, max_tokens=31)
        line = request_line(logs)
    got = message(resp)
    assert (got.get("reasoning_content"), got["content"]) == (reasoning, answer)
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert resp.json()["usage"]["completion_tokens"] == 31  # the end of turn was drawn, and counts
    assert line["reasoning_redirected_at"] == 3
    # With thinking off the end of turn ends the turn.
    off = chat(srv, [eos], chat_template_kwargs={"enable_thinking": False})
    assert (off.json()["choices"][0]["finish_reason"], off.headers["x-millm-reasoning"]) == ("stop", "off")


def test_an_end_of_turn_with_little_room_left_still_closes_and_ends_by_length(srv: RunningServer, ref: Any) -> None:
    """However few tokens are left, the end of turn is redirected: the turn never comes back
    as a stop with reasoning only. Where the row runs out inside the close, it ends by
    length and no piece of the close the plugin was writing shows in the reasoning."""
    ids = prompt(ref, **OPEN)
    [eos] = sorted(ref.eos_token_ids)
    first = reference(ref, ids, 3)
    close = close_ids(ref, texts(ref, first))
    seen_partial = seen_whole = False
    for max_tokens in range(5, 5 + len(close) + 1):
        text = texts(ref, reference(ref, ids, max_tokens - 1, forcing(3, close)))  # the end of turn counts, as above
        if CLOSE in text:
            reasoning, answer = split(text)
            seen_whole = True
        else:
            reasoning, answer = texts(ref, first).strip("\n"), ""
            seen_partial = seen_partial or any(CLOSE.startswith(text.rstrip()[-n:]) for n in range(1, len(CLOSE)))
        resp = chat(srv, [None, None, None, eos], chat_template_kwargs=OPEN, max_tokens=max_tokens)
        got, choice = message(resp), resp.json()["choices"][0]
        assert (got.get("reasoning_content"), got["content"], choice["finish_reason"]) == (reasoning, answer, "length"), max_tokens
    assert seen_partial and seen_whole  # both cases ran
    # The end of turn as the row's very last token: no room to redirect it, and the turn
    # has no answer: it ran out of tokens (length), never a stop with reasoning only.
    last = chat(srv, [None, None, None, eos], chat_template_kwargs=OPEN, max_tokens=4)
    got, choice = message(last), last.json()["choices"][0]
    assert (got.get("reasoning_content"), got["content"], choice["finish_reason"]) == (split(texts(ref, first))[0], "", "length")


def test_a_forced_close_cut_short_by_max_tokens_leaves_no_piece_of_it_in_the_reasoning(srv: RunningServer, ref: Any) -> None:
    ids = prompt(ref, **OPEN)
    cut = 0
    for max_tokens in range(2, 12):
        forced_at = max_tokens - max_tokens // 2  # a budget of 8, less the answer reserve (half of max_tokens here)
        first = reference(ref, ids, forced_at)
        text = texts(ref, reference(ref, ids, max_tokens, forcing(forced_at, close_ids(ref, texts(ref, first)))))
        if CLOSE in text:
            reasoning, answer = split(text)
        else:
            reasoning, answer = texts(ref, first).strip("\n"), ""
            cut += 1
        for got in (message(chat(srv, chat_template_kwargs=OPEN, thinking_budget=8, max_tokens=max_tokens)),
                    dict(zip(("reasoning_content", "content"), stream(srv, chat_template_kwargs=OPEN, thinking_budget=8, max_tokens=max_tokens)[:2], strict=True))):  # fmt: skip
            assert (got.get("reasoning_content"), got["content"]) == (reasoning, answer), max_tokens
    assert cut >= 2  # closes cut short ran


def _loop_expectation(ref: Any, ids: list[int], token: int, repeats: int, n: int) -> list[int]:
    """What a row forced to repeat ``token`` should keep: the guard takes the 16th copy
    back and bans ``token`` for the step that redraws it."""
    biases = {i: {token: FORCE} for i in range(repeats - 1)}
    biases[repeats - 1] = {token: -FORCE}
    return reference(ref, ids, n, biases)


def test_the_loop_guard_takes_a_repeat_back_and_the_row_goes_on(srv: RunningServer, ref: Any) -> None:
    ids = prompt(ref, **OPEN)
    [token] = ref.encode(" no", add_special_tokens=False)[:1]
    expected_ids = _loop_expectation(ref, ids, token, 16, 29)
    reasoning, answer = split(texts(ref, expected_ids))
    resp = chat(srv, [token] * 20, chat_template_kwargs=OPEN, max_tokens=30)
    got = message(resp)
    assert (got.get("reasoning_content"), got["content"]) == (reasoning, answer)
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 30
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 29, "rewound_tokens": 1}


def test_rewound_and_redirected_rows_in_a_shared_batch_equal_their_solo_runs(srv: RunningServer, ref: Any) -> None:
    [token] = ref.encode(" no", add_special_tokens=False)[:1]
    [eos] = sorted(ref.eos_token_ids)
    cases: list[tuple[list[int | None] | None, dict[str, Any]]] = [
        ([token] * 20, {"chat_template_kwargs": OPEN, "max_tokens": 30}),
        ([None, None, eos], {"chat_template_kwargs": OPEN, "max_tokens": 30}),
        (None, {"chat_template_kwargs": OPEN, "thinking_budget": 4, "max_tokens": 30}),
        (None, {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 30}),
        (None, {"messages": [{"role": "user", "content": "Count to ten."}], "chat_template_kwargs": OPEN, "max_tokens": 30}),
    ]
    solo = [message(chat(srv, script, **body)) for script, body in cases]
    with concurrent.futures.ThreadPoolExecutor(len(cases) * 2) as pool:
        futures = [pool.submit(chat, srv, script, **body) for script, body in cases * 2]
        together = [message(f.result()) for f in futures]
    assert together == solo * 2


def test_stop_never_matches_inside_the_reasoning(srv: RunningServer, ref: Any) -> None:
    expected = texts(ref, reference(ref, prompt(ref, **OPEN), 24))
    reasoning, _ = split(expected)
    word = reasoning[5:9]
    assert word.strip(), "pick a slice with text"
    resp = chat(srv, chat_template_kwargs=OPEN, stop=[word])
    assert message(resp).get("reasoning_content") == reasoning
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_the_model_may_open_the_block_itself(srv: RunningServer, ref: Any) -> None:
    ids = prompt(ref)
    opening = list(ref.encode("<think>\n", add_special_tokens=False))
    expected_ids = reference(ref, ids, 20, forcing(0, opening))
    reasoning, answer = split(texts(ref, expected_ids)[len("<think>") :])
    resp = chat(srv, opening, max_tokens=20)
    assert (message(resp).get("reasoning_content"), message(resp)["content"]) == (reasoning, answer)
    assert resp.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 20


def test_thinking_off_is_plain_generation(srv: RunningServer, ref: Any) -> None:
    off = {"enable_thinking": False}
    expected = texts(ref, reference(ref, prompt(ref, **off), 24))
    for body in ({"chat_template_kwargs": off}, {"reasoning_effort": "none"}):
        resp = chat(srv, **body)
        got = message(resp)
        assert ("reasoning_content" not in got, got["content"], resp.headers["x-millm-reasoning"]) == (True, expected.lstrip("\n"), "off")
        assert "completion_tokens_details" not in resp.json()["usage"]
    clash = httpx.post(
        srv.base_url + "/v1/chat/completions",
        json={"model": "tiny-think", "messages": MESSAGES, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
    )
    assert (clash.status_code, clash.json()["error"]["param"]) == (400, "reasoning_effort")


def test_past_reasoning_is_rendered_and_fields_on_other_models_are_reported(srv: RunningServer) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"}, {"role": "user", "content": "Sure?"}]
    with_reasoning = chat(srv, messages=history, max_tokens=1)
    without = chat(srv, messages=[{**m, "reasoning_content": None} if m["role"] == "assistant" else m for m in history], max_tokens=1)
    grown = len(srv_encode(srv, "<think>\ntwo and two make four\n</think>\n\n"))
    assert with_reasoning.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"] == grown
    assert "x-millm-ignored-fields" not in with_reasoning.headers
    plain = chat(srv, model="tiny", messages=history, thinking_budget=10, reasoning_effort="max", max_tokens=1)
    assert plain.headers["x-millm-ignored-fields"] == '"thinking_budget", "reasoning_effort", "messages[1].reasoning_content"'
    assert "x-millm-reasoning" not in plain.headers
    low = chat(srv, reasoning_effort="low", max_tokens=1)
    assert low.headers["x-millm-ignored-fields"] == '"reasoning_effort"'


def srv_encode(srv: RunningServer, text: str) -> list[int]:
    resp = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny-think", "prompt": text, "max_tokens": 1, "temperature": 0})
    count = int(resp.json()["usage"]["prompt_tokens"])
    return [0] * count


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_forced_call_comes_after_the_reasoning(srv: RunningServer, ref: Any) -> None:
    reasoning, _ = split(texts(ref, reference(ref, prompt(ref, **OPEN, tools=TOOLS), 4)))
    for choice in (NAMED, "required"):
        resp = chat(srv, chat_template_kwargs=OPEN, thinking_budget=4, max_tokens=200, tools=TOOLS, tool_choice=choice)
        body = resp.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls", body
        assert body["message"]["reasoning_content"] == reasoning
        [call] = body["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Lima")
        assert body["thinking_budget_forced_at"] == 4
    # Thinking off: the opening is the first thing generated (in the prompt), as before.
    off = chat(srv, chat_template_kwargs={"enable_thinking": False}, max_tokens=200, tools=TOOLS, tool_choice=NAMED)
    body = off.json()["choices"][0]
    assert (body["finish_reason"], "reasoning_content" in body["message"]) == ("tool_calls", False)


def test_the_default_max_tokens_counts_the_reasoning(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(models=[_think("tiny-think")], default_max_tokens=10) as short:
        resp = httpx.post(
            short.base_url + "/v1/chat/completions",
            json={"model": "tiny-think", "messages": MESSAGES, "temperature": 0, "chat_template_kwargs": OPEN},
            timeout=60,
        )
    body = resp.json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("length", 10)
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10


def test_an_earlier_turns_block_does_not_decide_where_the_row_starts(srv: RunningServer, ref: Any) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning_content": "two and two"}, {"role": "user", "content": "Sure?"}]
    opening = list(ref.encode("<think>\n", add_special_tokens=False))
    ids = list(ref.render_chat(history))
    expected_ids = reference(ref, ids, 20, forcing(0, opening))
    reasoning, answer = split(texts(ref, expected_ids)[len("<think>") :])
    resp = chat(srv, opening, messages=history, max_tokens=20)
    assert (message(resp).get("reasoning_content"), message(resp)["content"]) == (reasoning, answer)


def test_a_forced_call_makes_a_model_that_opens_its_own_block_think_first(srv: RunningServer, ref: Any) -> None:
    resp = chat(srv, thinking_budget=6, max_tokens=200, tools=TOOLS, tool_choice=NAMED)
    body = resp.json()["choices"][0]
    assert body["finish_reason"] == "tool_calls", body
    assert isinstance(body["message"]["reasoning_content"], str)  # it thought (the budget counts the forced opening)
    assert body["thinking_budget_forced_at"] == 6
    assert resp.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 6


def test_penalties_apply_to_the_reasoning_too(srv: RunningServer) -> None:
    plain = message(chat(srv, chat_template_kwargs=OPEN, max_tokens=40))
    penalised = message(chat(srv, chat_template_kwargs=OPEN, max_tokens=40, frequency_penalty=2.0, presence_penalty=2.0))
    assert plain["reasoning_content"] != penalised["reasoning_content"]
    assert plain["reasoning_content"][:3] == penalised["reasoning_content"][:3]  # the first draw has nothing to penalise yet
