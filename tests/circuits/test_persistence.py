"""Circuits, their dials and which are active survive a restart; a stored definition that
can no longer be parsed is kept, reported, never applied, and no response claims a rung."""

from __future__ import annotations

import pathlib
import sqlite3
from typing import Any

import httpx

from .conftest import imported, setup_saes
from .helpers import JSON, LADDER, chat, content, document, members, reference, rung

A0 = [(3, 6.0), (5, -2.0)]
B1 = [(7, 4.0), (11, 3.0)]


def test_circuits_dials_and_the_active_ones_survive_a_restart(
    make_server, tiny_engine, sae_paths: dict[str, str], tmp_path: pathlib.Path
) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        setup_saes(first.base_url, sae_paths)
        kept = imported(first.base_url, document("kept", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=[1], intensity_range=[0.5, 1.5]))
        idle = imported(first.base_url, document("idle", {0: ("alpha", [(20, 2.0)])}))
        httpx.post(first.base_url + f"/api/circuits/{kept['id']}/activate", json={"acknowledge_unvalidated": True})
        assert httpx.put(first.base_url + "/api/circuits/active/intensity", json={"intensity": 0.75}).status_code == 200
        listed = httpx.get(first.base_url + "/api/circuits").json()
        view = httpx.get(first.base_url + "/api/circuits/active").json()
        before = chat(first.base_url)
    with make_server(db=db) as second:
        assert httpx.get(second.base_url + "/api/circuits").json() == listed
        restored = httpx.get(second.base_url + "/api/circuits/active").json()
        assert restored["epoch"] > view["epoch"]  # a restart moves the epoch on, never back
        assert {k: v for k, v in restored.items() if k != "epoch"} == {k: v for k, v in view.items() if k != "epoch"}
        after = chat(second.base_url)
        assert after.headers["x-millm-steering"] == before.headers["x-millm-steering"]
        assert members(after.headers["x-millm-steering"]) == [("circuit", {"id": kept["id"], "intensity": "0.75"})]
        assert rung(after.headers["x-millm-circuit-rung"]) == (1, {"language": LADDER[1]})
        expected = reference(
            tiny_engine, {0: (sae_paths["alpha"], [(i, s * 0.75) for i, s in A0]), 1: (sae_paths["beta"], [(i, s * 0.75) for i, s in B1])}
        )
        assert content(after) == content(before) == expected
        assert httpx.get(second.base_url + f"/api/circuits/{idle['id']}/export").json()["name"] == "idle"


def test_an_unparseable_stored_definition_is_reported_and_never_applied(
    make_server, tiny_engine, sae_paths: dict[str, str], tmp_path: pathlib.Path
) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        setup_saes(first.base_url, sae_paths)
        circuit = imported(first.base_url, document("damaged", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
        assert "x-millm-circuit-rung" in chat(first.base_url).headers
    with sqlite3.connect(db) as conn:  # what a newer millm, or a damaged file, leaves behind
        conn.execute("UPDATE circuits SET body = ? WHERE id = ?", (b"\xc1 not msgpack", circuit["id"]))
    with make_server(db=db) as second:
        [listed] = httpx.get(second.base_url + "/api/circuits").json()["data"]
        assert (listed["id"], listed["status"], listed["active"], listed["rung"]) == (circuit["id"], "unreadable", True, None)
        assert "cannot be parsed" in listed["reason"]
        [active] = httpx.get(second.base_url + "/api/circuits/active").json()["active"]
        assert (active["steering"]["steers"], active["steering"]["reason"]) == (False, "definition_unreadable")
        resp = chat(second.base_url)
        assert "x-millm-circuit-rung" not in resp.headers
        assert members(resp.headers["x-millm-steering"]) == [("unknown", {"reason": "claims_unreadable"})]  # never guessed
        assert content(resp) == reference(tiny_engine, {})  # and run unsteered
        refused = httpx.post(second.base_url + f"/api/circuits/{circuit['id']}/deactivate", json={})
        assert refused.status_code == 200 and refused.json()["active"] == []
        again = httpx.post(second.base_url + f"/api/circuits/{circuit['id']}/activate", json={})
        assert (again.status_code, again.json()["error"]["code"]) == (409, "circuit_unreadable")
        assert members(chat(second.base_url).headers["x-millm-steering"]) == [("none", {})]
        assert httpx.get(second.base_url + f"/api/circuits/{circuit['id']}/export").json()["name"] == "damaged"  # the document is intact
        assert httpx.delete(second.base_url + f"/api/circuits/{circuit['id']}", headers=JSON).status_code == 200


def test_two_servers_on_one_database_see_each_others_circuit_writes(make_server, sae_paths: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as one, make_server(db=db) as two:
        setup_saes(one.base_url, sae_paths)
        circuit = imported(one.base_url, document("shared", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
        view = httpx.get(two.base_url + "/api/circuits/active").json()  # a route checks at once
        assert [a["id"] for a in view["active"]] == [circuit["id"]] and view["active"][0]["steering"]["steers"]
        assert members(chat(two.base_url).headers["x-millm-steering"])[0][1]["id"] == circuit["id"]
        httpx.post(two.base_url + f"/api/circuits/{circuit['id']}/deactivate", json={})
        assert httpx.get(one.base_url + "/api/circuits/active").json()["active"] == []


def test_a_stored_rung_off_this_servers_ladder_is_unreadable_not_a_500(
    make_server: Any, tiny_engine: Any, sae_paths: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """A definition that decodes but carries a rung this server has no phrase for (what a
    newer millm with a longer ladder could store) is reported unreadable like any other:
    the routes answer, and no request is described with a phrase the server made up."""
    import msgspec

    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        setup_saes(first.base_url, sae_paths)
        circuit = imported(first.base_url, document("newer", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=[3]), activate=True)
    with sqlite3.connect(db) as conn:
        (body,) = conn.execute("SELECT body FROM circuits WHERE id = ?", (circuit["id"],)).fetchone()
        stored = msgspec.msgpack.decode(body)
        stored["rung"] = 4
        stored["edges"][0]["rung"] = 4
        conn.execute("UPDATE circuits SET body = ? WHERE id = ?", (msgspec.msgpack.encode(stored), circuit["id"]))
    with make_server(db=db) as second:
        listed = httpx.get(second.base_url + "/api/circuits")
        assert listed.status_code == 200, listed.text
        [row] = listed.json()["data"]
        assert (row["status"], row["rung"], row["language"]) == ("unreadable", None, None) and "rung 4" in row["reason"]
        assert httpx.get(second.base_url + f"/api/circuits/{circuit['id']}").status_code == 200
        active = httpx.get(second.base_url + "/api/circuits/active")
        assert active.status_code == 200 and active.json()["active"][0]["steering"]["reason"] == "definition_unreadable"
        resp = chat(second.base_url)
        assert "x-millm-circuit-rung" not in resp.headers
        assert members(resp.headers["x-millm-steering"]) == [("unknown", {"reason": "claims_unreadable"})]
