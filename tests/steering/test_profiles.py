"""Manual values, profiles, clusters and the intensity dial on a real server: the text they
produce (against a hand-written HF hook), the report and its hash, the epoch, and what
survives a restart."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .test_inline import chat, hf_reference, parse, spec_hash
from .test_sae_api import D_SAE, JSON, write_sae

FEATURES = [(3, 6.0), (17, -4.5)]


def features(pairs: list[tuple[int, float]]) -> list[dict[str, Any]]:
    return [{"index": i, "strength": s} for i, s in pairs]


def cluster_doc(name: str, members: list[tuple[int, float]], intensity_range: list[float] | None = None, **extra: Any) -> dict[str, Any]:
    budget: dict[str, Any] = {"intensity": 1.0}
    if intensity_range is not None:
        budget["intensity_range"] = intensity_range
    return {"name": name, "sae": {"layer": 1, "n_features": D_SAE}, "members": [{"feature_idx": i, "strength": s} for i, s in members], "budget": budget, **extra}


@pytest.fixture(scope="module")
def saes(tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("profile-saes")
    return {name: write_sae(folder / name, tiny_engine.info.d_model, seed=len(name)) for name in ("alpha", "beta")}


@pytest.fixture(scope="module")
def live_server(make_server, saes: dict[str, str]) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    with make_server() as srv:
        for name, path in saes.items():
            assert httpx.post(srv.base_url + "/api/saes", json={"path": path, "id": name}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/alpha/attach", json={"layer": 1}).status_code == 200
        yield srv


@pytest.fixture
def srv(live_server: Any) -> Iterator[Any]:
    """The module's server, with global steering switched off and profiles removed after
    each test."""
    yield live_server
    httpx.delete(live_server.base_url + "/api/steering", headers=JSON)
    for profile in httpx.get(live_server.base_url + "/api/profiles").json()["data"]:
        httpx.delete(live_server.base_url + "/api/profiles/" + profile["name"], headers=JSON)


def text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_manual_values_steer_every_plain_request_until_cleared(srv, tiny_engine, saes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    before = httpx.get(srv.base_url + "/api/steering").json()
    put = httpx.put(srv.base_url + "/api/steering", json={"sae_id": "alpha", "features": features(FEATURES)})
    assert put.status_code == 200, put.text
    assert put.json()["epoch"] > before["epoch"]
    assert put.json()["manual"] == [{"sae_id": "alpha", "layer": 1, "features": features(sorted(FEATURES))}]
    resp = chat(srv)
    assert text(resp) == hf_reference(tiny_engine, saes["alpha"], FEATURES)
    [(kind, params)] = parse(resp.headers["x-millm-steering"])
    assert (kind, params) == ("manual", {"sae": "alpha", "layer": 1, "features": 2, "hash": spec_hash("alpha", FEATURES)})
    assert put.json()["steering"] == resp.headers["x-millm-steering"]  # GET/PUT say what a plain request gets
    # A request's own fields replace the live values for that request only.
    assert chat(srv, steering={"features": []}).headers["x-millm-steering"] == "none"
    cleared = httpx.delete(srv.base_url + "/api/steering", headers=JSON)
    assert cleared.json()["manual"] == [] and cleared.json()["steering"] == "none"
    assert chat(srv).headers["x-millm-steering"] == "none"


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"sae_id": "alpha", "features": [{"index": D_SAE, "strength": 1.0}]}, 400, "invalid_feature_index", "features[0].index"),
        ({"sae_id": "beta", "features": [{"index": 1, "strength": 1.0}]}, 400, "sae_not_attached", "layer"),
        ({"sae_id": "alpha", "layer": 0, "features": [{"index": 1, "strength": 1.0}]}, 400, "sae_not_attached", "layer"),
        ({"sae_id": "nope", "features": []}, 404, "sae_not_found", "id"),
        ({"sae_id": "alpha", "features": [{"index": 1, "strength": 1.0}, {"index": 1, "strength": 2.0}]}, 400, "invalid_parameter", "features[1].index"),
        ({"sae_id": "alpha", "features": [{"index": 1}]}, 400, "invalid_parameter", "features[0].strength"),  # the missing field
    ],
)
def test_manual_value_refusals(srv, body: dict[str, Any], status: int, code: str, param: str) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.put(srv.base_url + "/api/steering", json=body)
    assert resp.status_code == status, resp.text
    assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, param)
    assert httpx.get(srv.base_url + "/api/steering").json()["manual"] == []


def test_profile_lifecycle_and_refusals(srv) -> None:  # type: ignore[no-untyped-def]
    api = srv.base_url + "/api/profiles"
    body = {"name": "sea-calm", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)}
    created = httpx.post(api, json=body)
    assert created.status_code == 201, created.text
    assert created.json() == {**body, "active": False, "cluster": None}
    assert httpx.post(api, json=body).json()["error"]["code"] == "profile_exists"
    assert httpx.post(api, json=body).status_code == 409
    assert [p["name"] for p in httpx.get(api).json()["data"]] == ["sea-calm"]
    assert httpx.get(api + "/sea-calm").json()["features"] == features(FEATURES)
    for bad, status, code in [
        ({**body, "name": "active"}, 400, "invalid_parameter"),
        ({**body, "name": "x", "sae_id": "missing"}, 404, "sae_not_found"),
        ({**body, "name": "x/y"}, 400, "invalid_parameter"),
        ({**body, "name": "x", "features": features([(D_SAE + 1, 1.0)])}, 400, "invalid_feature_index"),
        ({**body, "name": "x", "cluster": {"intensity": 1.0}}, 400, "invalid_parameter"),
    ]:
        resp = httpx.post(api, json=bad)
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), resp.text
    assert httpx.delete(api + "/sea-calm", headers=JSON).status_code == 200
    gone = httpx.get(api + "/sea-calm")
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "profile_not_found")


def test_request_profile_steers_that_request_and_reports_it(srv, tiny_engine, saes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/profiles", json={"name": "mer calme ☀", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)})
    resp = chat(srv, profile="mer calme ☀")
    assert text(resp) == hf_reference(tiny_engine, saes["alpha"], FEATURES)
    [(kind, params)] = parse(resp.headers["x-millm-steering"])
    assert kind == "profile"
    assert params == {
        "name": "mer calme %E2%98%80",
        "source": "request",
        "intensity": "1.0",
        "sae": "alpha",
        "layer": 1,
        "features": 2,
        "hash": spec_hash("alpha", FEATURES),
    }
    assert "x-millm-steering-intensity" not in resp.headers  # no dial in the request
    assert chat(srv).headers["x-millm-steering"] == "none"  # the global state was never written
    missing = chat(srv, profile="no-such-profile")
    assert (missing.status_code, missing.json()["error"]["code"], missing.json()["error"]["param"]) == (404, "profile_not_found", "profile")


def test_profile_for_an_unattached_sae_is_refused_and_without_any_sae_runs_unsteered(srv, make_server, saes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/profiles", json={"name": "on-beta", "sae_id": "beta", "layer": 0, "features": features(FEATURES)})
    refused = chat(srv, profile="on-beta")
    assert (refused.status_code, refused.json()["error"]["code"], refused.json()["error"]["param"]) == (400, "sae_not_attached", "profile")
    with make_server() as bare:  # nothing attached
        httpx.post(bare.base_url + "/api/saes", json={"path": saes["beta"], "id": "beta"})
        httpx.post(bare.base_url + "/api/profiles", json={"name": "on-beta", "sae_id": "beta", "layer": 0, "features": features(FEATURES)})
        plain, unsteered = chat(bare), chat(bare, profile="on-beta", steering_intensity=1.0)
        assert unsteered.status_code == 200 and unsteered.headers["x-millm-steering"] == "none"
        assert "x-millm-steering-intensity" not in unsteered.headers
        assert text(unsteered) == text(plain)


def test_active_profile_applies_to_plain_requests_and_a_request_profile_replaces_it(srv, tiny_engine, saes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    api = srv.base_url + "/api/profiles"
    httpx.post(api, json={"name": "a", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)})
    httpx.post(api, json={"name": "b", "sae_id": "alpha", "layer": 1, "features": features([(30, 5.0)])})
    assert httpx.get(api + "/active").json() == {"active": None}
    activated = httpx.post(api + "/a/activate", json={})
    assert activated.status_code == 200 and activated.json()["active_profile"] == {"name": "a", "sae_id": "alpha", "layer": 1}
    assert httpx.get(api + "/active").json()["active"]["name"] == "a"
    plain = chat(srv)
    assert text(plain) == hf_reference(tiny_engine, saes["alpha"], FEATURES)
    [(kind, params)] = parse(plain.headers["x-millm-steering"])
    assert (kind, params["name"], params["source"], params["hash"]) == ("profile", "a", "active", spec_hash("alpha", FEATURES))
    other = chat(srv, profile="b")
    assert text(other) == hf_reference(tiny_engine, saes["alpha"], [(30, 5.0)])
    assert parse(other.headers["x-millm-steering"])[0][1]["source"] == "request"
    assert httpx.post(api + "/deactivate", json={}).json()["active_profile"] is None
    assert chat(srv).headers["x-millm-steering"] == "none"
    # Deleting the active profile deactivates it; activating one on an unattached SAE is refused.
    httpx.post(api + "/a/activate", json={})
    httpx.delete(api + "/a", headers=JSON)
    assert httpx.get(api + "/active").json() == {"active": None}
    httpx.post(api, json={"name": "beta0", "sae_id": "beta", "layer": 0, "features": features(FEATURES)})
    assert httpx.post(api + "/beta0/activate", json={}).json()["error"]["code"] == "sae_not_attached"


def test_scoring_and_embeddings_ignore_an_active_profile(srv) -> None:  # type: ignore[no-untyped-def]
    score_body = {"model": "tiny", "prompt": "The sea is", "max_tokens": 1, "logprobs": 5}
    embed_body = {"model": "tiny", "input": "The sea is"}
    before = (httpx.post(srv.base_url + "/v1/completions", json=score_body).json(), httpx.post(srv.base_url + "/v1/embeddings", json=embed_body).json())
    httpx.post(srv.base_url + "/api/profiles", json={"name": "strong", "sae_id": "alpha", "layer": 1, "features": features([(4, 40.0)])})
    httpx.post(srv.base_url + "/api/profiles/strong/activate", json={})
    assert chat(srv).headers["x-millm-steering"].startswith("profile;")
    scored = httpx.post(srv.base_url + "/v1/completions", json=score_body)
    embedded = httpx.post(srv.base_url + "/v1/embeddings", json=embed_body)
    assert scored.headers["x-millm-steering"] == "none" and scored.json()["choices"] == before[0]["choices"]
    assert "x-millm-steering" not in embedded.headers and embedded.json()["data"] == before[1]["data"]


def test_export_and_import_round_trip_into_another_server(srv, make_server, saes: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/profiles", json={"name": "p1", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)})
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("c1", [(5, 2.0)], [0.5, 1.5]))
    document = httpx.get(srv.base_url + "/api/profiles/export").json()
    assert document["format"] == "millm.profile/v1" and [p["name"] for p in document["profiles"]] == ["c1", "p1"]
    assert httpx.get(srv.base_url + "/api/profiles/p1/export").json()["profiles"] == [document["profiles"][1]]
    with make_server() as other:
        refused = httpx.post(other.base_url + "/api/profiles/import", json=document)
        assert (refused.status_code, refused.json()["error"]["code"], refused.json()["error"]["param"]) == (404, "sae_not_found", "profiles[0].sae_id")
        httpx.post(other.base_url + "/api/saes", json={"path": saes["alpha"], "id": "alpha"})
        imported = httpx.post(other.base_url + "/api/profiles/import", json=document)
        assert imported.status_code == 201 and imported.json() == {"imported": ["c1", "p1"]}
        assert httpx.get(other.base_url + "/api/profiles/export").json() == document
        again = httpx.post(other.base_url + "/api/profiles/import", json=document)
        assert (again.status_code, again.json()["error"]["code"]) == (409, "profile_exists")
        for unclear in ("maybe", ""):  # neither true nor false: refused, never read as false
            vague = httpx.post(other.base_url + f"/api/profiles/import?replace={unclear}", json=document)
            assert (vague.status_code, vague.json()["error"]["param"]) == (400, "replace"), vague.text
            vague = httpx.post(other.base_url + f"/api/clusters/import?replace={unclear}", json=cluster_doc("c1", [(5, 2.0)]))
            assert (vague.status_code, vague.json()["error"]["param"]) == (400, "replace"), vague.text
        assert httpx.post(other.base_url + "/api/profiles/import?replace=true", json=document).status_code == 201
        assert httpx.post(other.base_url + "/api/profiles/import?replace=off", json=document).status_code == 409


# ------------------------------------------------------------------ clusters and the dial


def test_cluster_import_binds_to_the_attached_sae_and_reports_what_it_kept(srv) -> None:  # type: ignore[no-untyped-def]
    doc = cluster_doc("calm", [(5, 2.0), (9, 3.0)], [0.5, 1.5], description="from a notebook")
    doc["members"][1]["sign"] = -1
    created = httpx.post(srv.base_url + "/api/clusters/import", json=doc)
    assert created.status_code == 201, created.text
    assert created.json()["sae_id"] == "alpha" and created.json()["features"] == features([(5, 2.0), (9, -3.0)])
    assert created.json()["cluster"] == {"intensity": 1.0, "intensity_range": [0.5, 1.5], "n_features": D_SAE}  # the width it binds to
    assert created.json()["ignored_fields"] == ["description"]
    assert [c["name"] for c in httpx.get(srv.base_url + "/api/clusters").json()["data"]] == ["calm"]
    wrong_width = httpx.post(srv.base_url + "/api/clusters/import", json={**cluster_doc("w", [(1, 1.0)]), "sae": {"layer": 1, "n_features": D_SAE + 1}})
    assert (wrong_width.status_code, wrong_width.json()["error"]["code"]) == (400, "sae_not_attached")
    bad_member = httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("m", [(D_SAE, 1.0)]))
    assert (bad_member.status_code, bad_member.json()["error"]["code"], bad_member.json()["error"]["param"]) == (400, "invalid_feature_index", "members[0].feature_idx")
    twice = httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("t", [(1, 1.0), (1, 2.0)]))
    assert (twice.status_code, twice.json()["error"]["param"]) == (400, "members[1].feature_idx")  # the document's own key
    # Keys a cluster document's parts do not declare are refused (a named SAE would bind nothing).
    named_sae = httpx.post(srv.base_url + "/api/clusters/import", json={**cluster_doc("n", [(1, 1.0)]), "sae": {"layer": 1, "n_features": D_SAE, "sae_id": "x"}})
    assert (named_sae.status_code, named_sae.json()["error"]["param"]) == (400, "sae.sae_id"), named_sae.text
    # A stored dial within the bounds PUT …/intensity takes: [0, the declared maximum].
    over = httpx.post(srv.base_url + "/api/clusters/import", json={**cluster_doc("o", [(1, 1.0)], [0.5, 1.0]), "budget": {"intensity": 1.9, "intensity_range": [0.5, 1.0]}})
    assert (over.status_code, over.json()["error"]["param"]) == (400, "budget.intensity"), over.text
    # Not sent, the dial starts at 1 within those bounds: never refused for what was not sent.
    unsent = httpx.post(srv.base_url + "/api/clusters/import", json={**cluster_doc("u", [(1, 1.0)]), "budget": {"intensity_range": [0.2, 0.6]}})
    assert unsent.status_code == 201 and unsent.json()["cluster"] == {"intensity": 0.6, "intensity_range": [0.2, 0.6], "n_features": D_SAE}, unsent.text
    # A declared range wholly beyond the dial's [0, 2] envelope leaves no λ to dial.
    beyond = httpx.post(srv.base_url + "/api/clusters/import", json={**cluster_doc("b", [(1, 1.0)]), "budget": {"intensity": 0.0, "intensity_range": [2.5, 3.0]}})
    assert (beyond.status_code, beyond.json()["error"]["code"], beyond.json()["error"]["param"]) == (400, "invalid_parameter", "budget.intensity_range"), beyond.text
    assert httpx.get(srv.base_url + "/api/clusters/b").status_code == 404
    huge = httpx.post(srv.base_url + "/api/profiles", json={"name": "h", "sae_id": "alpha", "layer": 2**64, "features": []})
    assert (huge.status_code, huge.json()["error"]["param"]) == (400, "layer"), huge.text
    httpx.post(srv.base_url + "/api/profiles", json={"name": "plain", "sae_id": "alpha", "layer": 1, "features": []})
    not_cluster = httpx.put(srv.base_url + "/api/clusters/plain/intensity", json={"intensity": 1.0})
    assert (not_cluster.status_code, not_cluster.json()["error"]["code"]) == (404, "cluster_not_found")


@pytest.mark.parametrize(
    ("dial", "declared", "expected"),
    [
        (0.5, [0.5, 1.5], 0.5),
        ("max", [0.5, 1.5], 1.5),
        ("min", [0.5, 1.5], 0.5),
        (1.9, [0.5, 1.5], 1.5),  # capped at the declared maximum, and the report says so
        (0.1, [0.5, 1.5], 0.1),  # dialing below the floor is honoured
        ("max", [0.2, 3.0], 2.0),  # the range is intersected with the [0, 2] envelope
        ("min", None, 0.5),  # no declared range: the configured floor (cluster_intensity_min)
        ("max", None, 2.0),
        (1.25, None, 1.25),
    ],
)
def test_request_dial_scales_the_cluster(srv, dial: Any, declared: list[float] | None, expected: float) -> None:  # type: ignore[no-untyped-def]
    members = [(5, 2.0), (9, -3.0), (11, 150.0)]
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("dialled", members, declared))
    resp = chat(srv, profile="dialled", steering_intensity=dial)
    assert resp.status_code == 200, resp.text
    [(kind, params)] = parse(resp.headers["x-millm-steering"])
    applied = [(i, s * expected) for i, s in members]
    assert float(resp.headers["x-millm-steering-intensity"]) == expected
    assert (kind, float(params["intensity"]), params["hash"]) == ("profile", expected, spec_hash("alpha", applied))
    clamped = sum(abs(s) > 200.0 for _, s in applied)
    assert params.get("clamped", 0) == clamped


def test_dial_off_turns_steering_off_without_validating_the_base(srv, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/profiles", json={"name": "on-beta", "sae_id": "beta", "layer": 0, "features": features(FEATURES)})
    plain = chat(srv)
    for off in ("off", 0):
        resp = chat(srv, profile="on-beta", steering_intensity=off)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-millm-steering"] == "none" and float(resp.headers["x-millm-steering-intensity"]) == 0.0
        assert text(resp) == text(plain)
    assert chat(srv, profile="on-beta", steering_intensity=0.01).json()["error"]["code"] == "sae_not_attached"
    missing = chat(srv, profile="nope", steering_intensity=0)  # a profile that does not exist is still named wrongly
    assert (missing.status_code, missing.json()["error"]["param"]) == (404, "profile")


@pytest.mark.parametrize("bad", [2.5, -0.1, "loud", True, "1.0"])
def test_invalid_dial_values(srv, bad: Any) -> None:  # type: ignore[no-untyped-def]
    resp = chat(srv, steering_intensity=bad)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == ("invalid_parameter", "steering_intensity")


def test_dial_only_requests_scale_the_active_cluster_or_the_manual_values(srv) -> None:  # type: ignore[no-untyped-def]
    plain = chat(srv, steering_intensity=1.5)
    assert plain.headers["x-millm-steering"] == "none" and "x-millm-steering-intensity" not in plain.headers  # empty base
    httpx.put(srv.base_url + "/api/steering", json={"features": features(FEATURES)})
    manual = chat(srv, steering_intensity="max")
    [(kind, params)] = parse(manual.headers["x-millm-steering"])
    assert (kind, params["hash"]) == ("manual", spec_hash("alpha", [(i, s * 2.0) for i, s in FEATURES]))
    assert float(manual.headers["x-millm-steering-intensity"]) == 2.0
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("live", [(5, 2.0)], [0.5, 1.5]))
    httpx.post(srv.base_url + "/api/clusters/live/activate", json={})
    dialled = chat(srv, steering_intensity=0.75)
    [(kind, params)] = parse(dialled.headers["x-millm-steering"])
    assert (kind, params["source"], params["intensity"], params["hash"]) == ("profile", "active", "0.75", spec_hash("alpha", [(5, 1.5)]))


def test_persistent_dial_applies_when_the_request_has_none_and_is_bounded(srv) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("kept", [(5, 2.0)], [0.5, 1.5]))
    httpx.post(srv.base_url + "/api/clusters/kept/activate", json={})
    epoch = httpx.get(srv.base_url + "/api/steering").json()["epoch"]
    set_ = httpx.put(srv.base_url + "/api/clusters/kept/intensity", json={"intensity": 0.25})
    assert set_.status_code == 200 and set_.json()["cluster"]["intensity"] == 0.25
    assert httpx.get(srv.base_url + "/api/steering").json()["epoch"] == epoch + 1
    [(_, params)] = parse(chat(srv).headers["x-millm-steering"])
    assert (params["intensity"], params["hash"]) == ("0.25", spec_hash("alpha", [(5, 0.5)]))
    for bad in (1.6, -1.0):
        resp = httpx.put(srv.base_url + "/api/clusters/kept/intensity", json={"intensity": bad})
        assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_parameter")
    assert httpx.post(srv.base_url + "/api/clusters/kept/deactivate", json={}).json()["active_profile"] is None


def test_a_cluster_capped_at_zero_echoes_the_intensity_it_resolved_to(srv) -> None:  # type: ignore[no-untyped-def]
    """The dial's echo follows the base, not what the λ applied: a cluster whose range caps
    it at 0 echoes 0.0 for any dial, as an explicit 0 does."""
    capped = {**cluster_doc("z0", [(5, 2.0)]), "budget": {"intensity": 0.0, "intensity_range": [0.0, 0.0]}}
    assert httpx.post(srv.base_url + "/api/clusters/import", json=capped).status_code == 201
    for dial in (1.5, "max", 0, "off"):
        resp = chat(srv, profile="z0", steering_intensity=dial)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-millm-steering"] == "none" and float(resp.headers["x-millm-steering-intensity"]) == 0.0, dial


def test_rewriting_a_dial_with_the_value_it_has_leaves_the_epoch(srv) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("same", [(5, 2.0)], [0.5, 1.5]))
    assert httpx.post(srv.base_url + "/api/clusters/same/activate", json={}).status_code == 200
    epoch = httpx.get(srv.base_url + "/api/steering").json()["epoch"]
    again = httpx.put(srv.base_url + "/api/clusters/same/intensity", json={"intensity": 1.0})  # the dial it has
    assert again.status_code == 200 and again.json()["cluster"]["intensity"] == 1.0, again.text
    assert httpx.get(srv.base_url + "/api/steering").json()["epoch"] == epoch  # nothing changed: no ;changed for requests in flight
    assert httpx.put(srv.base_url + "/api/clusters/same/intensity", json={"intensity": 0.5}).status_code == 200
    assert httpx.get(srv.base_url + "/api/steering").json()["epoch"] == epoch + 1


@pytest.mark.parametrize(
    "path",
    ["/api/profiles/calm/activate", "/api/clusters/calm/activate", "/api/clusters/calm/deactivate", "/api/profiles/deactivate"],
)
def test_activate_and_deactivate_refuse_a_body_they_do_not_take(srv, path: str) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/clusters/import", json=cluster_doc("calm", [(5, 2.0)]))
    epoch = httpx.get(srv.base_url + "/api/steering").json()["epoch"]
    unknown = httpx.post(srv.base_url + path, json={"force": True})
    assert (unknown.status_code, unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (400, "invalid_parameter", "force"), unknown.text
    garbage = httpx.post(srv.base_url + path, content="activate please", headers=JSON)
    assert garbage.status_code == 400 and set(garbage.json()["error"]) == {"message", "type", "param", "code"}, garbage.text
    assert httpx.get(srv.base_url + "/api/steering").json()["epoch"] == epoch  # nothing written
    assert httpx.post(srv.base_url + path, headers=JSON).status_code == 200  # no body, as before
    assert httpx.post(srv.base_url + path, json={}).status_code == 200


def _narrow_sae(folder: pathlib.Path, d_in: int, width: int) -> str:
    import json

    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    folder.mkdir()
    arrays = {"W_enc": rng.normal(size=(d_in, width)), "b_enc": np.zeros(width), "W_dec": rng.normal(size=(width, d_in)), "b_dec": np.zeros(d_in)}
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": width, "architecture": "standard"}))
    return str(folder)


def test_a_cluster_never_steers_an_sae_of_another_width_registered_under_its_id(make_server, tiny_engine, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """A cluster is bound to an SAE of its document's width: an SAE of another width
    registered under the same id later is another SAE, and the cluster is refused on it
    with 400 width_mismatch (the circuits' code), even where its indices still fit."""
    narrow = _narrow_sae(tmp_path / "narrow", tiny_engine.info.d_model, D_SAE // 2)
    with make_server() as server:
        api = server.base_url
        assert httpx.post(api + "/api/saes", json={"path": saes["alpha"], "id": "alpha"}).status_code == 201
        assert httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}).status_code == 200
        assert httpx.post(api + "/api/clusters/import", json=cluster_doc("wide", [(1, 4.0)])).status_code == 201
        exported = httpx.get(api + "/api/profiles/wide/export").json()
        assert exported["profiles"][0]["cluster"]["n_features"] == D_SAE
        assert parse(chat(server, profile="wide").headers["x-millm-steering"])[0][0] == "profile"
        assert httpx.delete(api + "/api/saes/alpha", headers=JSON).status_code == 200
        assert httpx.post(api + "/api/saes", json={"path": narrow, "id": "alpha"}).status_code == 201
        assert httpx.post(api + "/api/saes/alpha/attach", json={"layer": 1}).status_code == 200
        for refused in (
            chat(server, profile="wide"),
            chat(server, profile="wide", steering_intensity=1.5),
            httpx.post(api + "/api/clusters/wide/activate", json={}),
            httpx.post(api + "/api/profiles/wide/activate", json={}),
        ):
            error = refused.json()["error"]
            assert (refused.status_code, error["code"], error["param"]) == (400, "width_mismatch", "profile"), refused.text
            assert f"width {D_SAE}" in error["message"] and f"width {D_SAE // 2}" in error["message"]
        assert httpx.get(api + "/api/steering").json()["active_profile"] is None
        # Importing the export again checks the width it records against the SAE now registered.
        again = httpx.post(api + "/api/profiles/import?replace=true", json=exported)
        assert (again.status_code, again.json()["error"]["code"], again.json()["error"]["param"]) == (400, "width_mismatch", "profiles[0].cluster.n_features")
        # A circuit expanding the cluster on that SAE is refused the same way.
        circuit = {"name": "c", "saes": [{"sae_id": "alpha", "layer": 1}], "members": [{"layer": 1, "cluster": "wide"}]}
        expanded = httpx.post(api + "/api/circuits/import", json=circuit)
        assert (expanded.status_code, expanded.json()["error"]["code"], expanded.json()["error"]["param"]) == (400, "width_mismatch", "members[0].cluster")


def test_profiles_clusters_and_dials_survive_a_restart(make_server, saes: dict[str, str], tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        httpx.post(first.base_url + "/api/saes", json={"path": saes["alpha"], "id": "alpha"})
        httpx.post(first.base_url + "/api/saes/alpha/attach", json={"layer": 1})
        httpx.post(first.base_url + "/api/profiles", json={"name": "p", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)})
        httpx.post(first.base_url + "/api/clusters/import", json=cluster_doc("c", [(5, 2.0)], [0.5, 1.5]))
        httpx.put(first.base_url + "/api/clusters/c/intensity", json={"intensity": 0.75})
        httpx.post(first.base_url + "/api/profiles/p/activate", json={})
        saved = httpx.get(first.base_url + "/api/profiles").json()["data"]
    with make_server(db=db) as second:
        listed = httpx.get(second.base_url + "/api/profiles").json()["data"]
        assert saved == listed  # the active profile persists too
        assert httpx.get(second.base_url + "/api/clusters/c").json()["cluster"] == {"intensity": 0.75, "intensity_range": [0.5, 1.5], "n_features": D_SAE}
        assert httpx.get(second.base_url + "/api/saes/alpha").json()["attached_layers"] == [1]
        [(_, params)] = parse(chat(second, profile="c").headers["x-millm-steering"])
        assert params["intensity"] == "0.75"


# ------------------------------------------------------------------ the epoch


def test_a_request_overlapping_an_operator_write_reports_changed(srv) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 400, "n": 6, "temperature": 1.0, "seed": 1}
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["long"] = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
        result["done"] = time.monotonic()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)  # admitted (its steering decided) well before the write
    httpx.put(srv.base_url + "/api/steering", json={"features": features(FEATURES)})
    written = time.monotonic()
    worker.join(120)
    long = result["long"]
    assert result["done"] > written, "the request must outlast the write for this test to mean anything"
    assert parse(long.headers["x-millm-steering"]) == [("none", {"changed": True})]  # what ran, flagged
    after = chat(srv)
    assert [k for k, _ in parse(after.headers["x-millm-steering"])] == ["manual"] and "changed" not in after.headers["x-millm-steering"]


def test_members_are_ordered_by_layer_and_each_carries_changed(srv) -> None:  # type: ignore[no-untyped-def]
    httpx.post(srv.base_url + "/api/saes/beta/attach", json={"layer": 0})
    try:
        httpx.put(srv.base_url + "/api/steering", json={"sae_id": "alpha", "features": features([(1, 1.0)])})
        httpx.put(srv.base_url + "/api/steering", json={"sae_id": "beta", "features": features([(2, 2.0)])})
        members = parse(chat(srv).headers["x-millm-steering"])
        assert [(k, p["sae"], p["layer"]) for k, p in members] == [("manual", "beta", 0), ("manual", "alpha", 1)]
    finally:
        httpx.post(srv.base_url + "/api/saes/beta/detach", json={})
    assert [p["sae"] for _, p in parse(chat(srv).headers["x-millm-steering"])] == ["alpha"]  # detaching dropped beta's values
