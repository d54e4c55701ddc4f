"""Nothing lost across a restart, and nothing frozen by a locked database, on real servers
over real SQLite files:

- attachments, manual values and the active profile survive a restart: the same plain
  request reports the same ``X-miLLM-Steering`` and produces the same text; the epoch only
  goes up;
- an SAE whose files vanished is listed as unreadable (the list still answers) and can be
  deleted; an attachment that cannot be applied (files gone, or a model that changed) is
  listed with its reason and a request that would need it says ``unknown``;
- a write lock held by another connection gives a fast ``503 database_busy`` with
  ``Retry-After``, changes nothing, and leaves reads and the event loop answering;
- a slow import runs off the event loop.
"""

from __future__ import annotations

import pathlib
import shutil
import sqlite3
import threading
import time
from typing import Any

import httpx
import pytest

from millm_engines.transformers.testing import build_tiny_model, load_tiny_model

from .test_import_kill import PAD_ROWS, write_locked
from .test_inline import chat, parse
from .test_profiles import features, text
from .test_sae_api import JSON, write_sae

UNKNOWN = "unknown;reason=claims_unreadable"


@pytest.fixture(scope="module")
def saes(tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("durable-saes")
    return {name: write_sae(folder / name, tiny_engine.info.d_model, seed=len(name)) for name in ("alpha", "beta")}


def live(srv: Any) -> dict[str, Any]:
    resp = httpx.get(srv.base_url + "/api/steering")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def ok(resp: httpx.Response, status: int = 200) -> httpx.Response:
    assert resp.status_code == status, resp.text
    return resp


def test_attachments_manual_values_and_the_active_profile_survive_a_restart(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        api = first.base_url
        for name, path in saes.items():
            ok(httpx.post(api + "/api/saes", json={"path": path, "id": name}), 201)
        ok(httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}))
        ok(httpx.post(api + "/api/saes/beta/attach", json={"layer": 0}))
        ok(httpx.put(api + "/api/steering", json={"sae_id": "beta", "features": features([(2, 3.0), (7, -1.25)])}))
        ok(httpx.post(api + "/api/profiles", json={"name": "calm", "sae_id": "alpha", "layer": 1, "features": features([(3, 6.0), (17, -4.5)])}), 201)
        ok(httpx.post(api + "/api/profiles/calm/activate", json={}))
        before, plain = live(first), chat(first)
    assert [k for k, _ in parse(plain.headers["x-millm-steering"])] == ["manual", "profile"]  # layer 0, then layer 1

    with make_server(db=db) as second:
        after = live(second)
        assert after["epoch"] > before["epoch"]  # the epoch never goes back
        assert {**after, "epoch": 0} == {**before, "epoch": 0}
        assert after["unusable"] == []
        again = chat(second)
        assert again.headers["x-millm-steering"] == plain.headers["x-millm-steering"]
        assert text(again) == text(plain)
        assert httpx.get(second.base_url + "/api/profiles/active").json()["active"]["name"] == "calm"
        assert [s["attached_layers"] for s in httpx.get(second.base_url + "/api/saes").json()["data"]] == [[1], [0]]
        ok(httpx.delete(second.base_url + "/api/steering", headers=JSON))  # clears the manual values and the active profile
        cleared = live(second)

    with make_server(db=db) as third:
        assert live(third)["epoch"] > cleared["epoch"]
        assert (live(third)["manual"], live(third)["active_profile"], live(third)["attached"]) == ([], None, [["alpha", 1], ["beta", 0]])
        assert chat(third).headers["x-millm-steering"] == "none"


def test_an_sae_whose_files_vanished_is_listed_unreadable_and_can_be_deleted(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    gone = write_sae(tmp_path / "gone", tiny_engine.info.d_model, seed=3)
    kept = write_sae(tmp_path / "kept", tiny_engine.info.d_model, seed=4)
    with make_server(db=db) as first:
        api = first.base_url
        ok(httpx.post(api + "/api/saes", json={"path": gone, "id": "gone"}), 201)
        ok(httpx.post(api + "/api/saes", json={"path": kept, "id": "kept"}), 201)
        ok(httpx.post(api + "/api/saes/gone/attach", json={"layer": 1}))
        ok(httpx.put(api + "/api/steering", json={"sae_id": "gone", "features": features([(3, 6.0)])}))
        assert parse(chat(first).headers["x-millm-steering"])[0][0] == "manual"
    shutil.rmtree(gone)

    with make_server(db=db) as second:
        api = second.base_url
        listed = ok(httpx.get(api + "/api/saes")).json()["data"]
        by_id = {s["id"]: s for s in listed}
        assert by_id["kept"]["status"] == "ok" and by_id["kept"]["d_sae"] == 48
        assert by_id["gone"]["status"] == "unreadable" and gone in by_id["gone"]["reason"]
        assert (by_id["gone"]["d_in"], by_id["gone"]["attached_layers"]) == (None, [1])
        assert ok(httpx.get(api + "/api/saes/gone")).json() == by_id["gone"]
        state = live(second)
        assert state["attached"] == [["gone", 1]] and state["manual"][0]["sae_id"] == "gone"  # kept, not dropped
        [unusable] = state["unusable"]
        assert (unusable["sae_id"], unusable["layer"], unusable["reason"]) == ("gone", 1, "sae_unreadable")
        assert state["steering"] == UNKNOWN
        # A request that would need it says so, and runs without it.
        plain, unsteered = chat(second), chat(second, steering={"features": []})
        assert plain.headers["x-millm-steering"] == UNKNOWN and unsteered.headers["x-millm-steering"] == "none"
        assert text(plain) == text(unsteered)
        assert chat(second, steering={"features": features([(1, 2.0)])}).headers["x-millm-steering"] == UNKNOWN
        refused = httpx.post(api + "/api/saes/gone/attach", json={"layer": 1})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_sae")  # attaching reads the files again
        # Writes and reads that need the attachment are the 409 it is listed with, never a file error.
        for needs in (
            httpx.put(api + "/api/steering", json={"sae_id": "gone", "layer": 1, "features": features([(3, 1.0)])}),
            httpx.put(api + "/api/steering", json={"sae_id": "gone", "features": []}),
            httpx.post(api + "/api/saes/gone/features", json={"text": "The sea", "layer": 1}),
        ):
            error = needs.json()["error"]
            assert (needs.status_code, error["code"], error["param"]) == (409, "attachment_unusable", "layer"), needs.text
            assert "sae_unreadable" in error["message"]
        assert live(second)["manual"] == state["manual"]
        # It can be deleted; everything bound to it goes with it.
        ok(httpx.delete(api + "/api/saes/gone", headers=JSON))
        assert [s["id"] for s in ok(httpx.get(api + "/api/saes")).json()["data"]] == ["kept"]
        state = live(second)
        assert (state["attached"], state["manual"], state["unusable"], state["steering"]) == ([], [], [], "none")
        assert chat(second).headers["x-millm-steering"] == "none"


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_tiny_model(str(tmp_path_factory.mktemp("one-layer")), layers=1)
    return load_tiny_model(path, served_name="tiny")


def test_attachments_a_changed_model_cannot_take_are_reported_not_applied(make_server, saes: dict[str, str], one_layer_model: Any, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        api = first.base_url
        ok(httpx.post(api + "/api/saes", json={"path": saes["alpha"], "id": "alpha"}), 201)
        ok(httpx.post(api + "/api/saes/alpha/attach", json={"layer": 0}))
        ok(httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}))
        ok(httpx.put(api + "/api/steering", json={"sae_id": "alpha", "layer": 1, "features": features([(3, 6.0)])}))

    with make_server(db=db, models=[one_layer_model]) as second:  # the model now has one layer
        api = second.base_url
        state = live(second)
        assert state["attached"] == [["alpha", 0], ["alpha", 1]]
        assert [(u["sae_id"], u["layer"], u["reason"]) for u in state["unusable"]] == [("alpha", 1, "layer_out_of_range")]
        assert state["steering"] == UNKNOWN and chat(second).headers["x-millm-steering"] == UNKNOWN
        refused = httpx.put(api + "/api/steering", json={"sae_id": "alpha", "layer": 1, "features": features([(4, 1.0)])})
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "attachment_unusable")
        # Detaching it clears the report; the attachment that still fits works as before.
        ok(httpx.post(api + "/api/saes/alpha/detach", json={"layer": 1}))
        state = live(second)
        assert (state["unusable"], state["manual"], state["steering"]) == ([], [], "none")
        assert chat(second).headers["x-millm-steering"] == "none"
        ok(httpx.put(api + "/api/steering", json={"sae_id": "alpha", "features": features([(5, 2.0)])}))
        [(kind, params)] = parse(chat(second).headers["x-millm-steering"])
        assert (kind, params["sae"], params["layer"]) == ("manual", "alpha", 0)


def test_a_write_lock_held_elsewhere_is_a_fast_503_and_changes_nothing(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as srv:
        api = srv.base_url
        ok(httpx.post(api + "/api/saes", json={"path": saes["alpha"], "id": "alpha"}), 201)
        ok(httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}))
        epoch = live(srv)["epoch"]
        other = sqlite3.connect(db, isolation_level=None)  # another server's connection, as far as SQLite can tell
        other.execute("BEGIN IMMEDIATE")
        try:
            writes = [
                ("PUT", "/api/steering", {"sae_id": "alpha", "features": features([(3, 6.0)])}),
                ("POST", "/api/profiles", {"name": "p", "sae_id": "alpha", "layer": 1, "features": features([(3, 6.0)])}),
                ("POST", "/api/saes/alpha/detach", {}),
            ]
            for method, path, body in writes:
                started = time.monotonic()
                resp = httpx.request(method, api + path, json=body, timeout=10)
                elapsed = time.monotonic() - started
                assert resp.status_code == 503, resp.text
                assert (resp.json()["error"]["code"], resp.json()["error"]["type"]) == ("database_busy", "server_error")
                assert int(resp.headers["retry-after"]) >= 1
                # Refused after the store's short wait, not held until the other writer lets
                # go (never, here): a bound far from both, so a busy machine cannot fail it.
                assert elapsed < 5.0, f"{method} {path} took {elapsed:.2f} s"
            # The event loop keeps answering while writes wait for the lock: were each wait
            # spent on the loop, health checks could only slip in between the writes, one per
            # write. Counted, not timed, so a busy machine cannot fail it.
            rounds = 8
            waiting = threading.Thread(target=lambda: [httpx.put(api + "/api/steering", json=writes[0][2], timeout=10) for _ in range(rounds)])
            waiting.start()
            answered = 0
            while waiting.is_alive():
                assert httpx.get(api + "/api/health", timeout=10).status_code == 200
                answered += 1
            waiting.join(10)
            assert answered > 2 * rounds, f"{answered} health checks answered during {rounds} waiting writes"
            # Reads still answer, and the refused writes changed nothing.
            state = live(srv)
            assert (state["epoch"], state["manual"], state["attached"]) == (epoch, [], [["alpha", 1]])
            assert ok(httpx.get(api + "/api/profiles")).json()["data"] == []
            assert chat(srv).headers["x-millm-steering"] == "none"
        finally:
            other.execute("ROLLBACK")
            other.close()
        retried = ok(httpx.put(api + "/api/steering", json=writes[0][2]))
        assert retried.json()["epoch"] == epoch + 1 and retried.json()["manual"][0]["sae_id"] == "alpha"


def test_a_slow_import_leaves_the_event_loop_answering(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """The import's validation and its transaction run off the event loop: while the
    database takes seconds over it (slowed from the test's own connection), health checks
    answer while it holds the write lock."""
    db = str(tmp_path / "millm.db")
    document = {
        "format": "millm.profile/v1",
        "profiles": [{"name": f"p{i:04d}", "sae_id": "alpha", "layer": 1, "features": features([(i % 48, 1.0)])} for i in range(400)],
    }
    with make_server(db=db) as srv:
        ok(httpx.post(srv.base_url + "/api/saes", json={"path": saes["alpha"], "id": "alpha"}), 201)
        probe = sqlite3.connect(db, timeout=0, isolation_level=None)
        probe.execute("CREATE TABLE pad (x INTEGER)")
        probe.executemany("INSERT INTO pad VALUES (?)", [(i,) for i in range(PAD_ROWS)])
        probe.execute("CREATE TRIGGER slow_profiles AFTER INSERT ON profiles BEGIN SELECT sum(a.x * b.x) FROM pad a, pad b; END")
        result: dict[str, httpx.Response] = {}
        worker = threading.Thread(target=lambda: result.setdefault("import", httpx.post(srv.base_url + "/api/profiles/import", json=document, timeout=300)))
        worker.start()
        deadline = time.monotonic() + 60
        while not write_locked(probe):
            assert time.monotonic() < deadline, "the import never took the write lock"
            time.sleep(0.002)
        # Were the import on the event loop, the first health check would wait for its end
        # and the lock would be gone by the last one. Ordered, not timed.
        for _ in range(10):
            assert httpx.get(srv.base_url + "/api/health", timeout=300).status_code == 200
        still_writing = write_locked(probe)
        worker.join(300)
        probe.close()
        assert still_writing, "health checks waited for the import to end (or it ended too fast; slow it more)"
        assert result["import"].status_code == 201, result["import"].text
        assert len(ok(httpx.get(srv.base_url + "/api/profiles")).json()["data"]) == 400
