"""Model lifecycle over HTTP, on a real server and the tiny model: the catalogue
(``GET /api/models``), loading and unloading (a request in flight finishes while a new one
is told ``model_busy``), the ``millm_model_unloaded`` hook, load failures, and the lock."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from millm_core.api import AppContext, ServedModel, hookimpl
from millm_core.testing import RunningServer
from millm_plugins.steering.api import state_of as steering_state

from .lifecycle_kit import CHAT, Gate, entries, make_roots, post, serve_roots, wait_for_state


class FailingUnloaded:
    @hookimpl
    def millm_model_unloaded(self, app: AppContext, model: ServedModel) -> None:
        raise RuntimeError("must not keep the other plugins from hearing of the unload")


@pytest.fixture
def roots(tmp_path: Any, tiny_dir: str, tiny_dir_no_template: str) -> str:
    return make_roots(tmp_path, tiny_dir, tiny_dir_no_template)


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def srv(roots: str, gate: Gate) -> Iterator[RunningServer]:
    with serve_roots(roots, FailingUnloaded(), gate) as server:
        yield server


def test_the_catalogue_lists_what_the_roots_and_plugins_offer(srv: RunningServer) -> None:
    listed_entries = entries(srv)
    assert listed_entries["tiny"] == {
        "id": "tiny",
        "object": "model",
        "engine": "transformers",
        "state": "available",
        "locked": False,
        "source": "directory",
    }
    assert listed_entries["tiny-no-template"]["state"] == "available"
    assert "notes.txt" not in listed_entries
    # A model-source plugin's models are listed without being materialised (no engine known yet).
    assert all(e["engine"] is None for e in listed_entries.values() if e["source"] == "plugin")
    # OpenAI clients see every model a request may name (a request loads it), by its state.
    listed = httpx.get(srv.base_url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == list(listed_entries)
    assert {m["millm"]["state"] for m in listed} == {"available"}
    assert next(m for m in listed if m["id"] == "tiny")["millm"]["engine"] == "transformers"
    assert httpx.get(srv.base_url + "/v1/models/tiny-b").json()["millm"]["state"] == "available"


def test_load_serve_unload_with_a_request_in_flight(srv: RunningServer, gate: Gate) -> None:
    loaded = post(srv, "/api/models/tiny/load")
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["state"] == "loaded" and loaded.json()["engine"] == "transformers"
    assert post(srv, "/api/models/tiny/load").json()["state"] == "loaded"  # loading a loaded model changes nothing
    listed = httpx.get(srv.base_url + "/v1/models").json()["data"]
    assert listed[0]["id"] == "tiny" and listed[0]["millm"]["state"] == "loaded" and listed[0]["millm"]["d_model"] == 64
    assert all(m["millm"]["state"] == "available" for m in listed[1:])
    assert httpx.get(srv.base_url + "/api/health/ready").status_code == 200
    assert gate.events == ["loaded:tiny:0"]  # the hook ran before the model joined app.models
    context = srv.app.state.millm.app  # type: ignore[attr-defined]
    steering = steering_state(context).model  # the steering plugin checks its attachments against it
    assert steering is not None and steering.info.served_name == "tiny"

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 4}, headers={"X-Gate": "1"})
        assert gate.entered.wait(30)  # the request is on the model thread
        unloading = pool.submit(post, srv, "/api/models/tiny/unload")
        wait_for_state(srv, "tiny", "unloading")
        assert entries(srv)["tiny"]["state"] == "unloading"
        busy = post(srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 1})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_busy"
        assert int(busy.headers["retry-after"]) >= 1
        streamed = post(srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 1, "stream": True})
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "model_busy"  # before any stream starts
        again = post(srv, "/api/models/tiny-b/load")
        assert again.status_code == 503 and again.json()["error"]["code"] == "model_busy"
        assert not unloading.done()  # waits for the running request
        gate.opened.set()
        done = running.result(60)
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
        assert done.json()["usage"]["completion_tokens"] == 4
        unloaded = unloading.result(60)
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "available"
    assert gate.events == ["loaded:tiny:0", "unloaded:tiny:0"]  # despite the plugin that raised
    assert steering_state(context).model is None  # steering's model-tied state went with it
    assert {m["millm"]["state"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]} == {"available"}
    missing = post(srv, "/api/models/tiny/unload")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _stream(srv: RunningServer, body: dict[str, Any], frames: int | None = None) -> list[str]:
    """A streamed chat's data lines: all of them, or the first ``frames`` (then the client leaves)."""
    lines: list[str] = []
    with httpx.stream(
        "POST", srv.base_url + "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Gate": "1"}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: ") :])
                if frames is not None and len(lines) >= frames:
                    break
    return lines


def test_streams_hold_an_unload_until_they_end_or_their_client_leaves(srv: RunningServer, gate: Gate) -> None:
    assert post(srv, "/api/models/tiny/load").status_code == 200
    # A client that left after the first frame does not hold the unload back.
    gate.opened.set()
    gate.pause = 0.05  # still generating when its client leaves
    assert len(_stream(srv, {"model": "tiny", **CHAT, "max_tokens": 50}, frames=1)) == 1
    lifecycle = srv.app.state.millm.lifecycle  # type: ignore[attr-defined]
    for _ in range(500):
        if not lifecycle.running:
            break
        time.sleep(0.01)
    assert lifecycle.running == {}  # its count went with it
    gate.pause = 0.0
    gate.opened.clear()
    gate.entered.clear()
    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(_stream, srv, {"model": "tiny", **CHAT, "max_tokens": 3})
        assert gate.entered.wait(30)
        unloading = pool.submit(post, srv, "/api/models/tiny/unload")
        wait_for_state(srv, "tiny", "unloading")
        busy = post(srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 1, "stream": True})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_busy"
        time.sleep(0.2)
        assert not unloading.done()
        gate.opened.set()
        lines = streaming.result(60)
        assert lines[-1] == "[DONE]"
        assert unloading.result(60).json()["state"] == "available"


def test_an_unload_cancels_what_outlasts_its_grace(roots: str) -> None:
    gate = Gate(pause=0.02)
    gate.opened.set()
    with serve_roots(roots, gate, graceful_unload_timeout=0.3) as srv:
        assert post(srv, "/api/models/tiny/load").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 400}, headers={"X-Gate": "1"})
            assert gate.entered.wait(30)
            started = time.monotonic()
            unloaded = post(srv, "/api/models/tiny/unload")
            took = time.monotonic() - started
            cut = running.result(60)
    assert unloaded.status_code == 200 and 0.3 <= took < 5
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["completion_tokens"] < 400


def test_load_failures_are_typed_and_leak_no_path(srv: RunningServer, roots: str) -> None:
    unknown = post(srv, "/api/models/no-such-model/load")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    broken = post(srv, "/api/models/broken/load")
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "model_load_failed"
    assert roots not in broken.text and "broken" in broken.json()["error"]["message"]
    assert entries(srv)["broken"]["state"] == "available"
    plain = httpx.post(srv.base_url + "/api/models/tiny/load", content=b"{}")
    assert plain.status_code == 415  # a write to /api needs a JSON content type
    for path, body in (("load", {"dtype": "float16"}), ("unload", {"force": True}), ("lock", {"x": 1}), ("unlock", {"x": 1})):
        refused = post(srv, f"/api/models/tiny/{path}", body)  # these routes take no fields: refused, not dropped
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, next(iter(body))), refused.text


def test_a_lock_serves_and_lists_one_model(srv: RunningServer) -> None:
    for name in ("tiny", "tiny-no-template"):
        assert post(srv, f"/api/models/{name}/load").status_code == 200
    locked = post(srv, "/api/models/tiny/lock")
    assert locked.status_code == 200 and locked.json()["locked"] is True
    assert [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]] == ["tiny"]
    assert entries(srv)["tiny"]["locked"] is True and entries(srv)["tiny-no-template"]["locked"] is False
    other = post(srv, "/v1/completions", {"model": "tiny-no-template", "prompt": "x", "max_tokens": 1})
    assert other.status_code == 409 and other.json()["error"]["code"] == "model_locked"
    assert post(srv, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200
    for path in ("/api/models/tiny-b/load", "/api/models/tiny/unload", "/api/models/tiny-no-template/lock"):
        refused = post(srv, path)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_locked", path
    assert post(srv, "/api/models/tiny/unlock").json()["locked"] is False
    assert [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]][:2] == ["tiny", "tiny-no-template"]
    assert post(srv, "/v1/completions", {"model": "tiny-no-template", "prompt": "x", "max_tokens": 1}).status_code == 200
