"""Cancellation on disconnect, backpressure, and the body-size limit."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from millm_core.config import load_settings
from millm_core.server.app import build_host

from .helpers import GatePlugin, scheduler_stats, wait_until

MESSAGES = [{"role": "user", "content": "go"}]


_stats = scheduler_stats
_wait = wait_until


def test_disconnect_frees_the_row(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.02)  # 20 ms a token: 400 tokens would take 8 s
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "stream": True, "temperature": 0}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert all(isinstance(line, str) for line in received)
            assert _stats(srv.base_url)["active_rows"] == 1
        # The connection is closed here, mid-stream.
        assert _wait(lambda: _stats(srv.base_url)["cancelled_rows"] == 1)
        stats = _stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["running_jobs"] == 0
        assert stats["generated_tokens"] < 100  # stopped long before max_tokens


def test_queue_full_is_503_with_retry_after(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    gate = GatePlugin()
    host.register(gate, "gate")
    with make_server(host=host, max_queue=1) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        results: list[object] = []

        def call() -> None:
            results.append(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2))

        running = threading.Thread(target=call)
        running.start()
        assert _wait(lambda: _stats(srv.base_url)["running_jobs"] == 1)
        waiting = threading.Thread(target=call)
        waiting.start()
        assert _wait(lambda: _stats(srv.base_url)["queued"] == 1)
        refused = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1  # estimated from service times and the queue
        gate.gate.set()
        running.join(20)
        waiting.join(20)
        assert len(results) == 2


def test_body_over_the_limit_is_413(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(max_body_bytes=2048) as srv:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 4096}]}
        resp = httpx.post(srv.base_url + "/v1/chat/completions", json=big)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="tiny", messages=big["messages"])
        assert info.value.status_code == 413


def test_concurrent_requests_share_decode_steps_and_keep_their_text(server) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"Item {i}: the sea" for i in range(5)]

    def complete(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}
        return str(httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])

    alone = [complete(p) for p in prompts]
    before = _stats(server.base_url)
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(prompts[i]))) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = _stats(server.base_url)
    assert [results[i] for i in range(len(prompts))] == alone
    assert after["steps"] - before["steps"] < after["generated_tokens"] - before["generated_tokens"]
    assert httpx.get(server.base_url + "/api/health/inference").json()["backend"] == "batched"
