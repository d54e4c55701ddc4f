"""Where the arithmetic runs: scoring at arming (parity) and on ``POST /api/probes/score``
encodes and multiplies on the model thread, one layer at a time, and a live row encodes a
long prompt a slice of positions at a time; an SAE that millm cannot encode faithfully is
refused at the ``basis`` gate and skipped on live traffic."""

from __future__ import annotations

import json
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from millm_plugins.probes.detector import ROWS
from millm_plugins.steering.sae import SAE

from .helpers import HELD_SEA, LAYER, arm, chat, chat_ids, hooked, import_probe, ok, sae_document, sae_encode, sigmoid, user, write_sae
from .test_gates import refused


@pytest.fixture(scope="module")
def sae_path(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_sae(tmp_path_factory.mktemp("thread-sae") / "sae", tiny_engine.info.d_model, seed=11)


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every ``SAE.encode`` call in this process: its thread's name and how many positions."""
    calls: list[tuple[str, int]] = []
    original = SAE.encode

    def encode(self: SAE, x: np.ndarray) -> np.ndarray:
        calls.append((threading.current_thread().name, len(x)))
        return original(self, x)

    monkeypatch.setattr(SAE, "encode", encode)
    return calls


@pytest.fixture(scope="module")
def srv(make_server: Any, sae_path: str) -> Iterator[Any]:
    with make_server() as server:
        ok(httpx.post(server.base_url + "/api/saes", json={"path": sae_path, "id": "reader"}), 201)
        ok(httpx.post(server.base_url + "/api/saes/reader/attach", json={"layer": LAYER}))
        yield server


def test_parity_and_score_encode_on_the_model_thread(srv: Any, tiny_engine: Any, sae_path: str, encodes: list[tuple[str, int]]) -> None:
    doc = sae_document(tiny_engine, sae_path, "reader", "on-thread")
    import_probe(srv, doc)
    ok(arm(srv, "on-thread"))
    assert encodes and {name for name, _ in encodes} == {"millm-scheduler"}  # parity
    encodes.clear()
    ids = chat_ids(tiny_engine, user(HELD_SEA[0]))
    scored = ok(httpx.post(srv.base_url + "/api/probes/score", json={"probe_ids": ["on-thread"], "inputs": [{"token_ids": ids}]}))
    w, b = np.array(doc["head"]["weights"]), doc["head"]["bias"]
    assert scored["data"][0]["score"] == pytest.approx(
        sigmoid(float((sae_encode(sae_path, hooked(tiny_engine, ids)) @ w + b).mean())), abs=1e-6
    )
    assert encodes and {name for name, _ in encodes} == {"millm-scheduler"}


def test_a_long_prompt_is_encoded_a_slice_at_a_time(srv: Any, tiny_engine: Any, sae_path: str, encodes: list[tuple[str, int]]) -> None:
    import_probe(srv, sae_document(tiny_engine, sae_path, "reader", "long"))
    ok(arm(srv, "long", windows=["prompt"]))
    text = " ".join(HELD_SEA) * 5
    ids = chat_ids(tiny_engine, user(text))
    assert len(ids) > ROWS + 10
    encodes.clear()
    resp = chat(srv, user(text), max_tokens=2)
    got = next(r for r in resp.json()["millm_probe_verdicts"] if r["probe"]["id"] == "long")
    doc = sae_document(tiny_engine, sae_path, "reader", "long")
    w, b = np.array(doc["head"]["weights"]), doc["head"]["bias"]
    assert got["score"] == pytest.approx(sigmoid(float((sae_encode(sae_path, hooked(tiny_engine, ids)) @ w + b).mean())), abs=1e-6)
    assert encodes and max(n for _, n in encodes) <= ROWS


def normalizing_copy(sae_path: str, folder: pathlib.Path) -> str:
    shutil.copytree(sae_path, folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "expected_average_only_in"}))
    return str(folder)


def test_an_sae_millm_cannot_encode_faithfully(make_server: Any, tiny_engine: Any, sae_path: str, tmp_path: pathlib.Path) -> None:
    normalizing = normalizing_copy(sae_path, tmp_path / "norm")
    with make_server() as server:
        api = server.base_url
        ok(httpx.post(api + "/api/saes", json={"path": normalizing, "id": "norm"}), 201)
        ok(httpx.post(api + "/api/saes/norm/attach", json={"layer": LAYER}))
        import_probe(server, sae_document(tiny_engine, sae_path, "norm", "refused"))
        error = refused(arm(server, "refused"), "basis", "basis.sae_id")
        assert "normalize_activations" in error["message"]
        # Armed on a faithful SAE, which is then replaced under its id by one that is not: skipped, not scored.
        ok(httpx.post(api + "/api/saes", json={"path": sae_path, "id": "swap"}), 201)
        ok(httpx.post(api + "/api/saes/swap/attach", json={"layer": LAYER}))
        import_probe(server, sae_document(tiny_engine, sae_path, "swap", "swapped"))
        ok(arm(server, "swapped"))
        assert (
            next(r for r in chat(server, user(HELD_SEA[0])).json()["millm_probe_verdicts"] if r["probe"]["id"] == "swapped")["outcome"]
            == "scored"
        )
        ok(httpx.post(api + "/api/saes/swap/detach", json={}))
        ok(httpx.delete(api + "/api/saes/swap", headers={"Content-Type": "application/json"}))
        ok(httpx.post(api + "/api/saes", json={"path": normalizing, "id": "swap"}), 201)
        ok(httpx.post(api + "/api/saes/swap/attach", json={"layer": LAYER}))
        got = next(r for r in chat(server, user(HELD_SEA[0])).json()["millm_probe_verdicts"] if r["probe"]["id"] == "swapped")
        assert (got["outcome"], got["reason"], got["score"]) == ("skipped", "sae_not_attached", None)
        body = {"probe_ids": ["swapped"], "inputs": [{"token_ids": chat_ids(tiny_engine, user(HELD_SEA[0]))}]}
        scored = ok(httpx.post(api + "/api/probes/score", json=body))["data"][0]
        assert (scored["outcome"], scored["reason"]) == ("skipped", "sae_not_attached")
