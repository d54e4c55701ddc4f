"""``X-miLLM-Circuit-Rung``: the rung (the minimum over a circuit's edges) and the ladder's
phrase, parsed with http-sfv, only while a circuit genuinely steers; one test per case the
specification lists where it is omitted (the unparseable definition is in
test_persistence.py, since it needs a damaged database)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import imported
from .helpers import LADDER, chat, document, members, rung

A0 = [(3, 6.0), (5, -2.0)]
B1 = [(7, 4.0), (11, 3.0)]


def steering_of(base_url: str) -> list[dict[str, Any]]:
    return [a["steering"] for a in httpx.get(base_url + "/api/circuits/active").json()["active"]]


@pytest.mark.parametrize(("edges", "expected"), [([0], 0), ([3, 1], 1), ([2, 3], 2), ([3], 3), ([3, 2, 1, 3], 1)])
def test_the_rung_is_the_lowest_edge_and_the_phrase_comes_from_the_ladder(srv, edges: list[int], expected: int) -> None:  # type: ignore[no-untyped-def]
    doc = document("laddered", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=edges)
    circuit = imported(srv.base_url, doc)
    assert (circuit["rung"], circuit["language"]) == (expected, LADDER[expected])
    activation = {"acknowledge_unvalidated": True} if expected < 2 else {}
    assert httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/activate", json=activation).status_code == 200
    resp = chat(srv.base_url)
    value, params = rung(resp.headers["x-millm-circuit-rung"])
    assert (value, params) == (expected, {"language": LADDER[expected]})
    assert resp.headers["x-millm-circuit-rung"] == f'{expected}; language="{LADDER[expected]}"'  # the specification's exact form
    assert httpx.get(srv.base_url + "/api/circuits/active").json()["rung"] == resp.headers["x-millm-circuit-rung"]


@pytest.mark.parametrize("below", [0, 1])
def test_activating_below_rung_2_needs_an_acknowledgement(srv, below: int) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, document("weak", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=[below]))
    url = srv.base_url + f"/api/circuits/{circuit['id']}/activate"
    refused = httpx.post(url, json={})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("circuit_unvalidated", "acknowledge_unvalidated")
    assert f"rung {below}" in error["message"] and LADDER[below] in error["message"]
    assert httpx.get(srv.base_url + "/api/circuits/active").json()["active"] == []
    assert "x-millm-circuit-rung" not in chat(srv.base_url).headers
    assert httpx.post(url + "?acknowledge_unvalidated=true", json={}).status_code == 200  # the query form works too
    assert rung(chat(srv.base_url).headers["x-millm-circuit-rung"]) == (below, {"language": LADDER[below]})


def test_validated_circuits_need_no_acknowledgement(srv) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, document("strong", {0: ("alpha", A0), 1: ("beta", B1)}, rungs=[2]))
    assert httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/activate", json={}).status_code == 200


# ------------------------------------------------------------------ omitted


def test_omitted_without_an_active_circuit(srv) -> None:  # type: ignore[no-untyped-def]
    assert "x-millm-circuit-rung" not in chat(srv.base_url).headers  # nothing imported
    imported(srv.base_url, document("idle", {0: ("alpha", A0), 1: ("beta", B1)}))
    resp = chat(srv.base_url)
    assert "x-millm-circuit-rung" not in resp.headers and members(resp.headers["x-millm-steering"]) == [("none", {})]
    view = httpx.get(srv.base_url + "/api/circuits/active").json()
    assert (view["active"], view["steering"], view["rung"]) == ([], "none", None)


def test_omitted_on_a_slice_fallback_serve(srv) -> None:  # type: ignore[no-untyped-def]
    cluster = {"name": "calm", "sae": {"layer": 0, "n_features": 48}, "members": [{"feature_idx": 5, "strength": 2.0}]}
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster)
    imported(srv.base_url, document("wide", {0: ("alpha", A0), 1: ("gamma", B1)}, backing_cluster="calm"), activate=True)
    resp = chat(srv.base_url)
    assert [kind for kind, _ in members(resp.headers["x-millm-steering"])] == ["profile"]  # steered, but by the cluster
    assert "x-millm-circuit-rung" not in resp.headers
    assert steering_of(srv.base_url)[0]["reason"] == "slice_fallback"


def test_omitted_when_no_sae_is_attached_on_any_member_layer(srv, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, document("stranded", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
    assert "x-millm-circuit-rung" in chat(srv.base_url).headers
    httpx.post(srv.base_url + "/api/saes/alpha/detach", json={})
    httpx.post(srv.base_url + "/api/saes/beta/detach", json={})
    try:
        resp = chat(srv.base_url)
        assert "x-millm-circuit-rung" not in resp.headers and members(resp.headers["x-millm-steering"]) == [("none", {})]
        [steering] = steering_of(srv.base_url)
        assert (steering["steers"], steering["mode"], steering["reason"]) == (False, "slice_fallback", "no_sae_attached")
    finally:
        httpx.post(srv.base_url + "/api/saes/alpha/attach", json={"layer": 0})
        httpx.post(srv.base_url + "/api/saes/beta/attach", json={"layer": 1})
    assert "x-millm-circuit-rung" in chat(srv.base_url).headers


@pytest.mark.parametrize("off", ["off", 0, 0.0])
def test_omitted_on_a_request_dialled_off(srv, off: Any) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, document("dialled", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
    resp = chat(srv.base_url, steering_intensity=off)
    assert "x-millm-circuit-rung" not in resp.headers
    assert members(resp.headers["x-millm-steering"]) == [("none", {})]


@pytest.mark.parametrize("steering", [{"sae_id": "beta", "features": [{"index": 1, "strength": 2.0}]}, {"features": []}])
def test_omitted_on_a_request_carrying_inline_steering(srv, steering: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, document("replaced", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
    resp = chat(srv.base_url, steering=steering)
    assert resp.status_code == 200, resp.text
    assert "x-millm-circuit-rung" not in resp.headers
    assert "circuit" not in [kind for kind, _ in members(resp.headers["x-millm-steering"])]


def test_omitted_on_a_scoring_request(srv) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, document("scored", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
    resp = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "The sea is", "max_tokens": 1, "logprobs": 3})
    assert resp.status_code == 200, resp.text
    assert "x-millm-circuit-rung" not in resp.headers and members(resp.headers["x-millm-steering"]) == [("none", {})]


def test_omitted_when_the_steering_header_names_no_circuit(srv) -> None:  # type: ignore[no-untyped-def]
    """A request's profile replaces the global state, the circuit with it; and a circuit
    whose every strength is 0 applies nothing: neither response names a circuit."""
    imported(srv.base_url, document("named", {0: ("alpha", A0), 1: ("beta", B1)}), activate=True)
    httpx.post(
        srv.base_url + "/api/profiles", json={"name": "p", "sae_id": "alpha", "layer": 0, "features": [{"index": 2, "strength": 1.0}]}
    )
    profiled = chat(srv.base_url, profile="p")
    assert [kind for kind, _ in members(profiled.headers["x-millm-steering"])] == ["profile"]
    assert "x-millm-circuit-rung" not in profiled.headers
    httpx.delete(
        srv.base_url + "/api/circuits/" + httpx.get(srv.base_url + "/api/circuits").json()["data"][0]["id"],
        headers={"Content-Type": "application/json"},
    )
    imported(srv.base_url, document("silent", {0: ("alpha", [(3, 0.0)]), 1: ("beta", [(7, 0.0)])}), activate=True)
    silent = chat(srv.base_url)
    assert members(silent.headers["x-millm-steering"]) == [("none", {})] and "x-millm-circuit-rung" not in silent.headers
    assert steering_of(srv.base_url)[0]["reason"] == "empty"
