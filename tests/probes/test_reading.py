"""Where a probe reads: before or after this request's steering delta at its layer, an
attached SAE's features, and what it says where it cannot read (an SAE detached since it
was armed, an engine without taps); the closing chunks' order beside activations."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from .helpers import (
    HELD_CODE,
    HELD_SEA,
    JSON,
    LAYER,
    Fitted,
    arm,
    chat,
    chat_ids,
    content_span,
    hooked,
    import_probe,
    ok,
    sae_document,
    sae_encode,
    sigmoid,
    stream_lines,
    user,
    write_sae,
)


@pytest.fixture(scope="module")
def sae_path(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_sae(tmp_path_factory.mktemp("reading-sae") / "sae", tiny_engine.info.d_model, seed=5)


@pytest.fixture(scope="module")
def reading(make_server: Any, fitted: Fitted, tiny_engine: Any, sae_path: str) -> Iterator[Any]:
    """A server with the SAE attached at the probes' layer and three probes armed on the
    prompt: the fitted head before and after steering, and a head over the SAE's features."""
    with make_server() as srv:
        ok(httpx.post(srv.base_url + "/api/saes", json={"path": sae_path, "id": "reader"}), 201)
        ok(httpx.post(srv.base_url + "/api/saes/reader/attach", json={"layer": LAYER}))
        import_probe(srv, fitted.document("before", probe_id="before"))
        import_probe(srv, fitted.document("after", probe_id="after", read_point="post_steering"))
        import_probe(srv, sae_document(tiny_engine, sae_path, "reader", "features"))
        for probe_id in ("before", "after", "features"):
            ok(arm(srv, probe_id, windows=["prompt"]))
        yield srv


def results(resp: httpx.Response) -> dict[str, dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    return {r["probe"]["id"]: r for r in resp.json()["millm_probe_verdicts"]}


def test_read_points_around_this_requests_steering(reading: Any, fitted: Fitted, tiny_engine: Any, sae_path: str) -> None:
    ids = chat_ids(tiny_engine, user(HELD_CODE[0]))
    plain = results(chat(reading, user(HELD_CODE[0])))
    assert plain["before"]["score"] == pytest.approx(plain["after"]["score"], abs=1e-9)  # no delta: one read point
    assert not plain["before"]["served"]["steered_at_layer"]
    steering = {"features": [{"index": 3, "strength": 6.0}, {"index": 7, "strength": -4.0}]}
    steered = results(chat(reading, user(HELD_CODE[0]), steering=steering))
    w_dec = load_file(sae_path + "/sae_weights.safetensors")["W_dec"].astype(np.float64)
    delta = 6.0 * w_dec[3] - 4.0 * w_dec[7]
    residual = hooked(tiny_engine, ids)  # block 1's output before the delta (nothing earlier is steered)
    assert steered["before"]["served"]["steered_at_layer"] and steered["before"]["served"]["read_point"] == "pre_steering"
    assert steered["after"]["served"]["read_point"] == "post_steering"
    assert steered["before"]["score"] == pytest.approx(fitted.score(ids), abs=1e-6)
    assert steered["after"]["score"] == pytest.approx(sigmoid(float(fitted.logits(residual + delta).mean())), abs=1e-6)
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    assert abs(logit(steered["after"]["score"]) - logit(steered["before"]["score"])) > 0.05  # the delta moved the reading


def test_a_probe_over_sae_features(reading: Any, tiny_engine: Any, sae_path: str) -> None:
    doc = sae_document(tiny_engine, sae_path, "reader", "features")
    w, b = np.array(doc["head"]["weights"]), doc["head"]["bias"]
    for text in (HELD_SEA[0], HELD_CODE[1]):
        ids = chat_ids(tiny_engine, user(text))
        want = sigmoid(float((sae_encode(sae_path, hooked(tiny_engine, ids)) @ w + b).mean()))
        assert results(chat(reading, user(text)))["features"]["score"] == pytest.approx(want, abs=1e-6)


def test_closing_chunks_come_in_order(reading: Any) -> None:
    body = {"model": "tiny", "messages": user(HELD_SEA[0]), "max_tokens": 4, "temperature": 0,
            "return_sae_activations": {"top_k": 2, "positions": "last"}}  # fmt: skip
    _, lines = stream_lines(reading, body)
    closing = [next(k for k in line if k.startswith("millm")) for line in lines[:-1] if not line["choices"]]
    assert closing == ["millm_probe_verdicts", "millm", "millm_steering"]


def test_a_detached_sae_is_skipped_not_failed(make_server: Any, tiny_engine: Any, sae_path: str) -> None:
    with make_server() as srv:
        ok(httpx.post(srv.base_url + "/api/saes", json={"path": sae_path, "id": "reader"}), 201)
        ok(httpx.post(srv.base_url + "/api/saes/reader/attach", json={"layer": LAYER}))
        import_probe(srv, sae_document(tiny_engine, sae_path, "reader", "features"))
        ok(arm(srv, "features"))
        ok(httpx.post(srv.base_url + "/api/saes/reader/detach", json={}))
        got = results(chat(srv, user(HELD_SEA[0])))["features"]
        assert (got["outcome"], got["reason"], got["score"]) == ("skipped", "sae_not_attached", None)


def test_an_engine_without_taps_is_skipped(make_server: Any, tiny_model: Any, gguf_model: Any, fitted: Fitted) -> None:
    with make_server(models=[tiny_model, gguf_model]) as srv:
        import_probe(srv, fitted.document(probe_id="sea"))
        ok(arm(srv, "sea", windows=["prompt", "last_user"]))
        name = gguf_model.info.served_name
        same = ok(httpx.get(srv.base_url + "/api/probes/identity", params={"model": name}))
        assert same["chat_template_sha256"] == ok(httpx.get(srv.base_url + "/api/probes/identity"))["chat_template_sha256"]
        resp = httpx.post(
            srv.base_url + "/v1/chat/completions", json={"model": name, "messages": user(HELD_SEA[0]), "max_tokens": 3}, timeout=60
        )
        assert resp.status_code == 200, resp.text  # no taps were asked of an engine that has none
        assert {(r["outcome"], r["reason"]) for r in resp.json()["millm_probe_verdicts"]} == {("skipped", "engine_cannot_tap")}
        assert results(chat(srv, user(HELD_SEA[0])))["sea"]["outcome"] == "scored"
        httpx.delete(srv.base_url + "/api/probes/sea", headers=JSON)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_last_user_is_placed_in_the_render_served_with_tools(
    make_server: Any, tool_models: dict[str, Any], fitted: Fitted, tool_choice: str
) -> None:
    model = tool_models["hermes"]  # the tiny model's weights, served with a template that shows tools
    tokenizer = model.engine.tokenizer
    doc = fitted.document(probe_id="sea")
    doc["model"]["chat_template_sha256"] = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    with make_server(models=[model]) as srv:
        import_probe(srv, doc)
        ok(arm(srv, "sea", windows=["last_user"]))
        body = {
            "model": "tiny-hermes",
            "messages": user(HELD_SEA[1]),
            "tools": [WEATHER],
            "tool_choice": tool_choice,
            "max_tokens": 24,
            "temperature": 0,
        }
        resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        (result,) = resp.json()["millm_probe_verdicts"]
    # The template's own render with the tools (the served prompt, before any forced opening).
    text = tokenizer.apply_chat_template(user(HELD_SEA[1]), tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=not text.startswith(tokenizer.bos_token))["input_ids"])  # one BOS
    start, end = content_span(model.engine, ids, HELD_SEA[1])
    assert start > 10  # the tools come first in this template
    assert result["served"]["positions"] == {"start": start, "end": end}
    assert result["score"] == pytest.approx(fitted.score(ids, start, end), abs=1e-6)
    assert result["verdict"] == "flagged"
