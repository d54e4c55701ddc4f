"""Two real servers on one SQLite file, and requests that never read the database.

- A write on one server is seen by the other: its management routes at once, its requests
  within a refresh interval (``REFRESH_S``), with the same report and the same text.
- Writes on both servers compose: each is computed from the database's state, never from a
  server's stale copy, so neither server overwrites the other's attachments, manual values
  or profiles; a write that conflicts with the other server's is refused as it would be on
  one server. The epoch is shared and only goes up.
- Deciding a request's steering (inline, ``profile``, the active profile) reads the
  server's snapshot: no SQL statement runs on the event loop while requests are served.
"""

from __future__ import annotations

import pathlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from millm_plugins.steering.registry import REFRESH_S

from .test_inline import chat, parse, spec_hash
from .test_profiles import FEATURES, features, text
from .test_sae_api import JSON, write_sae

SEEN_WITHIN_S = 5.0  # generous next to REFRESH_S: two shared cores run the servers and the model


@pytest.fixture(scope="module")
def saes(tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("shared-saes")
    return {name: write_sae(folder / name, tiny_engine.info.d_model, seed=len(name)) for name in ("alpha", "beta")}


@pytest.fixture
def pair(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> Iterator[tuple[Any, Any]]:  # type: ignore[no-untyped-def]
    """Two servers on one database file, both SAEs registered (through the first)."""
    db = str(tmp_path / "shared.db")
    with make_server(db=db) as a, make_server(db=db) as b:
        for name, path in saes.items():
            ok(httpx.post(a.base_url + "/api/saes", json={"path": path, "id": name}), 201)
        yield a, b


def ok(resp: httpx.Response, status: int = 200) -> httpx.Response:
    assert resp.status_code == status, resp.text
    return resp


def live(srv: Any) -> dict[str, Any]:
    return dict(ok(httpx.get(srv.base_url + "/api/steering")).json())


def kinds(resp: httpx.Response) -> list[str]:
    return [kind for kind, _ in parse(resp.headers["x-millm-steering"])]


def eventually(srv: Any, check: Any, **extra: Any) -> httpx.Response:
    """The first chat on ``srv`` whose response passes ``check``, within SEEN_WITHIN_S."""
    deadline = time.monotonic() + SEEN_WITHIN_S
    while True:
        resp = chat(srv, **extra)
        if check(resp):
            return resp
        assert time.monotonic() < deadline, f"never seen: {resp.status_code} {resp.headers.get('x-millm-steering')} {resp.text[:200]}"
        time.sleep(REFRESH_S)


def test_a_write_on_one_server_is_seen_by_the_other(pair: tuple[Any, Any]) -> None:
    a, b = pair
    assert chat(b).headers["x-millm-steering"] == "none"
    ok(httpx.post(a.base_url + "/api/saes/alpha/attach", json={"layer": 1}))
    ok(httpx.put(a.base_url + "/api/steering", json={"sae_id": "alpha", "features": features(FEATURES)}))
    # A request that ran while a's own poll of the database moved its epoch says "changed".
    on_a = eventually(a, lambda r: kinds(r) == ["manual"] and "changed" not in r.headers["x-millm-steering"])
    [(kind, params)] = parse(on_a.headers["x-millm-steering"])
    assert (kind, params["hash"]) == ("manual", spec_hash("alpha", FEATURES))
    # The other server's management routes answer with the database's state at once …
    assert {**live(b), "steering": None} == {**live(a), "steering": None}
    assert live(b)["steering"] == live(a)["steering"]
    # … and its requests run with it as soon as it has looked (every REFRESH_S).
    on_b = eventually(b, lambda r: kinds(r) == ["manual"] and "changed" not in r.headers["x-millm-steering"])
    assert on_b.headers["x-millm-steering"] == on_a.headers["x-millm-steering"]
    assert text(on_b) == text(on_a)
    # Clearing on the second server reaches the first the same way.
    ok(httpx.delete(b.base_url + "/api/steering", headers=JSON))
    assert live(a)["manual"] == []
    assert eventually(a, lambda r: kinds(r) == ["none"]).status_code == 200


def test_profiles_written_on_one_server_serve_requests_on_the_other(pair: tuple[Any, Any]) -> None:
    a, b = pair
    ok(httpx.post(a.base_url + "/api/saes/alpha/attach", json={"layer": 1}))
    ok(httpx.post(a.base_url + "/api/profiles", json={"name": "calm", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)}), 201)
    assert [p["name"] for p in ok(httpx.get(b.base_url + "/api/profiles")).json()["data"]] == ["calm"]
    on_a = chat(a, profile="calm")
    on_b = eventually(b, lambda r: r.status_code == 200, profile="calm")
    assert on_b.headers["x-millm-steering"] == on_a.headers["x-millm-steering"]
    assert parse(on_b.headers["x-millm-steering"])[0][1]["source"] == "request"
    assert text(on_b) == text(on_a)
    # Activated on the second server: plain requests on the first run with it.
    ok(httpx.post(b.base_url + "/api/profiles/calm/activate", json={}))
    active = eventually(a, lambda r: kinds(r) == ["profile"])
    assert parse(active.headers["x-millm-steering"])[0][1]["source"] == "active"
    # Deleted on the first: the second refuses the name, and its plain requests stop.
    ok(httpx.delete(a.base_url + "/api/profiles/calm", headers=JSON))
    gone = eventually(b, lambda r: r.status_code == 404, profile="calm")
    assert gone.json()["error"]["code"] == "profile_not_found"
    assert chat(b).headers["x-millm-steering"] == "none"
    assert live(b)["active_profile"] is None


def test_writes_on_both_servers_compose_instead_of_overwriting(pair: tuple[Any, Any], make_server, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    epochs = [live(a)["epoch"]]
    # Each write goes to the server that did not make the previous one, at once: neither
    # waits for the other to have looked.
    writes = [
        (a, "POST", "/api/saes/alpha/attach", {"layer": 1}),
        (b, "POST", "/api/saes/beta/attach", {"layer": 0}),
        (a, "PUT", "/api/steering", {"sae_id": "alpha", "features": features([(3, 6.0)])}),
        (b, "PUT", "/api/steering", {"sae_id": "beta", "features": features([(5, -2.0)])}),
        (a, "POST", "/api/profiles", {"name": "p", "sae_id": "alpha", "layer": 1, "features": features([(7, 1.0)])}),
        (b, "POST", "/api/profiles", {"name": "q", "sae_id": "beta", "layer": 0, "features": features([(9, 1.0)])}),
    ]
    for srv, method, path, body in writes:
        resp = httpx.request(method, srv.base_url + path, json=body)
        assert resp.status_code in (200, 201), resp.text
        epochs.append(live(srv)["epoch"])
    assert epochs == sorted(epochs) and epochs[4] > epochs[0]  # shared, and only up
    want = {
        "attached": [["alpha", 1], ["beta", 0]],
        "manual": [
            {"sae_id": "alpha", "layer": 1, "features": features([(3, 6.0)])},
            {"sae_id": "beta", "layer": 0, "features": features([(5, -2.0)])},
        ],
    }
    for srv in (a, b):
        state = live(srv)
        assert {k: state[k] for k in want} == want
        assert [p["name"] for p in ok(httpx.get(srv.base_url + "/api/profiles")).json()["data"]] == ["p", "q"]
    assert live(a)["epoch"] == live(b)["epoch"]
    both = eventually(b, lambda r: kinds(r) == ["manual", "manual"])
    assert [(k, p["sae"]) for k, p in parse(both.headers["x-millm-steering"])] == [("manual", "beta"), ("manual", "alpha")]
    db = str(tmp_path / "shared.db")
    stored = sqlite3.connect(db)
    try:
        assert stored.execute("SELECT sae_id, layer FROM attachments ORDER BY position").fetchall() == [("alpha", 1), ("beta", 0)]
        assert [name for (name,) in stored.execute("SELECT name FROM profiles ORDER BY name")] == ["p", "q"]
    finally:
        stored.close()


def test_a_write_that_conflicts_with_the_other_servers_is_refused(pair: tuple[Any, Any]) -> None:
    """Checked against the database inside the write, never against a stale copy: the
    same refusals as on one server, however soon after the other server's write."""
    a, b = pair
    ok(httpx.post(a.base_url + "/api/saes/alpha/attach", json={"layer": 1}))
    for round_ in range(3):  # at once each time: the refresh has had no time to run
        name = f"same{round_}"
        profile = {"name": name, "sae_id": "alpha", "layer": 1, "features": features([(3, 1.0)])}
        ok(httpx.post(a.base_url + "/api/profiles", json=profile), 201)
        clash = httpx.post(b.base_url + "/api/profiles", json={**profile, "features": features([(4, 2.0)])})
        assert (clash.status_code, clash.json()["error"]["code"]) == (409, "profile_exists")
        assert ok(httpx.get(a.base_url + f"/api/profiles/{name}")).json()["features"] == features([(3, 1.0)])
    ok(httpx.post(b.base_url + "/api/saes/alpha/detach", json={}))
    stale = httpx.put(a.base_url + "/api/steering", json={"sae_id": "alpha", "layer": 1, "features": features([(3, 6.0)])})
    assert (stale.status_code, stale.json()["error"]["code"]) == (400, "sae_not_attached")
    assert (live(a)["attached"], live(a)["manual"]) == ([], [])


def test_requests_never_run_sql_on_the_event_loop(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """Every statement the server's database connections run is recorded with its thread:
    none runs on the event loop's thread while steered requests of every kind are served
    (a request with ``profile`` used to read the profile from SQLite there)."""
    with make_server(db=str(tmp_path / "millm.db")) as srv:
        api = srv.base_url
        ok(httpx.post(api + "/api/saes", json={"path": saes["alpha"], "id": "alpha"}), 201)
        ok(httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}))
        ok(httpx.post(api + "/api/profiles", json={"name": "p", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)}), 201)
        ok(httpx.post(api + "/api/profiles", json={"name": "q", "sae_id": "alpha", "layer": 1, "features": features([(5, 2.0)])}), 201)
        ok(httpx.post(api + "/api/profiles/q/activate", json={}))
        store = srv.app.state.millm.app.store
        connections = {store._conn, store._reader}
        seen: list[tuple[str, str]] = []
        for conn in connections:
            conn.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
        try:
            for extra in (
                {"profile": "p"},
                {},
                {"steering": {"features": features([(2, 3.0)])}},
                {"profile": "p", "steering_intensity": 0.5},
            ):
                resp = chat(srv, **extra)
                assert resp.status_code == 200 and resp.headers["x-millm-steering"] != "none", resp.text
            missing = chat(srv, profile="nope")
            assert (missing.status_code, missing.json()["error"]["code"]) == (404, "profile_not_found")
            for path in ("/api/steering", "/api/profiles", "/api/profiles/active"):
                ok(httpx.get(api + path))
            time.sleep(3 * REFRESH_S)  # the watcher looks for other servers' writes meanwhile
        finally:
            for conn in connections:
                conn.set_trace_callback(None)
        assert seen, "the trace recorded nothing: it does not measure anything"
        on_loop = [sql for thread, sql in seen if thread == "millm-test-server"]
        assert on_loop == []
