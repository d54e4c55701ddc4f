"""Circuits steering real requests: the text against a hand-written two-layer intervention
(torch forward hooks on the HF model), the dial (both ends clamped, absolute, per request),
composed layers, the fallback to the backing cluster, shared batches, streams, ``changed``,
and scoring and embeddings left unsteered. Every header is parsed with http-sfv."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any

import httpx
import pytest

from ..http.helpers import scheduler_stats
from .conftest import imported
from .helpers import JSON, LADDER, chat, content, document, members, reference, rung, scaled, spec_hash

A0 = [(3, 6.0), (5, -2.0)]
B1 = [(7, 4.0), (11, 3.0)]


def two_layer(name: str = "sea", **kwargs: Any) -> dict[str, Any]:
    return document(name, {0: ("alpha", A0), 1: ("beta", B1)}, **kwargs)


def test_a_two_layer_circuit_steers_as_the_hand_computed_intervention(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, two_layer(), activate=True)
    resp = chat(srv.base_url)
    both = reference(tiny_engine, {0: (sae_paths["alpha"], A0), 1: (sae_paths["beta"], B1)})
    assert content(resp) == both
    # Each layer matters: neither the unsteered text nor one layer alone is what ran.
    assert both != reference(tiny_engine, {}) and both != reference(tiny_engine, {0: (sae_paths["alpha"], A0)})
    assert members(resp.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0"})]
    assert rung(resp.headers["x-millm-circuit-rung"]) == (2, {"language": LADDER[2]})
    assert "x-millm-steering-intensity" not in resp.headers  # no dial in the request
    view = httpx.get(srv.base_url + "/api/circuits/active").json()
    assert view["steering"] == resp.headers["x-millm-steering"] and view["rung"] == resp.headers["x-millm-circuit-rung"]
    [active] = view["active"]
    assert active["steering"] == {
        "steers": True, "mode": "full", "applied_as": "circuit", "intensity": 1.0, "composed": False, "layers": [0, 1], "reason": None,
    }  # fmt: skip
    # GET /api/steering says what a plain request runs with, the circuit included.
    assert httpx.get(srv.base_url + "/api/steering").json()["steering"] == resp.headers["x-millm-steering"]


@pytest.mark.parametrize(
    ("dial", "declared", "expected"),
    [
        (0.75, [0.5, 1.5], 0.75),
        (0.1, [0.5, 1.5], 0.5),  # below the declared floor: clamped up (the circuit rule), unlike a cluster
        (1.9, [0.5, 1.5], 1.5),
        ("min", [0.5, 1.5], 0.5),
        ("max", [0.5, 1.5], 1.5),
        ("max", [0.2, 3.0], 2.0),  # the declared range ∩ the configured envelope [0, 2]
        (1.25, None, 1.25),
        ("max", None, 2.0),
    ],
)
def test_the_request_dial_scales_every_layer(
    srv, tiny_engine, sae_paths: dict[str, str], dial: Any, declared: list[float] | None, expected: float
) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, two_layer(intensity_range=declared), activate=True)
    resp = chat(srv.base_url, steering_intensity=dial)
    assert content(resp) == reference(
        tiny_engine, {0: (sae_paths["alpha"], scaled(A0, expected)), 1: (sae_paths["beta"], scaled(B1, expected))}
    )
    [(kind, params)] = members(resp.headers["x-millm-steering"])
    assert (kind, params["id"], float(params["intensity"])) == ("circuit", circuit["id"], expected)
    assert float(resp.headers["x-millm-steering-intensity"]) == expected
    # For that request only: the persistent dial and a plain request are unchanged.
    assert httpx.get(srv.base_url + f"/api/circuits/{circuit['id']}").json()["intensity"] == 1.0
    assert members(chat(srv.base_url).headers["x-millm-steering"])[0][1]["intensity"] == "1.0"


@pytest.mark.parametrize("off", ["off", 0, "min"])  # "min" is "off" when the document declares no range
def test_a_request_dialled_off_runs_unsteered(srv, tiny_engine, off: Any) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, two_layer(), activate=True)
    resp = chat(srv.base_url, steering_intensity=off)
    assert content(resp) == reference(tiny_engine, {})
    assert members(resp.headers["x-millm-steering"]) == [("none", {})]
    assert float(resp.headers["x-millm-steering-intensity"]) == 0.0  # the dial changed something: it is echoed
    assert "x-millm-circuit-rung" not in resp.headers


def test_the_configured_envelope_clamps_both_ends(make_server, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    from .conftest import setup_saes

    with make_server(circuit_intensity_min=0.3, circuit_intensity_max=0.8) as server:
        setup_saes(server.base_url, sae_paths)
        open_range = imported(server.base_url, two_layer("open"), activate=True)
        cases = {"min": 0.3, 0.1: 0.3, 1.7: 0.8, "max": 0.8, 0.5: 0.5}
        for dial, expected in cases.items():
            [(_, params)] = members(chat(server.base_url, steering_intensity=dial).headers["x-millm-steering"])
            assert float(params["intensity"]) == expected, dial
        # The persistent dial (1.0, authored) is clamped into the envelope too.
        assert members(chat(server.base_url).headers["x-millm-steering"])[0][1]["intensity"] == "0.8"
        httpx.post(server.base_url + f"/api/circuits/{open_range['id']}/deactivate", json={})
        imported(server.base_url, two_layer("declared", intensity=0.6, intensity_range=[0.5, 1.5]), activate=True)
        for dial, expected in {"min": 0.5, "max": 0.8, 0.4: 0.5}.items():
            [(_, params)] = members(chat(server.base_url, steering_intensity=dial).headers["x-millm-steering"])
            assert float(params["intensity"]) == expected, dial


def test_the_persistent_dial_is_absolute_and_each_member_is_clamped(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    strong = [(3, 150.0), (5, 2.0)]
    circuit = imported(srv.base_url, document("strong", {0: ("alpha", strong), 1: ("beta", B1)}), activate=True)
    put = httpx.put(srv.base_url + "/api/circuits/active/intensity", json={"intensity": 1.5})
    assert put.status_code == 200, put.text
    assert put.json()["active"][0]["intensity"] == 1.5 and put.json()["active"][0]["steering"]["intensity"] == 1.5
    # 150 × 1.5 reaches the ±200 ceiling while 2 × 1.5 keeps scaling.
    resp = chat(srv.base_url)
    assert content(resp) == reference(tiny_engine, {0: (sae_paths["alpha"], scaled(strong, 1.5)), 1: (sae_paths["beta"], scaled(B1, 1.5))})
    # The clamp is counted and reported, as for every other kind of steering.
    assert members(resp.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.5", "clamped": 1})]
    # Turning the dial down re-derives from the authored strengths: 150 × 0.5, not 200 × 0.5 / 1.5.
    httpx.put(srv.base_url + "/api/circuits/active/intensity", json={"intensity": 0.5})
    low = chat(srv.base_url)
    assert content(low) == reference(tiny_engine, {0: (sae_paths["alpha"], scaled(strong, 0.5)), 1: (sae_paths["beta"], scaled(B1, 0.5))})
    assert members(low.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "0.5"})]  # nothing clamped
    # A request's dial replaces the persistent one, never multiplies it.
    assert content(chat(srv.base_url, steering_intensity=2.0)) == reference(
        tiny_engine, {0: (sae_paths["alpha"], scaled(strong, 2.0)), 1: (sae_paths["beta"], scaled(B1, 2.0))}
    )
    # The persistent dial set to 0 turns the circuit off until it is set again.
    httpx.put(srv.base_url + "/api/circuits/active/intensity", json={"intensity": 0})
    off = chat(srv.base_url)
    assert members(off.headers["x-millm-steering"]) == [("none", {})] and "x-millm-circuit-rung" not in off.headers
    view = httpx.get(srv.base_url + "/api/circuits/active").json()
    assert view["active"][0]["steering"]["reason"] == "dialled_off" and view["rung"] is None


def test_clamps_on_every_layer_of_a_circuit_are_counted_as_inline_steering_counts_them(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Authored strengths beyond ±200 are applied clamped, and the circuit's member says how
    many were, over all its layers: the count the same features sent inline report."""
    at0, at1 = [(3, 500.0), (5, 2.0)], [(7, -300.0), (11, 3.0)]
    circuit = imported(srv.base_url, document("loud", {0: ("alpha", at0), 1: ("beta", at1)}), activate=True)
    resp = chat(srv.base_url)
    assert content(resp) == reference(tiny_engine, {0: (sae_paths["alpha"], at0), 1: (sae_paths["beta"], at1)})
    assert members(resp.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0", "clamped": 2})]
    # The count inline steering reports for one layer's features, computed the same way.
    httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/deactivate", json={})
    inline = chat(srv.base_url, steering={"sae_id": "alpha", "features": [{"index": i, "strength": v} for i, v in at0]})
    assert members(inline.headers["x-millm-steering"])[0][1]["clamped"] == 1
    view = httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/activate", json={}).json()
    assert view["steering"] == f'circuit;id="{circuit["id"]}";intensity="1.0";clamped=2'


def test_inline_steering_or_a_profile_replaces_the_circuit_for_that_request(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, two_layer(), activate=True)
    own = [(9, 5.0)]
    inline = chat(srv.base_url, steering={"sae_id": "alpha", "features": [{"index": i, "strength": s} for i, s in own]})
    assert content(inline) == reference(tiny_engine, {0: (sae_paths["alpha"], own)})
    assert members(inline.headers["x-millm-steering"]) == [
        ("inline", {"sae": "alpha", "layer": 0, "features": 1, "hash": spec_hash("alpha", own)})
    ]
    httpx.post(
        srv.base_url + "/api/profiles", json={"name": "p", "sae_id": "beta", "layer": 1, "features": [{"index": 2, "strength": 3.0}]}
    )
    profiled = chat(srv.base_url, profile="p")
    assert content(profiled) == reference(tiny_engine, {1: (sae_paths["beta"], [(2, 3.0)])})
    assert [kind for kind, _ in members(profiled.headers["x-millm-steering"])] == ["profile"]
    assert members(chat(srv.base_url).headers["x-millm-steering"])[0][0] == "circuit"  # the global state was never written


def test_the_circuit_runs_beside_the_active_profile_and_manual_values(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Steering's own global state still applies; at a shared layer the vectors add up, and
    the header lists the circuit first, then the SAE items by layer."""
    circuit = imported(srv.base_url, document("only-0", {0: ("alpha", A0)}), activate=True, acknowledge_unvalidated=True)
    httpx.put(srv.base_url + "/api/steering", json={"sae_id": "beta", "features": [{"index": 4, "strength": 2.5}]})
    resp = chat(srv.base_url, steering_intensity=1.5)  # the circuit is the dial's base: manual values run as stored
    assert content(resp) == reference(tiny_engine, {0: (sae_paths["alpha"], scaled(A0, 1.5)), 1: (sae_paths["beta"], [(4, 2.5)])})
    assert members(resp.headers["x-millm-steering"]) == [
        ("circuit", {"id": circuit["id"], "intensity": "1.5"}),
        ("manual", {"sae": "beta", "layer": 1, "features": 1, "hash": spec_hash("beta", [(4, 2.5)])}),
    ]
    assert float(resp.headers["x-millm-steering-intensity"]) == 1.5


def test_two_circuits_on_one_layer_are_refused_unless_overlap_is_allowed_then_composed(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    first = imported(srv.base_url, two_layer("first"), activate=True)
    second = imported(srv.base_url, document("second", {1: ("beta", [(20, 5.0)])}))
    refused = httpx.post(srv.base_url + f"/api/circuits/{second['id']}/activate", json={"acknowledge_unvalidated": True})
    assert refused.status_code == 409
    assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == ("circuit_overlap", "allow_overlap")
    assert first["id"] in refused.json()["error"]["message"] and "[1]" in refused.json()["error"]["message"]
    sharing = imported(srv.base_url, document("sharing", {1: ("beta", [(7, 1.0)])}))  # (layer 1, feature 7) is first's too
    conflict = httpx.post(
        srv.base_url + f"/api/circuits/{sharing['id']}/activate", json={"allow_overlap": True, "acknowledge_unvalidated": True}
    )
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "circuit_feature_conflict")
    allowed = httpx.post(
        srv.base_url + f"/api/circuits/{second['id']}/activate", json={"allow_overlap": True, "acknowledge_unvalidated": True}
    )
    assert allowed.status_code == 200, allowed.text
    assert all(a["steering"]["composed"] for a in allowed.json()["active"])
    resp = chat(srv.base_url)
    expected = sorted(
        [
            (first["id"], {"id": first["id"], "intensity": "1.0", "composed": True}),
            (second["id"], {"id": second["id"], "intensity": "1.0", "composed": True}),
        ]
    )
    assert members(resp.headers["x-millm-steering"]) == [("circuit", params) for _, params in expected]  # ordered by id
    layer1 = [(sae_paths["beta"], B1), (sae_paths["beta"], [(20, 5.0)])]
    assert content(resp) == reference(tiny_engine, {0: (sae_paths["alpha"], A0), 1: layer1})
    # Both steer, so the rung header is sent: the lowest of their rungs (second has no edges: 0).
    assert rung(resp.headers["x-millm-circuit-rung"]) == (0, {"language": LADDER[0]})


def test_slice_fallback_steers_with_the_backing_cluster(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    cluster = {
        "name": "calm",
        "sae": {"layer": 0, "n_features": 48},
        "members": [{"feature_idx": 5, "strength": 2.0}, {"feature_idx": 8, "strength": -3.0}],
    }
    assert httpx.post(srv.base_url + "/api/clusters/import", json=cluster).status_code == 201
    circuit = imported(srv.base_url, document("wide", {0: ("alpha", A0), 1: ("gamma", B1)}, backing_cluster="calm"), activate=True)
    calm = [(5, 2.0), (8, -3.0)]
    resp = chat(srv.base_url)
    assert content(resp) == reference(tiny_engine, {0: (sae_paths["alpha"], calm)})
    assert members(resp.headers["x-millm-steering"]) == [
        (
            "profile",
            {
                "name": "calm",
                "source": "active",
                "intensity": "1.0",
                "sae": "alpha",
                "layer": 0,
                "features": 2,
                "hash": spec_hash("alpha", calm),
            },
        )
    ]
    assert "x-millm-circuit-rung" not in resp.headers
    [active] = httpx.get(srv.base_url + "/api/circuits/active").json()["active"]
    assert active["steering"] == {
        "steers": False, "mode": "slice_fallback", "applied_as": "profile", "intensity": 1.0, "composed": False, "layers": [0], "reason": "slice_fallback",
    }  # fmt: skip
    # The cluster rule applies: below the 0.5 floor is honoured, and "min" is that floor.
    for dial, expected in ((0.1, 0.1), ("min", 0.5)):
        dialled = chat(srv.base_url, steering_intensity=dial)
        [(kind, params)] = members(dialled.headers["x-millm-steering"])
        assert (kind, float(params["intensity"]), params["hash"]) == ("profile", expected, spec_hash("alpha", scaled(calm, expected)))
    # With every SAE attached the same circuit serves in full.
    assert httpx.post(srv.base_url + "/api/saes/gamma/attach", json={"layer": 1}).status_code == 200
    try:
        full = chat(srv.base_url)
        assert members(full.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0"})]
        assert content(full) == reference(tiny_engine, {0: (sae_paths["alpha"], A0), 1: (sae_paths["gamma"], B1)})
    finally:
        httpx.post(srv.base_url + "/api/saes/gamma/detach", json={})


def test_scoring_and_embeddings_suppress_every_layer_of_a_circuit(srv) -> None:  # type: ignore[no-untyped-def]
    score_body = {"model": "tiny", "prompt": "The sea is", "max_tokens": 1, "logprobs": 5}
    embed_body = {"model": "tiny", "input": "The sea is"}
    before = (
        httpx.post(srv.base_url + "/v1/completions", json=score_body).json(),
        httpx.post(srv.base_url + "/v1/embeddings", json=embed_body).json(),
    )
    imported(srv.base_url, document("loud", {0: ("alpha", [(3, 60.0)]), 1: ("beta", [(7, 60.0)])}), activate=True)
    assert members(chat(srv.base_url).headers["x-millm-steering"])[0][0] == "circuit"
    scored = httpx.post(srv.base_url + "/v1/completions", json=score_body)
    embedded = httpx.post(srv.base_url + "/v1/embeddings", json=embed_body)
    assert scored.json()["choices"] == before[0]["choices"] and members(scored.headers["x-millm-steering"]) == [("none", {})]
    assert "x-millm-circuit-rung" not in scored.headers
    assert embedded.json()["data"] == before[1]["data"]
    assert "x-millm-steering" not in embedded.headers and "x-millm-circuit-rung" not in embedded.headers


def test_a_circuit_steered_request_shares_a_batch_with_unsteered_ones(srv) -> None:  # type: ignore[no-untyped-def]
    imported(srv.base_url, two_layer(), activate=True)
    unsteered = {"steering": {"features": []}}
    solo = {"steered": content(chat(srv.base_url, max_tokens=40)), "plain": content(chat(srv.base_url, max_tokens=40, **unsteered))}
    assert solo["steered"] != solo["plain"]
    steps_before = int(scheduler_stats(srv.base_url)["steps"])
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(chat, srv.base_url, max_tokens=40, **({} if i % 2 else unsteered)) for i in range(6)]
        results = [job.result() for job in jobs]
    tokens = sum(resp.json()["usage"]["completion_tokens"] for resp in results)
    assert int(scheduler_stats(srv.base_url)["steps"]) - steps_before < tokens  # rows shared decode steps
    for i, resp in enumerate(results):
        assert content(resp) == solo["steered" if i % 2 else "plain"]
        assert resp.headers["x-millm-backend"] == "batched"
        assert ("x-millm-circuit-rung" in resp.headers) == bool(i % 2)


def test_a_stream_gets_the_rung_header_and_the_closing_report(srv) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, two_layer(), activate=True)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body) as resp:
        frames = [f for f in resp.read().decode().split("\n\n") if f]
    assert rung(resp.headers["x-millm-circuit-rung"]) == (2, {"language": LADDER[2]})  # sent with the headers, before the body
    assert "x-millm-steering" not in resp.headers and frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][len("data: ") :])
    assert last["choices"] == [] and members(last["millm_steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0"})]
    off = {**body, "steering_intensity": "off"}
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=off) as resp:
        resp.read()
    assert "x-millm-circuit-rung" not in resp.headers


def test_an_operator_write_during_a_request_is_reported_changed(srv) -> None:  # type: ignore[no-untyped-def]
    circuit = imported(srv.base_url, two_layer(), activate=True)
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 400, "n": 6, "temperature": 1.0, "seed": 1}
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["long"] = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
        result["done"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)  # admitted (its steering decided) well before the write
    assert httpx.put(srv.base_url + "/api/circuits/active/intensity", json={"intensity": 0.5}).status_code == 200
    written = time.monotonic()
    worker.join(120)
    assert result["done"] > written, "the request must outlast the write for this test to mean anything"
    long = result["long"]
    assert members(long.headers["x-millm-steering"]) == [
        ("circuit", {"id": circuit["id"], "intensity": "1.0", "changed": True})
    ]  # what ran
    after = chat(srv.base_url)
    assert members(after.headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "0.5"})]
    # Deactivating moves the epoch too; a write that changes nothing does not.
    epoch = httpx.get(srv.base_url + "/api/circuits/active").json()["epoch"]
    assert httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/activate", json={}).json()["epoch"] == epoch
    assert httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/deactivate", json={}).json()["epoch"] == epoch + 1
    assert httpx.delete(srv.base_url + f"/api/circuits/{circuit['id']}", headers=JSON).status_code == 200


def _across_a_write(base_url: str, write: Any) -> httpx.Response:
    """A long text completion with no steering fields, and ``write()`` (an operator write,
    returning its response) made while it runs: the completion's response."""
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 400, "n": 6, "temperature": 1.0, "seed": 1}
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["long"] = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        result["done"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)  # admitted (its steering decided) well before the write
    done = write()
    assert done.status_code in (200, 201), done.text
    written = time.monotonic()
    worker.join(120)
    assert result["done"] > written, "the request must outlast the write for this test to mean anything"
    long: httpx.Response = result["long"]
    return long


def test_activating_a_circuit_during_a_request_that_ran_without_one_is_reported_changed(srv) -> None:  # type: ignore[no-untyped-def]
    """The circuits epoch moved while the request ran: it ran unsteered (``none``), and the
    report says an operator changed the steering meanwhile, as it does for a profile
    activated mid-request."""
    circuit = imported(srv.base_url, two_layer())
    long = _across_a_write(srv.base_url, lambda: httpx.post(srv.base_url + f"/api/circuits/{circuit['id']}/activate", json={}))
    assert members(long.headers["x-millm-steering"]) == [("none", {"changed": True})]
    assert "x-millm-circuit-rung" not in long.headers  # decided before the write: no circuit ran
    assert members(chat(srv.base_url).headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0"})]


def test_a_write_to_the_backing_cluster_during_a_slice_fallback_request_is_reported_changed(srv) -> None:  # type: ignore[no-untyped-def]
    """In slice_fallback the backing cluster's own dial decides what the circuit applies;
    turning it mid-request changes the steering without moving either epoch."""
    cluster = {"name": "calm", "sae": {"layer": 0, "n_features": 48}, "members": [{"feature_idx": 5, "strength": 2.0}]}
    assert httpx.post(srv.base_url + "/api/clusters/import", json=cluster).status_code == 201
    imported(srv.base_url, document("wide", {0: ("alpha", A0), 1: ("gamma", B1)}, backing_cluster="calm"), activate=True)
    long = _across_a_write(srv.base_url, lambda: httpx.put(srv.base_url + "/api/clusters/calm/intensity", json={"intensity": 0.5}))
    [(kind, params)] = members(long.headers["x-millm-steering"])
    assert (kind, params["name"], params["intensity"], params.get("changed")) == ("profile", "calm", "1.0", True)  # what ran
    [(_, after)] = members(chat(srv.base_url).headers["x-millm-steering"])
    assert (after["intensity"], "changed" in after) == ("0.5", False)


def test_a_circuit_and_manual_values_at_one_layer_add_up(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """The shared-layer case the test above names but does not reach: the circuit's vector and
    the manual values' vector are summed at layer 0, neither replacing the other."""
    circuit = imported(srv.base_url, two_layer(), activate=True)
    manual = [(9, 5.0)]
    put = httpx.put(srv.base_url + "/api/steering", json={"sae_id": "alpha", "features": [{"index": i, "strength": s} for i, s in manual]})
    assert put.status_code == 200, put.text
    resp = chat(srv.base_url)
    summed = reference(tiny_engine, {0: [(sae_paths["alpha"], manual), (sae_paths["alpha"], A0)], 1: (sae_paths["beta"], B1)})
    assert content(resp) == summed
    assert summed != reference(tiny_engine, {0: (sae_paths["alpha"], A0), 1: (sae_paths["beta"], B1)})  # the manual values matter
    assert members(resp.headers["x-millm-steering"]) == [
        ("circuit", {"id": circuit["id"], "intensity": "1.0"}),
        ("manual", {"sae": "alpha", "layer": 0, "features": 1, "hash": spec_hash("alpha", manual)}),
    ]


def test_composed_circuits_are_listed_by_id_whatever_order_they_were_imported_and_activated_in(srv) -> None:  # type: ignore[no-untyped-def]
    """Ids are random, so circuits are imported until three came out with falling ids; they
    are activated in that (import) order, so neither order is the ids' order, and the
    header must still list them by id."""
    made: list[str] = []
    chosen: list[str] | None = None
    for n in range(40):  # a random order of 40 holds a falling run of three all but surely
        made.append(imported(srv.base_url, document(f"c{n}", {1: ("beta", [(n, 1.0 + n / 10)])}))["id"])
        chosen = next(
            ([a, b, c] for i, a in enumerate(made) for j, b in enumerate(made[i + 1 :], i + 1) for c in made[j + 1 :] if a > b > c),
            None,
        )
        if chosen is not None:
            break
    assert chosen is not None and chosen == sorted(chosen, reverse=True)
    for circuit_id in chosen:  # the highest id first
        done = httpx.post(
            srv.base_url + f"/api/circuits/{circuit_id}/activate", json={"allow_overlap": True, "acknowledge_unvalidated": True}
        )
        assert done.status_code == 200, done.text
    resp = chat(srv.base_url)
    assert resp.status_code == 200, resp.text
    listed = members(resp.headers["x-millm-steering"])
    assert listed == [("circuit", {"id": i, "intensity": "1.0", "composed": True}) for i in sorted(chosen)]
    assert [params["id"] for _, params in listed] == list(reversed(chosen))  # the reverse of activation order
    assert httpx.get(srv.base_url + "/api/circuits/active").json()["steering"] == resp.headers["x-millm-steering"]


def test_per_request_dials_on_circuit_steered_rows_of_one_shared_batch(srv, tiny_engine, sae_paths: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Rows dialled 0.5, 1.5 and off while a circuit is active share decode steps; each
    row's text and ``X-miLLM-Steering`` equal its own request run alone."""
    circuit = imported(srv.base_url, two_layer(), activate=True)
    dials: list[Any] = [0.5, 1.5, "off"]
    tokens = 40
    solo = {str(d): chat(srv.base_url, max_tokens=tokens, steering_intensity=d) for d in dials}
    for dial, lam in ((0.5, 0.5), (1.5, 1.5)):
        assert content(solo[str(dial)]) == reference(
            tiny_engine, {0: (sae_paths["alpha"], scaled(A0, lam)), 1: (sae_paths["beta"], scaled(B1, lam))}, max_new_tokens=tokens
        )
        assert members(solo[str(dial)].headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": str(lam)})]
    assert content(solo["off"]) == reference(tiny_engine, {}, max_new_tokens=tokens)
    assert members(solo["off"].headers["x-millm-steering"]) == [("none", {})]
    assert len({content(r) for r in solo.values()}) == 3  # the dials make three different texts: a leak would show
    steps_before = int(scheduler_stats(srv.base_url)["steps"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(chat, srv.base_url, max_tokens=tokens, steering_intensity=dial) for dial in dials]
        results = [job.result() for job in jobs]
    steps = int(scheduler_stats(srv.base_url)["steps"]) - steps_before
    counts = [resp.json()["usage"]["completion_tokens"] for resp in results]
    assert steps < sum(counts)  # rows shared decode steps
    # A row that shared no step with another needed its own steps on top of the longest other
    # row's: fewer steps than that for every row means each shared steps with a differently dialled one.
    assert steps < min(counts[r] + max(c for s, c in enumerate(counts) if s != r) for r in range(3)), (steps, counts)
    for dial, resp in zip(dials, results, strict=True):
        alone = solo[str(dial)]
        assert content(resp) == content(alone), dial
        assert resp.headers["x-millm-steering"] == alone.headers["x-millm-steering"]
        assert resp.headers["x-millm-steering-intensity"] == alone.headers["x-millm-steering-intensity"]
        assert ("x-millm-circuit-rung" in resp.headers) == (dial != "off")
        assert resp.headers["x-millm-backend"] == "batched"


def test_a_circuit_whose_sae_was_re_registered_at_another_width_does_not_steer(make_server, tiny_engine, sae_paths: dict[str, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An SAE id registered again with another width is another SAE, even when the
    circuit's feature indices still fit in it: the circuit reports width_mismatch and
    steers nothing (never claims a validated circuit on SAEs it was not validated on)."""
    import numpy as np
    from safetensors.numpy import save_file

    from .conftest import setup_saes

    d_model = tiny_engine.info.d_model
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    rng = np.random.default_rng(7)
    arrays = {"W_enc": rng.normal(size=(d_model, 32)), "b_enc": np.zeros(32), "W_dec": rng.normal(size=(32, d_model)), "b_dec": np.zeros(d_model)}
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(narrow / "sae_weights.safetensors"))
    (narrow / "cfg.json").write_text(json.dumps({"d_in": d_model, "d_sae": 32, "architecture": "standard"}))
    with make_server() as srv:
        setup_saes(srv.base_url, sae_paths)
        circuit = imported(srv.base_url, document("c", {0: ("alpha", [(3, 2.0)]), 1: ("beta", [(5, -1.0)])}, rungs=[2]), activate=True)
        assert members(chat(srv.base_url).headers["x-millm-steering"]) == [("circuit", {"id": circuit["id"], "intensity": "1.0"})]
        assert httpx.delete(srv.base_url + "/api/saes/alpha", headers=JSON).status_code == 200
        assert httpx.post(srv.base_url + "/api/saes", json={"path": str(narrow), "id": "alpha"}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/alpha/attach", json={"layer": 0}).status_code == 200
        [active] = httpx.get(srv.base_url + "/api/circuits/active").json()["active"]
        assert (active["steering"]["steers"], active["steering"]["reason"]) == (False, "width_mismatch")
        resp = chat(srv.base_url)
        assert "circuit" not in resp.headers["x-millm-steering"] and "x-millm-circuit-rung" not in resp.headers
        assert content(resp) == reference(tiny_engine, {})
