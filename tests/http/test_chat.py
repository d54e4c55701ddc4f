"""/v1/chat/completions through the real openai SDK and raw HTTP."""

from __future__ import annotations

import re

import http_sfv
import httpx
import openai
import pytest

from .helpers import chat_ids, hf_reference, json_frames

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about Paris."}]


def test_greedy_chat_equals_hf_generate(client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    resp = raw.parse()
    ids = chat_ids(tiny_engine, MESSAGES)
    text, reason = hf_reference(tiny_engine, ids, 20)
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == reason
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.system_fingerprint == "millm:tiny@tiny-llama-v1:float32/none:transformers"
    assert raw.headers["x-millm-model"] == "tiny"
    assert "x-millm-seed" not in raw.headers
    assert "x-millm-ignored-fields" not in raw.headers


def test_request_id_is_echoed_or_minted(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    sent = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert sent.headers["x-request-id"] == "abc-123"
    minted = [httpx.post(server.base_url + "/v1/chat/completions", json=body).headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", m) for m in minted) and minted[0] != minted[1]
    bad = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert bad.headers["x-request-id"].startswith("req_")


def test_same_seed_same_text_and_header(client) -> None:  # type: ignore[no-untyped-def]
    def run(seed: int):  # type: ignore[no-untyped-def]
        return client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=24, seed=seed)
    a, b, c = run(2**32 - 1), run(2**32 - 1), run(7)
    assert a.parse().choices[0].message.content == b.parse().choices[0].message.content
    assert a.parse().choices[0].finish_reason == b.parse().choices[0].finish_reason
    assert a.parse().choices[0].message.content != c.parse().choices[0].message.content
    assert a.headers["x-millm-seed"] == '4294967295;scope="request"'
    parsed = http_sfv.Item()
    parsed.parse(c.headers["x-millm-seed"].encode())
    assert parsed.value == 7 and parsed.params["scope"] == "request"


def test_unseeded_requests_draw_fresh_seeds(client) -> None:  # type: ignore[no-untyped-def]
    texts = {
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=16).choices[0].message.content
        for _ in range(3)
    }
    assert len(texts) > 1


def test_n_choices_are_distinct_and_reproducible(client) -> None:  # type: ignore[no-untyped-def]
    def run():  # type: ignore[no-untyped-def]
        return client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, temperature=1.0, seed=9, max_tokens=12)
    first, second = run(), run()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) == 3
    assert texts == [c.message.content for c in second.choices]
    # Usage counts every choice: 12 tokens each unless a choice ended early on EOS.
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 36
    else:
        assert first.usage.completion_tokens < 36


def test_n_with_stream_is_refused(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, stream=True)
    assert info.value.body["param"] == "n"


def test_max_tokens_and_max_completion_tokens(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, max_completion_tokens=6)
    assert "max_tokens" in info.value.body["message"] and "max_completion_tokens" in info.value.body["message"]
    same = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, max_completion_tokens=5, temperature=0)
    alone = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=5, temperature=0)
    assert same.choices[0].message.content == alone.choices[0].message.content
    assert alone.usage.completion_tokens <= 5


def test_context_length_exceeded_before_any_stream(server, client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    long = [{"role": "user", "content": "word " * 200}]
    prompt_len = len(chat_ids(tiny_engine, long))
    asked = 512 - prompt_len + 1
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=asked)
    body = info.value.body
    assert (body["code"], body["param"]) == ("context_length_exceeded", "max_tokens")
    assert "512" in body["message"] and str(prompt_len + asked) in body["message"]
    # A prompt that fills the window alone is the prompt's fault, whatever max_tokens says.
    longer = [{"role": "user", "content": "word " * 600}]
    for path, body in (("/v1/chat/completions", {"messages": longer}), ("/v1/completions", {"prompt": "word " * 600})):
        refused = httpx.post(server.base_url + path, json={"model": "tiny", "max_tokens": 4, **body})
        error = refused.json()["error"]
        assert (refused.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "messages" if "messages" in body else "prompt")
        assert "shorten it" in error["message"]
    streamed = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": long, "max_tokens": asked, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "context_length_exceeded"
    fits = client.chat.completions.create(model="tiny", messages=long, max_tokens=asked - 1, temperature=0)
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= 512


def test_stream_frames_byte_level(server, client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 15, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read()
    chunks = json_frames(raw)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    extensions = chunks[len(content):]  # closing extension chunks (e.g. the steering report)
    assert all(c["choices"] == [] and any(k.startswith("millm_") for k in c) for c in extensions)
    finals = [c for c in content if c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is content[-1]
    assert finals[0]["usage"]["completion_tokens"] == 15 or finals[0]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in content[:-1])
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert (text, finals[0]["choices"][0]["finish_reason"]) == hf_reference(tiny_engine, chat_ids(tiny_engine, MESSAGES), 15)


def _boundary_stop(engine, messages, max_new):  # type: ignore[no-untyped-def]
    """A stop string that spans two generated tokens, and the expected text before it."""
    ids = chat_ids(engine, messages)
    full, _ = hf_reference(engine, ids, max_new)
    import torch

    with torch.no_grad():
        out = engine.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    for k in range(2, len(new) - 1):
        left = engine.decode(new[:k])
        right = engine.decode(new[: k + 1])
        if left and len(right) > len(left) + 1 and full.startswith(right) and left[-1].isprintable():
            stop = left[-1] + right[len(left) : len(left) + 2]
            return stop, full[: full.find(stop)]
    raise AssertionError("no token boundary found to test")


def test_stop_sequence_across_token_boundary(client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Write some Python."}]
    stop, expected = _boundary_stop(tiny_engine, messages, 40)
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=40, stop=[stop])
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=40, stop=stop, stream=True)
    pieces, reasons = [], []
    for chunk in streamed:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == expected
    assert reasons[-1] == "stop"


def test_error_mid_stream_is_an_event_then_done(make_server) -> None:  # type: ignore[no-untyped-def]
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    from .helpers import BoomPlugin

    host = build_host(load_settings(environ={}))
    host.register(BoomPlugin(after=3), "boom")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 30, "stream": True, "temperature": 0}  # greedy: no early EOS by chance
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            chunks = json_frames(resp.read())
        assert chunks[-1] == {"error": {"message": chunks[-1]["error"]["message"], "type": "server_error", "param": None, "code": "internal_error"}}
        assert "exploded" not in chunks[-1]["error"]["message"]  # internals are logged, not sent
        plain = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "stream": False})
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "internal_error"


def test_a_tool_message_must_name_the_call_it_answers_on_any_server(make_server) -> None:  # type: ignore[no-untyped-def]
    """A core rule of the chat contract (as OpenAI's 400), so a server without the tools
    plugin refuses it too, naming the message, in extra_messages as well."""
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"block_plugins": ("tools", "responses")}, environ={}))
    assert not host.has("tools")
    answered = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    unanswered = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}]
    with make_server(host=host) as srv:
        url = srv.base_url + "/v1/chat/completions"
        bad = httpx.post(url, json={"model": "tiny", "messages": unanswered, "max_tokens": 2}, timeout=60)
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "messages[1].tool_call_id"), bad.text
        extra = httpx.post(url, json={"model": "tiny", "messages": answered, "extra_messages": [unanswered], "max_tokens": 2}, timeout=60)
        assert (extra.status_code, extra.json()["error"]["param"]) == (400, "extra_messages[0][1].tool_call_id"), extra.text
