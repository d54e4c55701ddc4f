"""Arming runs its gates in order — limit, model identity, evidence rung, basis, parity —
and each refusal is a 409 naming its gate (code, header and message), changing nothing.
Parity re-scores the test vectors on the server against scores computed here with the
model hooked in the test."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .helpers import JSON, Fitted, arm, import_probe, ok, sae_document, write_sae


@pytest.fixture(scope="module")
def sae_path(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_sae(tmp_path_factory.mktemp("probe-sae") / "sae", tiny_engine.info.d_model, seed=3)


@pytest.fixture
def api(probe_server: Any) -> Iterator[str]:
    yield probe_server.base_url
    for probe in httpx.get(probe_server.base_url + "/api/probes").json()["data"]:
        httpx.delete(f"{probe_server.base_url}/api/probes/{probe['id']}", headers=JSON)
    for sae in httpx.get(probe_server.base_url + "/api/saes").json()["data"]:
        httpx.delete(f"{probe_server.base_url}/api/saes/{sae['id']}", headers=JSON)


def refused(resp: httpx.Response, gate: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == 409, resp.text
    error = dict(resp.json()["error"])
    assert error["code"] == f"probe_gate_{gate}" and resp.headers["x-millm-probe-gate"] == gate
    assert f"the {gate} gate" in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def armed_ids(api: str) -> list[str]:
    return [p["id"] for p in ok(httpx.get(api + "/api/probes", params={"armed": "true"}))["data"]]


def test_a_probe_that_passes_every_gate_is_armed_with_its_parity(api: str, probe_server: Any, fitted: Fitted) -> None:
    import_probe(probe_server, fitted.document(probe_id="sea"))
    armed = ok(arm(probe_server, "sea", windows=["prompt", "last_user"]))["armed"]
    assert armed["windows"] == ["prompt", "last_user"] and armed["model"] == "tiny"
    assert armed["acknowledged_below_rung2"] is False
    parity = armed["parity"]
    assert parity["tolerance"] == 1e-3 and len(parity["vectors"]) == 3
    assert all(v["ok"] for v in parity["vectors"]) and parity["max_abs_error"] < 1e-5  # fp32 server vs the hooked reference
    assert armed_ids(api) == ["sea"]
    # Disarming, and arming again with other windows.
    assert ok(httpx.post(api + "/api/probes/sea/disarm", json={}))["armed"] is None
    assert armed_ids(api) == []
    assert ok(arm(probe_server, "sea"))["armed"]["windows"] == ["all"]


def test_a_tampered_test_vector_fails_the_parity_gate(api: str, probe_server: Any, fitted: Fitted) -> None:
    import_probe(probe_server, fitted.document(probe_id="tampered", tamper=0.05))
    error = refused(arm(probe_server, "tampered"), "parity", "test_vectors[2].expected")
    assert "test vector 2" in error["message"]
    assert armed_ids(api) == []
    # Within the tolerance it passes; a document may tighten the tolerance, never loosen it.
    import_probe(probe_server, fitted.document(probe_id="close", tamper=5e-4))
    assert arm(probe_server, "close").status_code == 200
    import_probe(probe_server, fitted.document(probe_id="strict", tamper=5e-4, parity_tolerance=1e-4))
    refused(arm(probe_server, "strict"), "parity", "test_vectors[2].expected")
    import_probe(probe_server, fitted.document(probe_id="lax", tamper=0.05, parity_tolerance=1.0))
    refused(arm(probe_server, "lax"), "parity", "test_vectors[2].expected")


def test_parity_needs_test_vectors_the_model_can_read(api: str, probe_server: Any, fitted: Fitted) -> None:
    import_probe(probe_server, fitted.document(probe_id="none", vectors=0))
    refused(arm(probe_server, "none"), "parity", "test_vectors")
    doc = fitted.document(probe_id="oov")
    doc["test_vectors"][1]["token_ids"] = [1, 5000]
    import_probe(probe_server, doc)
    refused(arm(probe_server, "oov"), "parity", "test_vectors[1].token_ids")


@pytest.mark.parametrize(
    ("field", "value"),
    [("chat_template_sha256", "0" * 64), ("chat_template_sha256", None), ("n_layers", 3), ("d_model", 65)],
)
def test_the_model_identity_gate(api: str, probe_server: Any, fitted: Fitted, field: str, value: Any) -> None:
    doc = fitted.document(probe_id="other-model")
    doc["model"][field] = value
    if field == "d_model":  # a residual head has d_model weights
        for part in (doc["head"]["weights"], doc["head"]["normalization"]["mean"], doc["head"]["normalization"]["std"]):
            part.append(1.0)
    import_probe(probe_server, doc)
    error = refused(arm(probe_server, "other-model"), "model_identity", f"model.{field}")
    assert "'tiny'" in error["message"]


def test_the_evidence_gate_needs_an_acknowledgement_below_rung_2(api: str, probe_server: Any, fitted: Fitted) -> None:
    import_probe(probe_server, fitted.document(probe_id="weak", rung=1))
    refused(arm(probe_server, "weak"), "evidence", "acknowledge_below_rung2")
    assert armed_ids(api) == []
    armed = ok(arm(probe_server, "weak", acknowledge_below_rung2=True))["armed"]
    assert armed["acknowledged_below_rung2"] is True


def test_the_basis_gate_needs_the_sae_attached_at_the_layer(api: str, probe_server: Any, tiny_engine: Any, sae_path: str) -> None:
    import_probe(probe_server, sae_document(tiny_engine, sae_path, "reader", "on-sae"))
    refused(arm(probe_server, "on-sae"), "basis", "basis.sae_id")  # not even registered
    ok(httpx.post(api + "/api/saes", json={"path": sae_path, "id": "reader"}), 201)
    ok(httpx.post(api + "/api/saes/reader/attach", json={"layer": 0}))
    refused(arm(probe_server, "on-sae"), "basis", "basis.sae_id")  # attached at another layer
    ok(httpx.post(api + "/api/saes/reader/attach", json={"layer": 1}))
    armed = ok(arm(probe_server, "on-sae"))["armed"]
    assert armed["parity"]["max_abs_error"] < 1e-5  # the SAE's encoding on the server equals the one written here
    import_probe(probe_server, sae_document(tiny_engine, sae_path, "reader", "too-wide", width=40))
    refused(arm(probe_server, "too-wide"), "basis", "head.weights")


def test_gates_run_in_order(make_server: Any, fitted: Fitted) -> None:
    with make_server(probes_max_armed=1) as srv:
        import_probe(srv, fitted.document(probe_id="first"))
        ok(arm(srv, "first"))
        both = fitted.document(probe_id="both", rung=0, tamper=0.5)
        both["model"]["n_layers"] = 5
        import_probe(srv, both)
        refused(arm(srv, "both"), "limit")  # before identity, evidence and parity
        assert ok(arm(srv, "first", windows=["response"]))["armed"]["windows"] == ["response"]  # re-arming counts once
        ok(httpx.post(srv.base_url + "/api/probes/first/disarm", json={}))
        refused(arm(srv, "both"), "model_identity")  # before evidence and parity
        import_probe(srv, fitted.document(probe_id="weak-and-wrong", rung=0, tamper=0.5))
        refused(arm(srv, "weak-and-wrong"), "evidence")  # before parity
        refused(arm(srv, "weak-and-wrong", acknowledge_below_rung2=True), "parity")


@pytest.mark.parametrize(("windows", "param"), [([], "windows"), (["all", "all"], "windows[1]"), (["everything"], "windows[0]")])
def test_bad_windows_are_a_400(api: str, probe_server: Any, fitted: Fitted, windows: list[str], param: str) -> None:
    import_probe(probe_server, fitted.document(probe_id="w"))
    resp = arm(probe_server, "w", windows=windows)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_a_refused_arming_keeps_the_previous_one(api: str, probe_server: Any, fitted: Fitted, tmp_path: pathlib.Path) -> None:
    import_probe(probe_server, fitted.document(probe_id="keep", rung=1))
    ok(arm(probe_server, "keep", acknowledge_below_rung2=True, windows=["prompt"]))
    refused(arm(probe_server, "keep", windows=["all"]), "evidence")
    assert ok(httpx.get(api + "/api/probes/keep"))["armed"]["windows"] == ["prompt"]
