"""Per-request SAE activations over HTTP, against an offline computation written here:
the tiny model hooked in the test, the SAE's encoder written out in numpy."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from ..engine.test_taps import hooked_reference

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
D_SAE = 48
LAYER = 1
MAX_TOKENS = 10


def write_jumprelu_sae(folder: pathlib.Path, d_in: int, seed: int) -> str:
    """A JumpReLU SAE that subtracts b_dec from its input (SAELens layout)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "W_enc": (rng.normal(size=(d_in, D_SAE)) / np.sqrt(d_in)).astype(np.float32),
            "b_enc": rng.normal(scale=0.1, size=D_SAE).astype(np.float32),
            "W_dec": rng.normal(size=(D_SAE, d_in)).astype(np.float32),
            "b_dec": rng.normal(size=d_in).astype(np.float32),
            "threshold": np.abs(rng.normal(scale=0.5, size=D_SAE)).astype(np.float32),
        },
        str(folder / "sae_weights.safetensors"),
    )
    cfg = {"d_in": d_in, "d_sae": D_SAE, "architecture": "jumprelu", "apply_b_dec_to_input": True}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def reference_encode(path: str, x: np.ndarray) -> np.ndarray:
    """JumpReLU with b_dec pre-subtraction, written from the SAELens definition."""
    from safetensors.numpy import load_file

    w = load_file(str(pathlib.Path(path) / "sae_weights.safetensors"))
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    return np.where(pre > w["threshold"], pre, 0.0)


def prompt_ids(engine: Any) -> list[int]:
    text = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def hooked_residuals(engine: Any, ids: list[int], delta: np.ndarray | None) -> dict[str, np.ndarray]:
    """Block LAYER's output over ``ids`` alone, before and after ``delta`` (a hook written in the tests)."""
    return hooked_reference(engine, ids, LAYER, tuple(delta.tolist()) if delta is not None else None)


def greedy_reference(engine: Any, ids: list[int], delta: np.ndarray | None) -> list[int]:
    add = torch.tensor(delta) if delta is not None else None
    handle = engine.model.model.layers[LAYER].register_forward_hook(lambda m, a, out: out + add) if add is not None else None
    try:
        with torch.no_grad():
            out = engine.model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0
            )
    finally:
        if handle is not None:
            handle.remove()
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def sae_paths(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("act-saes")
    return {name: write_jumprelu_sae(folder / name, tiny_engine.info.d_model, seed) for name, seed in (("reader", 7), ("other", 8))}


@pytest.fixture(scope="module")
def act_server(make_server: Any, sae_paths: dict[str, str]) -> Iterator[Any]:
    with make_server() as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": sae_paths["reader"], "id": "reader"}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/reader/attach", json={"layer": LAYER}).status_code == 200
        yield srv


def chat(srv: Any, asked: dict[str, Any] | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if asked is not None:
        body["return_sae_activations"] = asked
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)


def expected(engine: Any, path: str, read_point: str, top_k: int, features: list[int] | None, delta: np.ndarray | None) -> dict[int, Any]:
    """position -> (token id, [(index, value)]) over every fed position, computed offline."""
    prompt = prompt_ids(engine)
    generated = greedy_reference(engine, prompt, delta)
    fed = prompt + generated[:-1]  # the last draw is never fed back, so it has no activation
    acts = reference_encode(path, hooked_residuals(engine, fed, delta)[read_point])
    out: dict[int, Any] = {}
    for pos, row in enumerate(acts):
        cands = np.array(features) if features is not None else np.flatnonzero(row)
        ranked = sorted(((int(i), float(row[i])) for i in cands), key=lambda iv: (-iv[1], iv[0]))[:top_k]
        out[pos] = (fed[pos], ranked)
    return out


def assert_matches(listed: list[dict[str, Any]], want: dict[int, Any]) -> None:
    scale = max(abs(v) for _, feats in want.values() for _, v in feats)
    for entry in listed:
        token, feats = want[entry["position"]]
        assert entry["token_id"] == token
        assert [f["index"] for f in entry["features"]] == [i for i, _ in feats]
        np.testing.assert_allclose([f["value"] for f in entry["features"]], [v for _, v in feats], atol=1e-5 * scale, rtol=0)


def test_activations_equal_an_offline_hooked_encoding(act_server: Any, tiny_engine: Any, sae_paths: dict[str, str]) -> None:
    resp = chat(act_server, {"top_k": 5, "positions": "all"})
    assert resp.status_code == 200, resp.text
    acts = resp.json()["millm"]["sae_activations"]
    assert (acts["sae_id"], acts["layer"], acts["read_point"]) == ("reader", LAYER, "post_steering")
    assert "not an unsteered counterfactual" in acts["note"]
    want = expected(tiny_engine, sae_paths["reader"], "post_steering", 5, None, None)
    assert [e["position"] for e in acts["positions"]] == sorted(want)  # every fed position, the last draw excluded
    assert_matches(acts["positions"], want)


@pytest.mark.parametrize("read_point", ["pre_steering", "post_steering"])
def test_read_points_around_this_layers_steering(act_server: Any, tiny_engine: Any, sae_paths: dict[str, str], read_point: str) -> None:
    steering = [(3, 6.0), (11, -4.0)]
    resp = chat(
        act_server,
        {"top_k": 4, "positions": "completion", "read_point": read_point, "features": [3, 11, 20, 30, 40]},
        steering={"features": [{"index": i, "strength": s} for i, s in steering]},
    )
    assert resp.status_code == 200, resp.text
    from safetensors.numpy import load_file

    w_dec = load_file(str(pathlib.Path(sae_paths["reader"]) / "sae_weights.safetensors"))["W_dec"]
    delta = sum(s * w_dec[i].astype(np.float64) for i, s in steering).astype(np.float32)
    want = expected(tiny_engine, sae_paths["reader"], read_point, 4, [3, 11, 20, 30, 40], delta)
    listed = resp.json()["millm"]["sae_activations"]["positions"]
    prompt_len = len(prompt_ids(tiny_engine))
    assert [e["position"] for e in listed] == [p for p in sorted(want) if p >= prompt_len]
    assert all(len(e["features"]) == 4 for e in listed)  # listed candidates are listed even at 0
    assert_matches(listed, want)


def same_entries(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Equal positions, tokens and features; values to 1e-5 of their scale (the encoder's
    product over a different number of positions rounds differently)."""
    assert [(e["position"], e["token_id"], [f["index"] for f in e["features"]]) for e in got] == [
        (e["position"], e["token_id"], [f["index"] for f in e["features"]]) for e in want
    ]
    scale = max(abs(f["value"]) for e in want for f in e["features"])
    values = [f["value"] for e in got for f in e["features"]]
    np.testing.assert_allclose(values, [f["value"] for e in want for f in e["features"]], atol=1e-5 * scale, rtol=0)


def test_positions_last_prompt_and_a_range(act_server: Any, tiny_engine: Any) -> None:
    prompt_len = len(prompt_ids(tiny_engine))
    full = chat(act_server, {"top_k": 3, "positions": "all"}).json()["millm"]["sae_activations"]["positions"]
    by_position = {e["position"]: e for e in full}
    last = chat(act_server, {"top_k": 3, "positions": "last"}).json()["millm"]["sae_activations"]["positions"]
    same_entries(last, [full[-1]])
    prompt = chat(act_server, {"top_k": 3, "positions": "prompt"}).json()["millm"]["sae_activations"]["positions"]
    same_entries(prompt, [by_position[p] for p in range(prompt_len)])
    window = chat(act_server, {"top_k": 3, "positions": {"start": prompt_len - 2, "end": prompt_len + 3}})
    same_entries(window.json()["millm"]["sae_activations"]["positions"], [by_position[p] for p in range(prompt_len - 2, prompt_len + 3)])


def test_a_response_that_did_not_ask_has_no_millm_key(act_server: Any) -> None:
    assert "millm" not in chat(act_server, None).json()


def test_shared_batch_reads_the_same_as_alone(act_server: Any) -> None:
    asked = {"top_k": 6, "positions": "all"}
    solo = chat(act_server, asked).json()
    steer = {"features": [{"index": 5, "strength": 8.0}]}
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, act_server, asked if i % 2 == 0 else None, **({"steering": steer} if i in (1, 3) else {})) for i in range(6)]
        results = [f.result() for f in futures]
    for i, resp in enumerate(results):
        assert resp.status_code == 200, resp.text
        if i % 2 == 0:
            body = resp.json()
            assert body["choices"][0]["message"]["content"] == solo["choices"][0]["message"]["content"]
            same_entries(body["millm"]["sae_activations"]["positions"], solo["millm"]["sae_activations"]["positions"])


def test_streaming_closes_with_activations_before_the_steering_chunk(act_server: Any) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_sae_activations": {"top_k": 2, "positions": "completion"}}  # fmt: skip
    with httpx.stream("POST", act_server.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    closing = [c for c in chunks if c["choices"] == []]
    assert [next(k for k in c if k.startswith("millm")) for c in closing] == ["millm", "millm_steering"]
    streamed = closing[0]["millm"]["sae_activations"]
    plain = chat(act_server, {"top_k": 2, "positions": "completion"}).json()["millm"]["sae_activations"]
    assert [e["position"] for e in streamed["positions"]] == [e["position"] for e in plain["positions"]]


@pytest.mark.parametrize(
    ("asked", "extra", "param", "code"),
    [
        ({"top_k": 2}, {"n": 2}, "n", "invalid_parameter"),
        ({"top_k": 65}, {}, "return_sae_activations.top_k", "invalid_parameter"),
        ({"top_k": 2, "sae_id": "nope"}, {}, "return_sae_activations.sae_id", "sae_not_attached"),
        ({"top_k": 2, "features": [D_SAE]}, {}, "return_sae_activations.features[0]", "invalid_feature_index"),
        ({"top_k": 2, "features": [1, 1]}, {}, "return_sae_activations.features[1]", "invalid_parameter"),
        ({"top_k": 2, "positions": {"start": 5, "end": 5}}, {}, "return_sae_activations.positions", "invalid_parameter"),
    ],
)
def test_refusals_before_anything_runs(act_server: Any, asked: dict[str, Any], extra: dict[str, Any], param: str, code: str) -> None:
    resp = chat(act_server, asked, **extra)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_the_worst_case_size_is_bounded_counting_max_tokens_in_full(make_server: Any, sae_paths: dict[str, str], tiny_engine: Any) -> None:
    prompt_len = len(prompt_ids(tiny_engine))
    with make_server(sae_activations_max_entries=4 * (prompt_len + 20)) as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": sae_paths["reader"], "id": "reader"}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/reader/attach", json={"layer": LAYER}).status_code == 200
        assert chat(srv, {"top_k": 4, "positions": "all"}, max_tokens=20).status_code == 200  # at the limit
        over = chat(srv, {"top_k": 4, "positions": "all"}, max_tokens=21)  # one position over, though EOS may come sooner
        assert over.status_code == 400 and over.json()["error"]["code"] == "sae_activations_too_large"
        assert chat(srv, {"top_k": 4, "positions": "prompt"}, max_tokens=200).status_code == 200  # the budget does not count there


def test_several_prompts_are_refused(act_server: Any) -> None:
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2, "return_sae_activations": {"top_k": 2}}
    resp = httpx.post(act_server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_no_sae_attached_or_an_ambiguous_choice(make_server: Any, sae_paths: dict[str, str]) -> None:
    with make_server() as srv:
        none = chat(srv, {"top_k": 2})
        assert none.status_code == 400 and none.json()["error"]["code"] == "sae_not_attached"
        for name in ("reader", "other"):
            assert httpx.post(srv.base_url + "/api/saes", json={"path": sae_paths[name], "id": name}).status_code == 201
            assert httpx.post(srv.base_url + f"/api/saes/{name}/attach", json={"layer": LAYER}).status_code == 200
        both = chat(srv, {"top_k": 2})
        assert both.status_code == 400
        assert "(reader, layer 1)" in both.json()["error"]["message"] and "(other, layer 1)" in both.json()["error"]["message"]
        named = chat(srv, {"top_k": 2, "sae_id": "other"})
        assert named.status_code == 200 and named.json()["millm"]["sae_activations"]["sae_id"] == "other"


def test_gguf_is_refused_before_anything_runs(gguf_server: Any) -> None:
    body = {"model": gguf_server_model(gguf_server), "messages": MESSAGES, "max_tokens": 2, "return_sae_activations": {"top_k": 2}}
    resp = httpx.post(gguf_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == ("return_sae_activations", "field_not_honoured")


def gguf_server_model(srv: Any) -> str:
    return str(httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"])


def test_a_scoring_request_is_refused_naming_the_field(act_server: Any) -> None:
    resp = chat(act_server, {"top_k": 2}, logprobs=True, max_tokens=1)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == ("return_sae_activations", "field_not_honoured")
