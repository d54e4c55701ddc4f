"""Scheduling lanes: ``class``/``@agent``, the order waiting work is served in, and that
an agent request is never starved. The engine here runs one request at a time (a model
whose cache has a sliding-window layer, which the generic HF forward cannot merge across
requests), so the order requests finish in is the order the scheduler served them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_core.hookspecs import hookimpl
from millm_core.registry import ServedModel
from millm_core.server.app import build_host
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.testing import tiny_model_dir

from .helpers import GatePlugin, scheduler_stats, wait_until

MESSAGES = [{"role": "user", "content": "go"}]


class Finished:
    """Records the ``X-Test-Tag`` of each generation as it is finalised."""

    def __init__(self) -> None:
        self.order: list[str] = []

    @hookimpl
    def millm_finalize(self, ctx: Any, request: Any, outcome: Any, out: Any) -> None:
        if outcome.kind == "generation" and "x-test-tag" in ctx.headers:
            self.order.append(ctx.headers["x-test-tag"])


@pytest.fixture(scope="module")
def serial_model() -> ServedModel:
    engine = load_engine(ModelLocation(path=tiny_model_dir(architecture="qwen2", sliding_window=64), served_name="tiny"), load_settings({}, environ={}))
    assert not engine.batches_requests
    return ServedModel(info=engine.info, engine=engine)


@pytest.fixture
def gated(make_server: Any, serial_model: ServedModel) -> Iterator[tuple[Any, GatePlugin, Finished]]:
    host = build_host(load_settings(environ={}))
    gate, finished = GatePlugin(), Finished()
    host.register(gate, "gate")
    host.register(finished, "finished")
    with make_server(host=host, models=[serial_model]) as srv:
        yield srv, gate, finished
        gate.gate.set()


def post(srv: Any, tag: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers={"X-Test-Tag": tag}, timeout=120)


def queue_behind_a_running_request(srv: Any, gate: GatePlugin, sends: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """Hold the model thread with a running request, queue ``sends`` in that order, then
    let everything run; the responses in ``sends`` order."""
    results: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda: results.__setitem__("first", post(srv, "first")))]
    threads[0].start()
    assert wait_until(lambda: scheduler_stats(srv.base_url)["running_jobs"] == 1)
    for n, (tag, extra) in enumerate(sends, start=1):
        thread = threading.Thread(target=lambda t=tag, e=extra: results.__setitem__(t, post(srv, t, **e)))
        thread.start()
        threads.append(thread)
        assert wait_until(lambda n=n: scheduler_stats(srv.base_url)["queued"] == n)
    gate.gate.set()
    for thread in threads:
        thread.join(60)
    return [results[tag] for tag, _ in sends]


def test_waiting_interactive_requests_are_served_before_agent_ones(gated: Any) -> None:
    srv, gate, finished = gated
    agent = {"class": "agent"}
    sends = [("a1", agent), ("a2", {"model": "tiny@agent"}), ("i1", {}), ("i2", {"class": "interactive"}), ("a3", agent), ("i3", {})]
    responses = queue_behind_a_running_request(srv, gate, sends)
    assert all(r.status_code == 200 for r in responses)
    assert finished.order == ["first", "i1", "i2", "i3", "a1", "a2", "a3"]
    lanes = {tag: r.headers["x-millm-lane"] for (tag, _), r in zip(sends, responses, strict=True)}
    assert lanes == {"a1": "agent", "a2": "agent", "a3": "agent", "i1": "interactive", "i2": "interactive", "i3": "interactive"}
    assert responses[1].json()["model"] == "tiny"  # the suffix names the lane, not another model


def test_an_agent_request_is_never_starved(gated: Any) -> None:
    srv, gate, finished = gated
    srv.app.state.millm.scheduler.lane_passes = 2
    sends = [("a1", {"class": "agent"}), ("i1", {}), ("i2", {}), ("i3", {}), ("i4", {})]
    queue_behind_a_running_request(srv, gate, sends)
    assert finished.order == ["first", "i1", "i2", "a1", "i3", "i4"]  # two passes, then its arrival place


def test_lane_refusals(make_server: Any) -> None:
    with make_server() as srv:
        unknown = post(srv, "x", **{"class": "batch"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "class"
        both = post(srv, "x", **{"class": "interactive", "model": "tiny@agent"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "class"
        plain = post(srv, "x")
        assert plain.status_code == 200 and plain.headers["x-millm-lane"] == "interactive"
        unknown_model = post(srv, "x", model="nope@agent")
        assert unknown_model.status_code == 404


def test_streams_carry_their_lane(make_server: Any) -> None:
    with make_server() as srv:
        body = {"model": "tiny@agent", "messages": MESSAGES, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200 and resp.headers["x-millm-lane"] == "agent"
            assert any('"tiny"' in line for line in resp.iter_lines())

