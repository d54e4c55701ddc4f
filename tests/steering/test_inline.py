"""Inline steering end to end: the rules, the text, the report and its hash."""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import threading
from collections.abc import Iterator
from typing import Any

import http_sfv
import httpx
import numpy as np
import pytest
import torch

from .test_sae_api import D_SAE, write_sae

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def spec_hash(sae_id: str, features: list[tuple[int, float]]) -> str:
    """The specification's reference function, as a client would write it."""
    applied = {i: max(-200.0, min(200.0, float(s))) for i, s in features}
    applied = {i: s for i, s in applied.items() if s != 0.0}
    lines = ["millm.steering-set/v1", f"sae={sae_id}"] + [f"{i}:{struct.pack('>d', applied[i]).hex()}" for i in sorted(applied)]
    return "sha256:" + hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


def parse(value: str) -> list[tuple[str, dict[str, Any]]]:
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    return [(str(item.value), dict(item.params)) for item in parsed]


@pytest.fixture(scope="module")
def steered_server(make_server, tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("saes")
    with make_server() as srv:
        for name in ("alpha", "beta"):
            path = write_sae(folder / name, tiny_engine.info.d_model, seed=len(name))
            assert httpx.post(srv.base_url + "/api/saes", json={"path": path, "id": name}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/alpha/attach", json={"layer": 1}).status_code == 200
        yield srv


def chat(srv: Any, **extra: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **extra}, timeout=60)


def hf_reference(engine: Any, sae_path: str, features: list[tuple[int, float]]) -> str:
    from safetensors.numpy import load_file

    w_dec = load_file(str(pathlib.Path(sae_path) / "sae_weights.safetensors"))["W_dec"]
    direction = sum(max(-200.0, min(200.0, s)) * w_dec[i].astype(np.float64) for i, s in features)
    add = torch.tensor(np.asarray(direction, dtype=np.float32))
    ids = engine.tokenizer(engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    handle = engine.model.model.layers[1].register_forward_hook(lambda m, a, out: out + add)
    try:
        with torch.no_grad():
            out = engine.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0)
    finally:
        handle.remove()
    new = out[0, len(ids):].tolist()
    new = new[:-1] if new and new[-1] in engine.eos_token_ids else new
    return engine.tokenizer.decode(new, skip_special_tokens=True)


def test_inline_steering_changes_text_as_the_reference_and_reports_it(steered_server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    features = [(3, 6.0), (17, -4.5)]
    steered = chat(steered_server, steering={"features": [{"index": i, "strength": s} for i, s in features]})
    plain = chat(steered_server)
    assert steered.status_code == 200, steered.text
    path = httpx.get(steered_server.base_url + "/api/saes/alpha").json()["path"]
    assert steered.json()["choices"][0]["message"]["content"] == hf_reference(tiny_engine, path, features)
    assert steered.json()["choices"][0]["message"]["content"] != plain.json()["choices"][0]["message"]["content"]
    [(kind, params)] = parse(steered.headers["x-millm-steering"])
    assert kind == "inline"
    assert params == {"sae": "alpha", "layer": 1, "features": 2, "hash": spec_hash("alpha", features)}
    assert parse(plain.headers["x-millm-steering"]) == [("none", {})]


def test_clamp_is_reported_and_hashed_as_applied(steered_server) -> None:  # type: ignore[no-untyped-def]
    resp = chat(steered_server, steering={"sae_id": "alpha", "features": [{"index": 5, "strength": 500.0}, {"index": 6, "strength": 0.0}]})
    [(kind, params)] = parse(resp.headers["x-millm-steering"])
    assert (kind, params["features"], params["clamped"]) == ("inline", 1, 1)
    assert params["hash"] == spec_hash("alpha", [(5, 500.0)]) == spec_hash("alpha", [(5, 200.0)])


def test_empty_features_is_explicitly_unsteered(steered_server) -> None:  # type: ignore[no-untyped-def]
    off = chat(steered_server, steering={"features": []})
    plain = chat(steered_server)
    assert off.headers["x-millm-steering"] == "none"
    assert off.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_streaming_ends_with_the_report_chunk(steered_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "stream": True, "steering": {"features": [{"index": 2, "strength": 3.0}]}}
    with httpx.stream("POST", steered_server.base_url + "/v1/chat/completions", json=body) as resp:
        frames = [f for f in resp.read().decode().split("\n\n") if f]
    assert "x-millm-steering" not in resp.headers
    assert frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][len("data: "):])
    assert last["choices"] == [] and parse(last["millm_steering"])[0][0] == "inline"
    assert json.loads(frames[-3][len("data: "):])["choices"][0]["finish_reason"] is not None


def test_text_completions_take_the_same_rules(steered_server) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(steered_server.base_url + "/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 4, "steering": {"features": [{"index": 1, "strength": 2.0}]}})
    assert resp.status_code == 200 and parse(resp.headers["x-millm-steering"])[0][0] == "inline"


@pytest.mark.parametrize(
    ("steering", "extra", "status", "code", "param"),
    [
        ({"features": [{"index": 1, "strength": 1}, {"index": 1, "strength": 2}]}, {}, 400, "invalid_parameter", "steering.features[1].index"),
        ({"features": [{"index": D_SAE, "strength": 1}]}, {}, 400, "invalid_feature_index", "steering.features[0].index"),
        # The field is typed (InlineSteering), so a type error names the exact path.
        ({"features": [{"index": 1, "strength": True}]}, {}, 400, "invalid_parameter", "steering.features[0].strength"),
        ({"sae_id": "beta", "features": [{"index": 1, "strength": 1}]}, {}, 400, "sae_not_attached", "steering.sae_id"),
        ({"sae_id": "alpha", "features": []}, {}, 400, "invalid_parameter", "steering.sae_id"),
        ({"features": [{"index": 1, "strength": 1}]}, {"profile": "p"}, 400, "invalid_parameter", "steering"),
        ({"features": [{"index": 1, "strength": 1}]}, {"steering_intensity": 1.0}, 400, "invalid_parameter", "steering"),
        ({"features": [{"index": 1, "strength": 1}], "layer": 3}, {}, 400, "sae_not_attached", "steering.layer"),
        ({"sae_id": "alpha", "features": [{"index": 1, "strength": 1}], "layer": 0}, {}, 400, "sae_not_attached", "steering.layer"),
        ({"layer": 1, "features": []}, {}, 400, "invalid_parameter", "steering.layer"),
        ({"features": [{"index": 1, "strength": 1}], "depth": 3}, {}, 400, "invalid_parameter", "steering.depth"),  # an unknown key
    ],
)
def test_rules(steered_server, steering: dict[str, Any], extra: dict[str, Any], status: int, code: str, param: str) -> None:  # type: ignore[no-untyped-def]
    resp = chat(steered_server, steering=steering, **extra)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param)


def test_a_layer_nothing_fits_says_where_the_sae_is_attached(steered_server) -> None:  # type: ignore[no-untyped-def]
    """The 400 says the SAE is *not* attached at the layer asked for, and where it is."""
    one = [{"index": 1, "strength": 1.0}]
    named = chat(steered_server, steering={"sae_id": "alpha", "layer": 0, "features": one}).json()["error"]
    assert (named["code"], named["param"]) == ("sae_not_attached", "steering.layer")
    assert named["message"] == "SAE 'alpha' is not attached at layer 0; it is attached at layer 1"
    unnamed = chat(steered_server, steering={"layer": 3, "features": one}).json()["error"]
    assert unnamed["message"] == "no SAE is attached at layer 3; the attachments are (alpha, layer 1)"
    assert httpx.post(steered_server.base_url + "/api/saes/alpha/attach", json={"layer": 0}).status_code == 200
    try:
        several = chat(steered_server, steering={"sae_id": "alpha", "layer": 3, "features": one}).json()["error"]
        assert several["message"] == "SAE 'alpha' is not attached at layer 3; it is attached at layers [0, 1]"
    finally:
        httpx.post(steered_server.base_url + "/api/saes/alpha/detach", json={"layer": 0})


def test_ambiguity_names_every_attachment(steered_server) -> None:  # type: ignore[no-untyped-def]
    httpx.post(steered_server.base_url + "/api/saes/beta/attach", json={"layer": 0})
    try:
        resp = chat(steered_server, steering={"features": [{"index": 1, "strength": 1.0}]})
        assert resp.status_code == 400
        assert "(alpha, layer 1)" in resp.json()["error"]["message"] and "(beta, layer 0)" in resp.json()["error"]["message"]
        named = chat(steered_server, steering={"sae_id": "beta", "features": [{"index": 1, "strength": 1.0}]})
        assert parse(named.headers["x-millm-steering"])[0][1]["layer"] == 0
    finally:
        httpx.post(steered_server.base_url + "/api/saes/beta/detach", json={})


def test_layer_picks_one_attachment_of_an_sae_attached_at_several(steered_server) -> None:  # type: ignore[no-untyped-def]
    """An SAE attached at two layers is steered at the one ``layer`` names, exactly as if
    it were attached there alone; without ``layer`` the 400 lists both."""
    steering = {"sae_id": "alpha", "features": [{"index": 3, "strength": 6.0}]}
    assert httpx.post(steered_server.base_url + "/api/saes/alpha/attach", json={"layer": 0}).status_code == 200
    try:
        vague = chat(steered_server, steering=steering)
        error = vague.json()["error"]
        assert (vague.status_code, error["param"]) == (400, "steering.layer") and "(alpha, layer 0)" in error["message"] and "(alpha, layer 1)" in error["message"]
        at_zero = chat(steered_server, steering={**steering, "layer": 0})
        assert parse(at_zero.headers["x-millm-steering"])[0][1]["layer"] == 0
        assert httpx.post(steered_server.base_url + "/api/saes/alpha/detach", json={"layer": 1}).status_code == 200
        alone = chat(steered_server, steering=steering)  # alpha at layer 0 only: no layer needed
        assert at_zero.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
        assert at_zero.json()["choices"][0]["message"]["content"] != chat(steered_server).json()["choices"][0]["message"]["content"]
    finally:
        httpx.post(steered_server.base_url + "/api/saes/alpha/detach", json={})
        assert httpx.post(steered_server.base_url + "/api/saes/alpha/attach", json={"layer": 1}).status_code == 200


def test_steered_and_unsteered_requests_at_once_each_get_their_own(steered_server) -> None:  # type: ignore[no-untyped-def]
    steering = {"features": [{"index": 9, "strength": 5.0}]}
    alone = {"steered": chat(steered_server, steering=steering).json(), "plain": chat(steered_server).json()}
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__("steered", chat(steered_server, steering=steering).json())),
        threading.Thread(target=lambda: results.__setitem__("plain", chat(steered_server).json())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for key in ("steered", "plain"):
        assert results[key]["choices"][0]["message"]["content"] == alone[key]["choices"][0]["message"]["content"]


def test_scoring_beside_a_steered_generation_stays_unsteered(steered_server) -> None:  # type: ignore[no-untyped-def]
    steering = {"features": [{"index": 4, "strength": 8.0}]}
    score_body = {"model": "tiny", "prompt": "The sea is", "max_tokens": 1, "logprobs": 5}
    alone_steered = chat(steered_server, steering=steering, max_tokens=40).json()
    alone_score = httpx.post(steered_server.base_url + "/v1/completions", json=score_body).json()
    results: dict[str, Any] = {}

    def generate() -> None:
        results["steered"] = chat(steered_server, steering=steering, max_tokens=40).json()

    def score() -> None:
        resp = httpx.post(steered_server.base_url + "/v1/completions", json=score_body)
        results["score"], results["score_header"] = resp.json(), resp.headers["x-millm-steering"]

    threads = [threading.Thread(target=generate), threading.Thread(target=score)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["steered"]["choices"] == alone_steered["choices"]
    assert results["score"]["choices"] == alone_score["choices"]
    assert results["score_header"] == "none"


def test_steering_usage_is_counted_by_kind(steered_server) -> None:  # type: ignore[no-untyped-def]
    """The steering plugin adds its own metric to the app's registry."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[str, float]:
        text = httpx.get(steered_server.base_url + "/metrics").text
        return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "millm_steered_requests_total"}

    before = counts()
    chat(steered_server, steering={"sae_id": "alpha", "features": [{"index": 5, "strength": 2.0}]})
    chat(steered_server, steering={"features": []})
    chat(steered_server, steering={"features": []})
    after = counts()
    assert after.get("inline", 0) - before.get("inline", 0) == 1
    assert after.get("none", 0) - before.get("none", 0) == 2
