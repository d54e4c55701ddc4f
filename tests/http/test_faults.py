"""Faults, overload and queue fairness against a real server: one request's failure stays
its own, a dead model thread answers 503 and turns readiness off, a request cancelled
while queued leaves the queue at once, a request that cannot join the running batch does
not hold back one that can, and scoring and embeddings count against ``--max-queue``.

Faults are injected per request by :class:`~tests.http.helpers.FaultPlugin` (header
``X-Test-Fault``), so each test chooses which request in a shared batch misbehaves."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from millm_core.config import load_settings
from millm_core.server.app import build_host
from millm_core.testing import RunningServer

from .helpers import FAULT_HEADER, FaultPlugin, json_frames, scheduler_stats, wait_until

PROMPTS = ["Tell me about the sea", "Count with me: one two"]


def _stats(srv: RunningServer) -> dict[str, Any]:
    return scheduler_stats(srv.base_url)


_wait = wait_until


def _chat(srv: RunningServer, prompt: str = PROMPTS[0], *, fault: str | None = None, model: str = "tiny", **body: Any) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0, **body}
    headers = {FAULT_HEADER: fault} if fault else {}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=payload, headers=headers, timeout=60)


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


@contextlib.contextmanager
def _faulty_server(make_server: Any, **overrides: Any) -> Iterator[tuple[RunningServer, FaultPlugin]]:
    host = build_host(load_settings(environ={}))
    faults = FaultPlugin()
    host.register(faults, "faults")
    with make_server(host=host, **overrides) as srv:
        yield srv, faults


def _hold(pool: ThreadPoolExecutor, srv: RunningServer, faults: FaultPlugin) -> Future[httpx.Response]:
    """A request that holds the model thread (waiting on ``faults.gate`` at its one token)
    so that what is sent next queues; setting the gate lets it finish."""
    blocker = pool.submit(_chat, srv, "hold", fault="gate", max_tokens=1)
    assert faults.entered.wait(20)
    return blocker


def _queue(pool: ThreadPoolExecutor, srv: RunningServer, calls: list[Callable[[], httpx.Response]]) -> list[Future[httpx.Response]]:
    """Send ``calls`` one after another, each in the queue before the next is sent."""
    start = _stats(srv)["queued"]
    futures = []
    for n, call in enumerate(calls, 1):
        futures.append(pool.submit(call))
        assert _wait(lambda n=n: _stats(srv)["queued"] == start + n)  # type: ignore[misc]
    return futures


def _assert_internal_error(resp: httpx.Response) -> None:
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["type"]) == ("internal_error", "server_error")
    assert "exploded" not in error["message"]  # the details are in the log


def test_a_failing_processor_fails_only_its_own_request(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server) as (srv, faults), ThreadPoolExecutor(8) as pool:
        alone = [_text(_chat(srv, p)) for p in PROMPTS]
        before = _stats(srv)
        blocker = _hold(pool, srv, faults)
        good_a, raises, bias_raises, good_b = _queue(
            pool,
            srv,
            [
                lambda: _chat(srv, PROMPTS[0]),
                lambda: _chat(srv, PROMPTS[0], fault="raise:3"),  # on_token raises at its 4th token
                lambda: _chat(srv, PROMPTS[1], fault="bias-raise:2", stream=True),  # logit_bias raises at its 3rd step
                lambda: _chat(srv, PROMPTS[1]),
            ],
        )
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        assert [_text(good_a.result(30)), _text(good_b.result(30))] == alone  # exactly their solo output
        _assert_internal_error(raises.result(30))
        streamed = bias_raises.result(30)
        assert streamed.status_code == 200
        frames = json_frames(streamed.content)
        assert frames[-1]["error"]["code"] == "internal_error" and "exploded" not in frames[-1]["error"]["message"]
        after = _stats(srv)
        assert after["failed_jobs"] - before["failed_jobs"] == 2
        assert after["steps"] - before["steps"] < after["generated_tokens"] - before["generated_tokens"]  # they shared steps
        assert after["running_jobs"] == after["active_rows"] == after["queued"] == 0


def test_a_join_the_engine_refuses_fails_only_the_joining_request(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server) as (srv, faults), ThreadPoolExecutor(8) as pool:
        alone = [_text(_chat(srv, p)) for p in PROMPTS]
        blocker = _hold(pool, srv, faults)
        good_a, refused, good_b = _queue(
            pool, srv, [lambda: _chat(srv, PROMPTS[0]), lambda: _chat(srv, fault="bad-join"), lambda: _chat(srv, PROMPTS[1])]
        )
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        refused_resp = refused.result(30)  # before the fix it waited forever and failed its neighbours
        assert refused_resp.status_code == 500 and refused_resp.json()["error"]["code"] == "internal_error"
        assert [_text(good_a.result(30)), _text(good_b.result(30))] == alone
        # The same rows opening a batch of their own fail alone too, and the server goes on.
        assert _chat(srv, fault="bad-join").status_code == 500
        assert _text(_chat(srv, PROMPTS[0])) == alone[0]


def test_a_step_that_raises_fails_its_batch_and_the_server_goes_on(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server) as (srv, faults), ThreadPoolExecutor(8) as pool:
        alone = _text(_chat(srv))
        blocker = _hold(pool, srv, faults)
        neighbour, poison = _queue(pool, srv, [lambda: _chat(srv), lambda: _chat(srv, fault="bad-bias:1")])
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        assert neighbour.result(30).status_code == 500  # the engine's step raised for the whole batch
        assert poison.result(30).status_code == 500
        assert _text(_chat(srv)) == alone
        assert httpx.get(srv.base_url + "/api/health/ready").status_code == 200
        stats = _stats(srv)
        assert stats["running_jobs"] == stats["active_rows"] == stats["queued"] == 0


def test_a_dead_model_thread_answers_503_and_readiness_turns_off(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server) as (srv, faults), ThreadPoolExecutor(8) as pool:
        assert httpx.get(srv.base_url + "/api/health/ready").status_code == 200
        blocker = _hold(pool, srv, faults)
        killer, neighbour, waiting = _queue(
            pool,
            srv,
            [
                lambda: _chat(srv, fault="fatal:0"),  # a BaseException at its first token kills the worker
                lambda: _chat(srv),  # joins the killer's batch
                lambda: _chat(srv, model="tiny-no-template"),  # another engine: still queued when it dies
            ],
        )
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        for future in (killer, neighbour, waiting):
            resp = future.result(30)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "scheduler_unavailable"
        ready = httpx.get(srv.base_url + "/api/health/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "scheduler_unavailable"
        assert int(ready.headers["retry-after"]) >= 1
        later = _chat(srv)
        assert later.status_code == 503 and later.json()["error"]["code"] == "scheduler_unavailable"
        embeddings = httpx.post(srv.base_url + "/v1/embeddings", json={"model": "tiny", "input": "x"})
        assert embeddings.status_code == 503 and embeddings.json()["error"]["code"] == "scheduler_unavailable"
        inference = httpx.get(srv.base_url + "/api/health/inference").json()
        assert inference["healthy"] is False and inference["failure"]
        assert inference["scheduler"]["queued"] == inference["scheduler"]["running_jobs"] == 0
        assert httpx.get(srv.base_url + "/api/health").status_code == 200  # alive, not ready


def test_a_stream_cancelled_while_queued_leaves_the_queue_at_once(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server) as (srv, faults), ThreadPoolExecutor(4) as pool:
        blocker = _hold(pool, srv, faults)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 50, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the connection
            next(lines)  # the role chunk: the job is submitted
            assert _stats(srv)["queued"] == 1
        # The client went away while the model thread is still held: the count drops now,
        # not when the worker reaches the job.
        assert _wait(lambda: _stats(srv)["queued"] == 0, timeout=3)
        stats = _stats(srv)
        assert stats["cancelled_rows"] == 1 and stats["running_jobs"] == 1 and not faults.gate.is_set()
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        assert _wait(lambda: _stats(srv)["running_jobs"] == 0)
        assert _stats(srv)["cancelled_rows"] == 1


@contextlib.contextmanager
def _raw_request(srv: RunningServer, body: dict[str, Any], headers: dict[str, str]) -> Iterator[socket.socket]:
    """A chat request sent on a raw socket; leaving the block closes the connection (a
    non-streamed request is then cancelled at its next step)."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}Content-Length: {len(payload)}\r\n\r\n"
    port = int(srv.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + payload)
        yield sock


@pytest.mark.parametrize(
    ("slow", "blocked_body", "joining_body"),
    [
        # Another engine cannot join the running batch.
        ({"n": 1, "fault": "slow:0.03"}, {"model": "tiny-no-template"}, {}),
        # No room: 14 running rows + 3 > the 16 rows the engine holds; 2 more fit.
        ({"n": 14, "fault": "slow:0.003"}, {"n": 3}, {"n": 2}),
    ],
    ids=["other-engine", "no-room"],
)
def test_a_request_that_cannot_join_does_not_block_one_that_can(  # type: ignore[no-untyped-def]
    make_server, slow: dict[str, Any], blocked_body: dict[str, Any], joining_body: dict[str, Any]
) -> None:
    with _faulty_server(make_server) as (srv, _), ThreadPoolExecutor(4) as pool:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "temperature": 0, "n": slow["n"]}
        with _raw_request(srv, body, {FAULT_HEADER: slow["fault"]}):  # ~12 s of steps
            assert _wait(lambda: _stats(srv)["running_jobs"] == 1 and _stats(srv)["generated_tokens"] > 0)
            (blocked,) = _queue(pool, srv, [lambda: _chat(srv, max_tokens=4, **blocked_body)])
            joining = pool.submit(_chat, srv, max_tokens=4, **joining_body)
            # The joining request passes the blocked one and ends while the slow one runs.
            assert joining.result(8).status_code == 200
            assert not blocked.done()
            stats = _stats(srv)
            assert stats["queued"] == 1 and stats["running_jobs"] == 1
        # The slow request's client is gone: its batch ends and the blocked request runs.
        assert blocked.result(30).status_code == 200


def test_scoring_and_embeddings_count_against_the_queue(make_server) -> None:  # type: ignore[no-untyped-def]
    with _faulty_server(make_server, max_queue=1) as (srv, faults), ThreadPoolExecutor(4) as pool:
        blocker = _hold(pool, srv, faults)
        (embedding,) = _queue(
            pool, srv, [lambda: httpx.post(srv.base_url + "/v1/embeddings", json={"model": "tiny", "input": "x"}, timeout=30)]
        )
        refusals = [
            _chat(srv),
            httpx.post(srv.base_url + "/v1/embeddings", json={"model": "tiny", "input": "y"}),
            httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "The sea", "max_tokens": 1, "logprobs": 2}),
        ]
        for resp in refusals:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "queue_full"
            assert int(resp.headers["retry-after"]) >= 1
        faults.gate.set()
        assert blocker.result(30).status_code == 200
        assert embedding.result(30).status_code == 200
        scored = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "The sea", "max_tokens": 1, "logprobs": 2})
        assert scored.status_code == 200, scored.text
        assert _stats(srv)["queued"] == 0
