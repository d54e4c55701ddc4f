"""The circuits management API on a real server: import (checked against the registered
SAEs, the imported clusters and the configured limits), export, list, delete, activation
and the dial's refusals."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import imported, setup_saes
from .helpers import D_SAE, JSON, LADDER, document

A0 = [(3, 6.0), (5, -2.0)]
B1 = [(7, 4.0), (11, 3.0)]


def base() -> dict[str, Any]:
    return document("sea", {0: ("alpha", A0), 1: ("beta", B1)}, intensity=1.0, intensity_range=[0.5, 1.5])


def test_import_list_get_export_and_delete(srv) -> None:  # type: ignore[no-untyped-def]
    doc = {**base(), "notes": {"mined_from": "notebook 7", "weights": [1, 2.5, "x"]}}
    created = httpx.post(srv.base_url + "/api/circuits/import", json=doc)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["id"].startswith("crc_") and len(body["id"]) == 16
    assert {k: body[k] for k in ("name", "status", "active", "rung", "language", "intensity", "intensity_range", "backing_cluster", "edges")} == {
        "name": "sea", "status": "ok", "active": False, "rung": 2, "language": LADDER[2], "intensity": 1.0, "intensity_range": [0.5, 1.5],
        "backing_cluster": None, "edges": 1,
    }  # fmt: skip
    assert body["slices"] == [
        {"layer": 0, "sae_id": "alpha", "features": [{"index": i, "strength": s} for i, s in sorted(A0)]},
        {"layer": 1, "sae_id": "beta", "features": [{"index": i, "strength": s} for i, s in sorted(B1)]},
    ]
    assert body["ignored_fields"] == ["notes"]
    listed = httpx.get(srv.base_url + "/api/circuits").json()
    assert listed["object"] == "list" and [c["id"] for c in listed["data"]] == [body["id"]]
    one = httpx.get(srv.base_url + f"/api/circuits/{body['id']}").json()
    assert one == {k: v for k, v in body.items() if k != "ignored_fields"}
    exported = httpx.get(srv.base_url + f"/api/circuits/{body['id']}/export")
    assert exported.status_code == 200 and exported.json() == doc  # lossless: every field, as sent
    assert list(exported.json()) == list(doc)  # in the order sent
    again = httpx.post(srv.base_url + "/api/circuits/import", json=doc)
    assert (again.status_code, again.json()["error"]["code"], again.json()["error"]["param"]) == (409, "circuit_exists", "name")
    deleted = httpx.delete(srv.base_url + f"/api/circuits/{body['id']}", headers=JSON)
    assert deleted.json() == {"id": body["id"], "deleted": True}
    for method, path in (("GET", ""), ("GET", "/export"), ("DELETE", ""), ("POST", "/activate"), ("POST", "/deactivate")):
        gone = httpx.request(
            method, srv.base_url + f"/api/circuits/{body['id']}{path}", headers=JSON, content=b"{}" if method == "POST" else None
        )
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "circuit_not_found"), (method, path)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to a document: set the value at a dotted path (``members.0.layer``)."""

    def change(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


@pytest.mark.parametrize(
    ("change", "status", "code", "param"),
    [
        (_set("name", ""), 400, "invalid_parameter", "name"),
        (_set("saes.1.sae_id", "nope"), 404, "sae_not_found", "saes[1].sae_id"),
        (_set("saes.1.layer", 0), 400, "invalid_parameter", "saes[1].layer"),
        (_set("saes", []), 400, "invalid_parameter", "saes"),
        (_set("members.0.layer", 5), 400, "invalid_parameter", "members[0].layer"),
        (_set("members.0.feature_idx", D_SAE), 400, "invalid_feature_index", "members[0].feature_idx"),
        (_set("members.1.feature_idx", 3), 400, "invalid_parameter", "members[1].feature_idx"),  # listed twice
        (_set("members.0", {"layer": 0, "feature_idx": 3}), 400, "invalid_parameter", "members[0]"),  # neither strength nor cluster
        (_set("members.0", {"layer": 0, "feature_idx": 3, "strength": 1.0, "weight": 2}), 400, "invalid_parameter", "members[0].weight"),
        (_set("members.0.strength", True), 400, "invalid_parameter", "members[0].strength"),
        (_set("members", []), 400, "invalid_parameter", "members"),
        (_set("edges.0.rung", 4), 400, "invalid_parameter", "edges[0].rung"),
        (_set("edges.0.rung", True), 400, "invalid_parameter", "edges[0].rung"),
        (_set("edges.0.down", {"layer": 1, "feature_idx": 40}), 400, "invalid_parameter", "edges[0].down"),
        (
            _set("edges.0", {"up": {"layer": 1, "feature_idx": 7}, "down": {"layer": 0, "feature_idx": 3}, "rung": 2}),
            400,
            "invalid_parameter",
            "edges[0]",
        ),
        (_set("budget.intensity", 0.2), 400, "invalid_parameter", "budget.intensity"),  # outside the declared range
        (_set("budget.intensity", 2.5), 400, "invalid_parameter", "budget.intensity"),
        (_set("budget.intensity_range", [1.5, 0.5]), 400, "invalid_parameter", "budget.intensity_range"),
        # A range wholly beyond the dial's [0, 2] envelope leaves no λ to dial (0 would pass the intensity check).
        (_set("budget", {"intensity": 0.0, "intensity_range": [2.5, 3.0]}), 400, "invalid_parameter", "budget.intensity_range"),
        # The same edge twice (even at another rung) would leave its evidence ambiguous.
        (
            _set("edges", [{"up": {"layer": 0, "feature_idx": 3}, "down": {"layer": 1, "feature_idx": 7}, "rung": r} for r in (2, 3)]),
            400,
            "invalid_parameter",
            "edges[1]",
        ),
        (_set("backing_cluster", "nope"), 404, "cluster_not_found", "backing_cluster"),
    ],
)
def test_refusals_name_the_path(srv, change: Callable[[dict[str, Any]], None], status: int, code: str, param: str) -> None:  # type: ignore[no-untyped-def]
    doc = copy.deepcopy(base())
    change(doc)
    resp = httpx.post(srv.base_url + "/api/circuits/import", json=doc)
    assert resp.status_code == status, resp.text
    assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, param)
    assert httpx.get(srv.base_url + "/api/circuits").json()["data"] == []


EDGE = {"up": {"layer": 0, "feature_idx": 1}, "down": {"layer": 0, "feature_idx": 1}, "rung": 2}  # counted before it is checked


def test_the_limits_are_settings_and_a_violation_names_the_limit(make_server, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    with make_server(circuit_max_layers=1, circuit_max_members_per_layer=2, circuit_max_edges=1) as server:
        setup_saes(server.base_url, sae_paths)
        url = server.base_url + "/api/circuits/import"
        at_limit = document("fits", {0: ("alpha", [(1, 1.0), (2, 1.0)])})
        assert httpx.post(url, json=at_limit).status_code == 201
        over = {
            "circuit_max_layers": (document("layers", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=[]), "saes"),
            "circuit_max_members_per_layer": (document("members", {0: ("alpha", [(1, 1.0), (2, 1.0), (4, 1.0)])}), "members"),
            "circuit_max_edges": ({**document("edges", {0: ("alpha", [(1, 1.0)])}), "edges": [EDGE, EDGE]}, "edges"),
        }
        for setting, (doc, param) in over.items():
            resp = httpx.post(url, json=doc)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["code"], error["param"]) == ("circuit_limit_exceeded", param)
            assert setting in error["message"], error["message"]


def test_a_member_may_reference_a_cluster_expanded_on_import(srv) -> None:  # type: ignore[no-untyped-def]
    cluster = {"name": "calm", "sae": {"layer": 0, "n_features": D_SAE},
               "members": [{"feature_idx": 5, "strength": 2.0}, {"feature_idx": 9, "strength": 3.0, "sign": -1}], "budget": {"intensity": 0.5}}  # fmt: skip
    assert httpx.post(srv.base_url + "/api/clusters/import", json=cluster).status_code == 201
    doc = document("with-cluster", {0: ("alpha", [(1, 1.5)]), 1: ("beta", B1)})
    doc["members"].append({"layer": 0, "cluster": "calm"})
    created = imported(srv.base_url, doc)
    # The cluster's authored strengths (its dial is not applied), beside the explicit member.
    assert created["slices"][0]["features"] == [
        {"index": 1, "strength": 1.5},
        {"index": 5, "strength": 2.0},
        {"index": 9, "strength": -3.0},
    ]
    assert httpx.get(srv.base_url + f"/api/circuits/{created['id']}/export").json()["members"][-1] == {"layer": 0, "cluster": "calm"}
    for member, code, param in (
        ({"layer": 1, "cluster": "calm"}, "invalid_parameter", "members[3].cluster"),  # calm is at layer 0
        ({"layer": 0, "cluster": "nope"}, "cluster_not_found", "members[3].cluster"),
        ({"layer": 0, "cluster": "calm", "strength": 2.0}, "invalid_parameter", "members[3]"),
    ):
        bad = document("bad", {0: ("alpha", [(1, 1.5)]), 1: ("beta", B1)})
        bad["members"].append(member)
        resp = httpx.post(srv.base_url + "/api/circuits/import", json=bad)
        assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, param), resp.text
    twice = document("twice", {0: ("alpha", [(5, 1.0)]), 1: ("beta", B1)})
    twice["members"].append({"layer": 0, "cluster": "calm"})
    resp = httpx.post(srv.base_url + "/api/circuits/import", json=twice)
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "members[3].cluster") and "listed twice" in resp.json()["error"][
        "message"
    ]


def test_the_backing_cluster_must_be_on_one_of_the_circuits_sae(srv) -> None:  # type: ignore[no-untyped-def]
    cluster = {"name": "calm", "sae": {"layer": 0, "n_features": D_SAE}, "members": [{"feature_idx": 5, "strength": 2.0}]}
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster)
    httpx.post(srv.base_url + "/api/profiles", json={"name": "plain", "sae_id": "alpha", "layer": 0, "features": []})
    on_other = document("elsewhere", {1: ("beta", B1)}, backing_cluster="calm")
    resp = httpx.post(srv.base_url + "/api/circuits/import", json=on_other)
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "backing_cluster")
    not_cluster = httpx.post(srv.base_url + "/api/circuits/import", json={**base(), "backing_cluster": "plain"})
    assert (not_cluster.status_code, not_cluster.json()["error"]["code"]) == (404, "cluster_not_found")
    assert imported(srv.base_url, {**base(), "backing_cluster": "calm"})["backing_cluster"] == "calm"


def test_the_persistent_dial_refusals(srv) -> None:  # type: ignore[no-untyped-def]
    url = srv.base_url + "/api/circuits/active/intensity"
    none_active = httpx.put(url, json={"intensity": 1.0})
    assert (none_active.status_code, none_active.json()["error"]["code"]) == (409, "circuit_not_active")
    first = imported(srv.base_url, base(), activate=True)
    for bad in (0.2, 1.6, -1.0, True):  # 0, or within the declared [0.5, 1.5]
        resp = httpx.put(url, json={"intensity": bad})
        assert (resp.status_code, resp.json()["error"]["param"]) == (400, "intensity"), bad
    assert httpx.put(url, json={"intensity": 0}).status_code == 200
    assert httpx.put(url, json={"intensity": 1.25, "id": first["id"]}).json()["active"][0]["intensity"] == 1.25
    second = imported(srv.base_url, document("other", {0: ("alpha", [(20, 1.0)])}))
    inactive = httpx.put(url, json={"intensity": 1.0, "id": second["id"]})
    assert (inactive.status_code, inactive.json()["error"]["code"]) == (409, "circuit_not_active")
    httpx.post(srv.base_url + f"/api/circuits/{second['id']}/activate", json={"allow_overlap": True, "acknowledge_unvalidated": True})
    ambiguous = httpx.put(url, json={"intensity": 1.0})
    assert (ambiguous.status_code, ambiguous.json()["error"]["param"]) == (409, "id") and first["id"] in ambiguous.json()["error"][
        "message"
    ]
    unknown = httpx.put(url, json={"intensity": 1.0, "id": "crc_000000000000"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "circuit_not_found")


def test_deleting_an_active_circuit_deactivates_it_and_moves_the_epoch(srv) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, base(), activate=True)
    before = httpx.get(srv.base_url + "/api/circuits/active").json()
    assert [a["id"] for a in before["active"]] == [circuit["id"]]
    assert httpx.delete(srv.base_url + f"/api/circuits/{circuit['id']}", headers=JSON).status_code == 200
    after = httpx.get(srv.base_url + "/api/circuits/active").json()
    assert after["active"] == [] and after["epoch"] == before["epoch"] + 1


def test_without_the_steering_plugin_circuit_writes_are_refused_by_name(make_server) -> None:  # type: ignore[no-untyped-def]
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"plugins": ("sampling", "circuits")}, environ={}))
    with make_server(host=host) as server:
        assert httpx.get(server.base_url + "/api/circuits").json()["data"] == []
        resp = httpx.post(server.base_url + "/api/circuits/import", json=base())
        assert (resp.status_code, resp.json()["error"]["code"]) == (409, "steering_disabled")
        assert (
            httpx.post(
                server.base_url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ).status_code
            == 200
        )


def test_without_the_steering_plugin_a_write_that_cannot_answer_changes_nothing(
    make_server: Any, sae_paths: dict[str, str], tmp_path: Any
) -> None:
    """A circuit activated by a server with steering, then the same database served without
    it: deactivating or turning the dial is refused (409 steering_disabled), and being
    refused, leaves the circuit as it was (it is never written and then reported as a
    failure)."""
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        setup_saes(first.base_url, sae_paths)
        circuit = imported(first.base_url, base(), activate=True)
    host = build_host(load_settings({"plugins": ("sampling", "circuits")}, environ={}))
    with make_server(host=host, db=db) as second:
        writes: tuple[tuple[str, str, dict[str, Any]], ...] = (
            ("POST", f"/api/circuits/{circuit['id']}/deactivate", {}),
            ("PUT", "/api/circuits/active/intensity", {"intensity": 0.5}),
        )
        for method, path, body in writes:
            resp = httpx.request(method, second.base_url + path, json=body)
            assert (resp.status_code, resp.json()["error"]["code"]) == (409, "steering_disabled"), (path, resp.text)
        [kept] = httpx.get(second.base_url + "/api/circuits").json()["data"]
        assert (kept["active"], kept["intensity"]) == (True, 1.0)


def test_deactivate_takes_no_fields_as_activate_refuses_unknown_ones(srv) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, base(), activate=True)
    url = srv.base_url + f"/api/circuits/{circuit['id']}/deactivate"
    for resp in (httpx.post(url, json={"force": True}), httpx.post(url, content="not json", headers=JSON)):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error" and set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert [a["id"] for a in httpx.get(srv.base_url + "/api/circuits/active").json()["active"]] == [circuit["id"]]  # nothing written
    unknown = httpx.post(url, json={"force": True})
    assert unknown.json()["error"]["param"] == "force"
    assert httpx.post(url, headers=JSON).status_code == 200  # no body, as before
    assert httpx.get(srv.base_url + "/api/circuits/active").json()["active"] == []
