"""The events log: every result of a monitored generation is kept (the very results the
response carried), read by request, probe or trace, a page at a time, newest first, one by
its id; retention keeps the newest; a stream the client left is recorded as
``interrupted``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .helpers import HELD_CODE, HELD_SEA, JSON, Fitted, arm, chat, import_probe, ok, user


@pytest.fixture(scope="module")
def logged(make_server: Any, fitted: Fitted) -> Iterator[Any]:
    with make_server() as srv:
        import_probe(srv, fitted.document("sea", probe_id="sea"))
        import_probe(srv, fitted.document("tide", probe_id="tide", decision={"threshold": 0.9}))
        ok(arm(srv, "sea", windows=["prompt", "response"]))
        ok(arm(srv, "tide", windows=["last_user"]))
        yield srv


def events(srv: Any, **params: Any) -> dict[str, Any]:
    return dict(ok(httpx.get(srv.base_url + "/api/probes/events", params=params)))


def test_a_requests_results_are_its_events(logged: Any) -> None:
    rid = "req-" + uuid.uuid4().hex
    body = {"model": "tiny", "messages": user(HELD_SEA[0]), "max_tokens": 4, "temperature": 0}
    resp = httpx.post(logged.base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
    verdicts = resp.json()["millm_probe_verdicts"]
    got = events(logged, request_id=rid)
    assert got["total"] == len(verdicts) == 3
    assert sorted(got["data"], key=lambda r: r["result_id"]) == sorted(verdicts, key=lambda r: r["result_id"])
    one = ok(httpx.get(f"{logged.base_url}/api/probes/events/{verdicts[0]['result_id']}"))
    assert one == verdicts[0]
    assert httpx.get(logged.base_url + "/api/probes/events/pr_nope").status_code == 404
    by_trace = events(logged, trace_id=verdicts[0]["trace_id"])
    assert by_trace["total"] == 3


def test_filters_pages_and_order(logged: Any) -> None:
    before = events(logged, probe_id="tide")["total"]
    ids = []
    for text in (HELD_CODE[0], HELD_SEA[1], HELD_CODE[2]):
        ids.append(chat(logged, user(text)).headers["x-request-id"])
    tide = events(logged, probe_id="tide", limit=2)
    assert tide["total"] == before + 3 and len(tide["data"]) == 2 and tide["limit"] == 2
    assert [r["served"]["request_id"] for r in tide["data"]] == [ids[2], ids[1]]  # newest first
    assert [r["served"]["request_id"] for r in events(logged, probe_id="tide", limit=2, offset=1)["data"]] == [ids[1], ids[0]]
    assert all(r["probe"]["id"] == "tide" and r["window"] == "last_user" for r in tide["data"])
    assert events(logged, probe_id="sea", request_id=ids[0])["total"] == 2
    for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"offset": -1}, "offset")):
        resp = httpx.get(logged.base_url + "/api/probes/events", params=params)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_retention_keeps_the_newest(make_server: Any, fitted: Fitted) -> None:
    with make_server(probes_events_max=4) as srv:
        import_probe(srv, fitted.document(probe_id="sea"))
        ok(arm(srv, "sea", windows=["prompt", "last_user", "all"]))
        last = ""
        for text in HELD_SEA:
            last = chat(srv, user(text)).headers["x-request-id"]
        kept = events(srv)
        assert kept["total"] == 4
        assert {r["served"]["request_id"] for r in kept["data"][:3]} == {last}


def test_an_interrupted_stream_is_in_the_events_log(logged: Any) -> None:
    body = {"model": "tiny", "messages": user(HELD_SEA[0]), "max_tokens": 400, "temperature": 0}
    full = httpx.post(logged.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert full["choices"][0]["finish_reason"] == "length"  # it would run on: leaving early cuts it short
    rid = "req-" + uuid.uuid4().hex
    received = 0
    with httpx.stream(
        "POST", logged.base_url + "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Request-Id": rid}, timeout=120
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                received += 1
                if received == 2:
                    break  # leave: the connection closes with the block
    deadline = time.monotonic() + 30
    while (got := events(logged, request_id=rid))["total"] < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got["total"] == 3
    prompt_len = full["usage"]["prompt_tokens"]
    for result in got["data"]:
        assert (result["outcome"], result["reason"]) == ("interrupted", "stream_ended_early"), result
        assert result["served"]["stream"] is True
    window = {r["window"]: r for r in got["data"]}
    assert window["prompt"]["score"] is not None and window["prompt"]["verdict"] == "flagged"  # the prompt was read in full
    assert window["response"]["served"]["positions"]["end"] < prompt_len + 399  # cut short
    assert not any(r["scored"] for r in got["data"])


def test_nothing_is_logged_without_an_armed_probe(make_server: Any) -> None:
    with make_server() as srv:
        chat(srv, user(HELD_SEA[0]))
        assert events(srv)["total"] == 0
        assert httpx.get(srv.base_url + "/api/probes", headers=JSON).json()["data"] == []
