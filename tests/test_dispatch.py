"""``dispatch``: a plugin serves a model request through the one request pipeline, from its
own route (with the outer request: a client that leaves cancels the inner work) or from a
background task with no client, and gets back exactly what the chat route answers —
status, headers and body, or the stream's frames — errors included.

The plugin below is what a plugin author would write: a route that takes an envelope
naming the body to dispatch and reports what came back.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import (
    CLIENT_CLOSED,
    Dispatched,
    Problem,
    RequestContext,
    StashKey,
    app_context,
    dispatch,
    hookimpl,
    json_response,
)
from millm_core.config import load_settings
from millm_core.server.app import build_host
from millm_core.server.dispatch import STREAM_BUFFER_FRAMES

from .http.helpers import GatePlugin, json_frames, scheduler_stats, wait_until

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
BACKGROUND = StashKey[dict[str, "asyncio.Task[Dispatched]"]]("test.background")


async def _report(reply: Dispatched, close_after: int | None, envelope: dict[str, Any] | None = None, scheduler: Any = None) -> dict[str, Any]:
    envelope = envelope or {}
    out: dict[str, Any] = {"status": reply.status, "headers": dict(reply.headers), "request_id": reply.request_id}
    out["ignored_fields"] = list(reply.ignored_fields)
    if not reply.streaming:
        out["body"] = reply.json() if reply.body else None
        return out
    if envelope.get("idle"):  # read nothing until the generation is over (it goes on meanwhile)
        deadline = time.monotonic() + float(envelope["idle"])
        await asyncio.sleep(0.2)
        while time.monotonic() < deadline and scheduler is not None and scheduler.stats.active_rows:
            await asyncio.sleep(0.05)
        out["buffered"] = reply._stream.buffered  # type: ignore[union-attr]
    events = []
    async with reply:
        async for event in reply.events():
            events.append(event)
            if close_after is not None and len(events) >= close_after:
                break
        if envelope.get("read_twice"):  # once it has ended (or was closed), a stream yields nothing more (it never waits)
            await reply.aclose()
            out["again"] = [e async for e in _within(reply.events(), 5)]
    out["events"], out["finished"] = events, reply.finished
    return out


async def _within(events: Any, seconds: float) -> Any:
    iterator = events.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), seconds)
        except StopAsyncIteration:
            return


class DispatchPlugin:
    """``POST /test/dispatch``: dispatch ``envelope["body"]`` (or the raw text
    ``envelope["raw"]``) on chat from this route; ``POST /test/background`` starts it in a
    background task with the AppContext alone, ``GET /test/background/{key}`` reads it."""

    @staticmethod
    def _args(envelope: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        body = envelope["raw"].encode() if "raw" in envelope else envelope["body"]
        renames: dict[str, str] = envelope.get("rename") or {}
        rename: Callable[[str], str] | None = (lambda p: renames.get(p, p)) if renames else None
        kwargs = {"headers": envelope.get("headers"), "reported": envelope.get("reported", ()), "rename": rename}
        return body, kwargs

    def __init__(self) -> None:
        self.statuses: list[int] = []  # every dispatched reply's status, in order

    async def run(self, request: Request) -> Response:
        envelope = json.loads(await request.body())
        body, kwargs = self._args(envelope)
        reply = await dispatch(request, envelope.get("endpoint", "chat.completions"), body, **kwargs)
        self.statuses.append(reply.status)
        if envelope.get("drop"):  # dropped unread
            status = reply.status
            del reply
            return json_response({"status": status})
        return json_response(await _report(reply, envelope.get("close_after"), envelope, request.app.state.millm.scheduler))

    async def start(self, request: Request) -> Response:
        envelope = json.loads(await request.body())
        body, kwargs = self._args(envelope)
        app = app_context(request)
        tasks = app.stash.setdefault(BACKGROUND, dict)
        tasks[envelope["key"]] = asyncio.ensure_future(dispatch(app, "chat.completions", body, **kwargs))
        return json_response({"started": envelope["key"]}, status=202)

    async def result(self, request: Request) -> Response:
        task = app_context(request).stash[BACKGROUND][request.path_params["key"]]
        return json_response(await _report(await asyncio.shield(task), None))

    @hookimpl
    def millm_register_routes(self, register: Callable[..., None]) -> None:
        register("/test/dispatch", self.run, ["POST"])
        register("/test/background", self.start, ["POST"])
        register("/test/background/{key}", self.result, ["GET"])


class CrashPlugin:
    """A plugin that fails unexpectedly (not a MillmError) when asked to."""

    @hookimpl
    def millm_validate(self, ctx: RequestContext, request: Any) -> list[Problem]:
        if ctx.headers.get("x-test-crash"):
            raise RuntimeError("this plugin failed on purpose")
        return []


@pytest.fixture(scope="module")
def dispatch_server(make_server):  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(DispatchPlugin(), "dispatch-test")
    host.register(CrashPlugin(), "crash-test")
    with make_server(host=host) as srv:
        yield srv


def _dispatched(server: Any, path: str = "/test/dispatch", **envelope: Any) -> dict[str, Any]:
    resp = httpx.post(server.base_url + path, json=envelope, timeout=60)
    assert resp.status_code in (200, 202), resp.text
    return dict(resp.json())


def _route(server: Any, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.base_url + "/v1/chat/completions", content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=60)


def _millm(headers: dict[str, str] | httpx.Headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-millm-")}


def _without_ids(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def test_a_dispatched_chat_is_the_routes_reply(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    body = {**CHAT, "user": "me", "messages": [{**MESSAGES[0], "name": "ann"}]}
    route = _route(dispatch_server, body)
    got = _dispatched(dispatch_server, body=body)
    assert route.status_code == got["status"] == 200
    assert _without_ids(got["body"]) == _without_ids(route.json())
    assert got["body"]["id"] != route.json()["id"]
    assert _millm(got["headers"]) == _millm(route.headers)
    assert _millm(got["headers"])["x-millm-ignored-fields"] == '"user", "messages[0].name"'
    assert got["ignored_fields"] == ["user", "messages[0].name"]
    assert got["request_id"] != route.headers["x-request-id"]


def test_the_inner_request_takes_the_outer_request_id_or_its_own(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(dispatch_server.base_url + "/test/dispatch", json={"body": CHAT}, headers={"X-Request-Id": "outer-1"}, timeout=60)
    assert resp.json()["request_id"] == "outer-1" == resp.headers["x-request-id"]
    _dispatched(dispatch_server, "/test/background", body=CHAT, key="ids")
    background = httpx.get(dispatch_server.base_url + "/test/background/ids", timeout=60).json()
    assert background["request_id"].startswith("req_")


def test_a_dispatched_stream_yields_the_routes_frames(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    body = {**CHAT, "stream": True}
    frames = json_frames(_route(dispatch_server, body).content)
    got = _dispatched(dispatch_server, body=body)
    assert got["status"] == 200 and got["finished"] is True
    assert got["headers"]["content-type"].startswith("text/event-stream")
    assert [_without_ids(e) for e in got["events"]] == [_without_ids(f) for f in frames]
    assert frames[-1]["choices"] == [] and "millm_steering" in frames[-1]  # the closing extension chunk comes too


@pytest.mark.parametrize(
    ("endpoint", "path", "body"),
    [
        ("completions", "/v1/completions", {"model": "tiny", "prompt": "The sea", "max_tokens": 6, "temperature": 0}),
        ("completions", "/v1/completions", {"model": "tiny", "prompt": "The sea", "max_tokens": 1, "logprobs": 3}),  # scoring: a computed reply
        ("embeddings", "/v1/embeddings", {"model": "tiny", "input": ["the sea", "a wave"]}),
    ],
    ids=["completion", "scored completion", "embeddings"],
)
def test_every_model_endpoint_can_be_dispatched(dispatch_server, endpoint: str, path: str, body: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    route = httpx.post(dispatch_server.base_url + path, json=body, timeout=60)
    got = _dispatched(dispatch_server, endpoint=endpoint, body=body)
    assert route.status_code == got["status"] == 200, route.text
    assert _without_ids(got["body"]) == _without_ids(route.json())
    assert _millm(got["headers"]) == _millm(route.headers)


BAD_BODIES: list[tuple[str, Any, dict[str, str] | None]] = [
    ("invalid JSON", '{"model": "tiny", "messages": [', None),
    ("not an object", "[1, 2]", None),
    ("unknown model", {**CHAT, "model": "nope"}, None),
    ("out of range", {**CHAT, "temperature": 7}, None),
    ("missing messages", {"model": "tiny"}, None),
    ("bad message value", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, None),
    ("context too long", {**CHAT, "max_tokens": 10**6}, None),
    ("known field nothing honours", {**CHAT, "logit_bias": {"5": 3}}, None),
    ("a plugin's problem", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, None),
    ("stream with n", {**CHAT, "stream": True, "n": 2}, None),
    ("strict mode", {**CHAT, "user": "me"}, {"X-miLLM-Strict": "true"}),
    ("bad strict header", CHAT, {"X-miLLM-Strict": "maybe"}),
    ("an unexpected failure", CHAT, {"X-Test-Crash": "1"}),
]


@pytest.mark.parametrize(("case", "body", "headers"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
def test_every_error_is_the_routes_error(dispatch_server, case: str, body: Any, headers: dict[str, str] | None) -> None:  # type: ignore[no-untyped-def]
    route = _route(dispatch_server, body, headers)
    envelope = {"raw": body} if isinstance(body, str) else {"body": body}
    got = _dispatched(dispatch_server, **envelope, headers=headers)
    assert route.status_code >= 400, route.text
    assert (got["status"], got["body"]) == (route.status_code, route.json())
    assert set(got["body"]["error"]) == {"message", "type", "param", "code"}


def test_a_503_comes_back_with_retry_after(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(DispatchPlugin(), "dispatch-test")
    gate = GatePlugin()
    host.register(gate, "gate")
    with make_server(host=host, max_queue=1) as srv:
        _dispatched(srv, "/test/background", body={**CHAT, "max_tokens": 2}, key="running")
        assert wait_until(lambda: scheduler_stats(srv.base_url)["running_jobs"] == 1)
        _dispatched(srv, "/test/background", body={**CHAT, "max_tokens": 2}, key="waiting")
        assert wait_until(lambda: scheduler_stats(srv.base_url)["queued"] == 1)
        refused = _dispatched(srv, body=CHAT)
        gate.gate.set()
        assert refused["status"] == 503 and refused["body"]["error"]["code"] == "queue_full"
        assert int(refused["headers"]["retry-after"]) >= 1
        for key in ("running", "waiting"):  # the background requests ran, with no client
            done = httpx.get(srv.base_url + f"/test/background/{key}", timeout=60).json()
            assert done["status"] == 200 and done["body"]["usage"]["completion_tokens"] == 2


def test_reported_fields_and_renamed_locations(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    rename = {"messages[0].name": "input[0].name", "temperature": "heat"}
    body = {**CHAT, "zzz": 1, "messages": [{**MESSAGES[0], "name": "ann"}]}
    got = _dispatched(dispatch_server, body=body, reported=["text.verbosity"], rename=rename)
    assert got["headers"]["x-millm-ignored-fields"] == '"text.verbosity", "zzz", "input[0].name"'
    strict = _dispatched(dispatch_server, body=body, reported=["text.verbosity"], rename=rename, headers={"X-miLLM-Strict": "1"})
    assert strict["status"] == 400 and strict["body"]["error"]["code"] == "unused_fields_refused"
    assert strict["body"]["error"]["param"] == "text.verbosity"
    bad = _dispatched(dispatch_server, body={**CHAT, "temperature": 9}, rename=rename)
    assert bad["status"] == 400 and bad["body"]["error"]["param"] == "heat"


def _slow_server(make_server, plugin: DispatchPlugin | None = None):  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(plugin or DispatchPlugin(), "dispatch-test")
    slow = GatePlugin(delay=0.02)  # 20 ms a token: 400 tokens would take 8 s
    slow.gate.set()
    host.register(slow, "slow")
    return make_server(host=host)


def test_a_client_leaving_the_outer_route_cancels_the_inner_request(make_server) -> None:  # type: ignore[no-untyped-def]
    plugin = DispatchPlugin()
    with _slow_server(make_server, plugin) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        envelope = json.dumps({"body": {**CHAT, "max_tokens": 400}}).encode()
        request = (
            b"POST /test/dispatch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(envelope)}\r\n\r\n".encode() + envelope
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request)
            assert wait_until(lambda: scheduler_stats(srv.base_url)["active_rows"] == 1)
        # The outer client is gone: the inner request's row is freed at its next step.
        assert wait_until(lambda: scheduler_stats(srv.base_url)["cancelled_rows"] == 1)
        stats = scheduler_stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["generated_tokens"] < 200
        assert wait_until(lambda: plugin.statuses == [CLIENT_CLOSED])  # the reply the plugin got: 499, no body
        assert CLIENT_CLOSED == 499


def test_closing_a_dispatched_stream_frees_its_rows(make_server) -> None:  # type: ignore[no-untyped-def]
    with _slow_server(make_server) as srv:
        started = time.monotonic()
        got = _dispatched(srv, body={**CHAT, "max_tokens": 400, "stream": True}, close_after=4)
        assert len(got["events"]) == 4 and got["finished"] is False
        assert wait_until(lambda: scheduler_stats(srv.base_url)["cancelled_rows"] == 1)
        stats = scheduler_stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["generated_tokens"] < 200
        assert time.monotonic() - started < 8  # long before 400 tokens at 20 ms each


def test_a_dispatched_stream_dropped_unread_frees_its_rows(make_server) -> None:  # type: ignore[no-untyped-def]
    with _slow_server(make_server) as srv:
        assert _dispatched(srv, body={**CHAT, "max_tokens": 400, "stream": True}, drop=True) == {"status": 200}
        assert wait_until(lambda: scheduler_stats(srv.base_url)["cancelled_rows"] == 1)
        assert scheduler_stats(srv.base_url)["generated_tokens"] < 200


def test_a_dispatched_stream_holds_a_bounded_buffer_and_loses_nothing(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    body = {**CHAT, "max_tokens": 200, "stream": True}
    got = _dispatched(dispatch_server, body=body, idle=30)
    # The whole stream was generated while nobody read: at most the buffer's frames waited.
    assert 0 < got["buffered"] <= STREAM_BUFFER_FRAMES
    assert got["finished"] is True and len(got["events"]) > STREAM_BUFFER_FRAMES
    whole = _dispatched(dispatch_server, body=body)
    assert [_without_ids(e) for e in got["events"]] == [_without_ids(e) for e in whole["events"]]


def test_a_stream_read_again_after_its_end_yields_nothing(dispatch_server) -> None:  # type: ignore[no-untyped-def]
    got = _dispatched(dispatch_server, body={**CHAT, "stream": True}, read_twice=True)
    assert got["finished"] is True and got["events"] and got["again"] == []
    closed = _dispatched(dispatch_server, body={**CHAT, "max_tokens": 40, "stream": True}, close_after=2, read_twice=True)
    assert len(closed["events"]) == 2 and closed["again"] == []
