"""Probe documents over HTTP: import, list, get, export (and import the export again),
delete; every malformed document is a 400 naming the path; the model identity the server
reports equals one computed here from the model's config and tokenizer."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from .helpers import JSON, Fitted, identity, import_probe, ok


@pytest.fixture
def api(probe_server: Any) -> Any:
    yield probe_server.base_url
    for probe in httpx.get(probe_server.base_url + "/api/probes").json()["data"]:
        httpx.delete(f"{probe_server.base_url}/api/probes/{probe['id']}", headers=JSON)


def contains(big: Any, small: Any) -> bool:
    """Every key of ``small`` is in ``big`` with an equal value (recursively)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    return bool(big == small)


def test_identity_is_the_models_own(probe_server: Any, tiny_engine: Any) -> None:
    got = ok(httpx.get(probe_server.base_url + "/api/probes/identity"))
    assert got == {"model": "tiny", **identity(tiny_engine)}
    other = ok(httpx.get(probe_server.base_url + "/api/probes/identity", params={"model": "tiny-no-template"}))
    assert other["chat_template_sha256"] is None
    assert httpx.get(probe_server.base_url + "/api/probes/identity", params={"model": "nope"}).status_code == 404


def test_import_list_get_export_delete(api: str, probe_server: Any, fitted: Fitted) -> None:
    doc = fitted.document("sea")
    created = import_probe(probe_server, doc)
    probe_id = created["id"]
    assert probe_id.startswith("sea-") and created["armed"] is None
    assert created["detector_digest"].startswith("sha256:") and created["test_vectors"] == 3
    assert ok(httpx.get(f"{api}/api/probes/{probe_id}")) == created
    assert [p["id"] for p in ok(httpx.get(api + "/api/probes"))["data"]] == [probe_id]
    assert ok(httpx.get(api + "/api/probes", params={"armed": "true"}))["data"] == []
    exported = ok(httpx.get(f"{api}/api/probes/{probe_id}/export"))
    assert contains(exported, {**doc, "id": probe_id}) and exported["head"]["link"] == "logistic"  # defaults written out
    # The export imports again as it is (under the id it carries): it exists already.
    again = httpx.post(api + "/api/probes/import", json=exported)
    assert again.status_code == 409 and again.json()["error"]["code"] == "probe_exists"
    assert ok(httpx.delete(f"{api}/api/probes/{probe_id}", headers=JSON)) == {"id": probe_id, "deleted": True}
    assert httpx.get(f"{api}/api/probes/{probe_id}").status_code == 404
    assert import_probe(probe_server, exported)["detector_digest"] == created["detector_digest"]


def test_digests_follow_what_they_name(api: str, probe_server: Any, fitted: Fitted) -> None:
    base = import_probe(probe_server, fitted.document("a", probe_id="a"))
    other_decision = import_probe(probe_server, fitted.document("b", probe_id="b", decision={"threshold": 0.7}))
    other_head = fitted.document("c", probe_id="c")
    other_head["head"]["bias"] += 1.0
    changed = import_probe(probe_server, other_head)
    assert other_decision["detector_digest"] == base["detector_digest"] != changed["detector_digest"]
    assert other_decision["decision_digest"] != base["decision_digest"] == changed["decision_digest"]


def _broken(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    where = out
    for part in parents:
        where = where[part]
    if value is KeyError:
        del where[last]
    else:
        where[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "param"),
    [
        ("layer", 2, "layer"),  # the tiny model has layers 0 and 1
        ("head.weights", [0.1] * 63, "head.weights"),
        ("head.normalization.std", [0.0] * 64, "head.normalization.std[0]"),
        ("head.normalization.mean", [0.0] * 3, "head.normalization.mean"),
        ("head.bias", float("inf"), None),  # JSON cannot carry it: refused as invalid JSON
        ("head.link", "softmax", "head.link"),
        ("aggregation", "median", "aggregation"),
        ("decision.windows", {"everything": 0.3}, "decision.windows"),  # a bad key: the mapping, and the message names the key
        ("evidence.rung", 4, "evidence.rung"),
        ("model.chat_template_sha256", "ABC", "model.chat_template_sha256"),
        ("basis", {"kind": "sae_features"}, "basis.sae_id"),
        ("basis", {"kind": "residual", "sae_id": "x"}, "basis.sae_id"),
        ("id", "events", "id"),
        ("id", "has space", "id"),
        ("name", KeyError, "name"),  # a missing field
        ("surprise", 1, "surprise"),  # an unknown one
        ("test_vectors", [{"token_ids": [], "expected": 0.5}], "test_vectors[0].token_ids"),
        ("test_vectors", [{"token_ids": [-1], "expected": 0.5}], "test_vectors[0].token_ids[0]"),
        ("parity_tolerance", -1.0, "parity_tolerance"),
    ],
)
def test_a_malformed_document_is_a_400_naming_the_path(api: str, fitted: Fitted, path: str, value: Any, param: str) -> None:
    body = json.dumps(_broken(fitted.document("bad"), path, value)).replace("Infinity", "1e999")  # JSON has no infinity
    resp = httpx.post(api + "/api/probes/import", content=body, headers=JSON)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    if param is None:
        assert {"head.bias": "JSON", "decision.windows": "everything", "name": "`name`", "surprise": "`surprise`"}[path] in error["message"]
    assert ok(httpx.get(api + "/api/probes"))["data"] == []


def test_unknown_probe_and_bad_queries(api: str) -> None:
    for method, path in (("GET", "/api/probes/nope"), ("GET", "/api/probes/nope/export"), ("DELETE", "/api/probes/nope"),
                         ("POST", "/api/probes/nope/arm"), ("POST", "/api/probes/nope/disarm")):  # fmt: skip
        resp = httpx.request(method, api + path, headers=JSON, json={} if method == "POST" else None)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "probe_not_found", (path, resp.text)
    assert httpx.get(api + "/api/probes", params={"armed": "maybe"}).json()["error"]["param"] == "armed"
