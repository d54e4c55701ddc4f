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
from ..http.helpers import scheduler_stats

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
            "threshold": rng.normal(scale=0.5, size=D_SAE).astype(np.float32),  # some below 0: JumpReLU's ReLU matters
        },
        str(folder / "sae_weights.safetensors"),
    )
    cfg = {"d_in": d_in, "d_sae": D_SAE, "architecture": "jumprelu", "apply_b_dec_to_input": True}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def reference_encode(path: str, x: np.ndarray) -> np.ndarray:
    """SAELens' encoders, written from its definitions: b_dec subtracted first when the
    config says so (SAELens' default), then ReLU (standard), ReLU(pre)·(pre > threshold)
    (JumpReLU) or the k largest of ReLU(pre) (topk)."""
    from safetensors.numpy import load_file

    w = load_file(str(pathlib.Path(path) / "sae_weights.safetensors"))
    cfg = json.loads((pathlib.Path(path) / "cfg.json").read_text())
    if cfg.get("apply_b_dec_to_input", True):
        x = x - w["b_dec"]
    pre = x.astype(np.float64) @ w["W_enc"] + w["b_enc"]
    if cfg["architecture"] == "jumprelu":
        return np.maximum(pre, 0) * (pre > w["threshold"])
    acts = np.maximum(pre, 0)
    if cfg["architecture"] == "topk":
        keep = np.argsort(-acts, axis=-1)[..., : cfg["k"]]
        out = np.zeros_like(acts)
        np.put_along_axis(out, keep, np.take_along_axis(acts, keep, axis=-1), axis=-1)
        return out
    return acts


def write_sae(folder: pathlib.Path, d_in: int, seed: int, architecture: str, apply_b_dec: bool) -> str:
    """A standard or topk SAE (SAELens layout)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"W_enc": rng.normal(size=(d_in, D_SAE)) / np.sqrt(d_in), "b_enc": rng.normal(scale=0.1, size=D_SAE),
              "W_dec": rng.normal(size=(D_SAE, d_in)), "b_dec": rng.normal(size=d_in)}  # fmt: skip
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    cfg: dict[str, Any] = {"d_in": d_in, "d_sae": D_SAE, "architecture": architecture, "apply_b_dec_to_input": apply_b_dec}
    if architecture == "topk":
        cfg["k"] = 6
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def prompt_ids(engine: Any, messages: list[dict[str, str]] = MESSAGES) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def hooked_residuals(engine: Any, ids: list[int], delta: np.ndarray | None) -> dict[str, np.ndarray]:
    """Block LAYER's output over ``ids`` alone, before and after ``delta`` (a hook written in the tests)."""
    return hooked_reference(engine, ids, LAYER, tuple(delta.tolist()) if delta is not None else None)


def greedy_reference(engine: Any, ids: list[int], delta: np.ndarray | None, max_tokens: int = MAX_TOKENS) -> list[int]:
    add = torch.tensor(delta) if delta is not None else None
    handle = engine.model.model.layers[LAYER].register_forward_hook(lambda m, a, out: out + add) if add is not None else None
    try:
        with torch.no_grad():
            out = engine.model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0
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


def expected(
    engine: Any, path: str, read_point: str, top_k: int, features: list[int] | None, delta: np.ndarray | None,
    messages: list[dict[str, str]] = MESSAGES, max_tokens: int = MAX_TOKENS,
) -> dict[int, Any]:  # fmt: skip
    """position -> (token id, [(index, value)]) over every fed position, computed offline."""
    return expected_for_ids(engine, path, read_point, top_k, features, delta, prompt_ids(engine, messages), max_tokens)


def expected_for_ids(
    engine: Any, path: str, read_point: str, top_k: int, features: list[int] | None, delta: np.ndarray | None,
    prompt: list[int], max_tokens: int = MAX_TOKENS,
) -> dict[int, Any]:  # fmt: skip
    """``expected`` for a prompt given as token ids (a text completion's)."""
    generated = greedy_reference(engine, prompt, delta, max_tokens)
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


@pytest.mark.parametrize(("architecture", "apply_b_dec"), [("standard", False), ("standard", True), ("topk", True)])
def test_every_architecture_encodes_as_saelens_does(
    make_server: Any, tiny_engine: Any, tmp_path: pathlib.Path, architecture: str, apply_b_dec: bool
) -> None:
    path = write_sae(tmp_path / architecture, tiny_engine.info.d_model, 11, architecture, apply_b_dec)
    with make_server() as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": path, "id": "arch"}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/arch/attach", json={"layer": LAYER}).status_code == 200
        resp = chat(srv, {"top_k": 5, "positions": "all"})
        assert resp.status_code == 200, resp.text
        listed = resp.json()["millm"]["sae_activations"]["positions"]
        assert_matches(listed, expected(tiny_engine, path, "post_steering", 5, None, None))
        some = chat(srv, {"top_k": 3, "positions": "all", "features": [4, 9, 17, 30]}).json()["millm"]["sae_activations"]["positions"]
        assert_matches(some, expected(tiny_engine, path, "post_steering", 3, [4, 9, 17, 30], None))


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


def test_shared_batch_reads_the_same_as_alone(act_server: Any, tiny_engine: Any, sae_paths: dict[str, str]) -> None:
    """Requests of different prompts and budgets, steered or not, asking or not, share
    decode steps (fewer steps than tokens); each reading equals the offline one."""
    asked = {"top_k": 6, "positions": "all"}
    steer = {"features": [{"index": 5, "strength": 8.0}]}
    prompts = ["Tell me a story about the sea.", "hi", "What is the capital of France? Answer in one word please.", "Count: 1, 2, 3"]

    def send(i: int) -> httpx.Response:
        body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": prompts[i % 4]}], "max_tokens": 6 + 3 * i, "temperature": 0}
        if i % 2 == 0:
            body["return_sae_activations"] = asked
        if i in (1, 2):
            body["steering"] = steer
        return httpx.post(act_server.base_url + "/v1/chat/completions", json=body, timeout=120)

    before = scheduler_stats(act_server.base_url)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    after = scheduler_stats(act_server.base_url)
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in results)
    assert after["steps"] - before["steps"] < tokens  # rows shared steps
    from safetensors.numpy import load_file

    w_dec = load_file(str(pathlib.Path(sae_paths["reader"]) / "sae_weights.safetensors"))["W_dec"]
    for i, resp in enumerate(results):
        assert resp.status_code == 200, resp.text
        if i % 2 == 0:
            delta = (8.0 * w_dec[5]).astype(np.float32) if i == 2 else None
            messages = [{"role": "user", "content": prompts[i % 4]}]
            want = expected(tiny_engine, sae_paths["reader"], "post_steering", 6, None, delta, messages=messages, max_tokens=6 + 3 * i)
            listed = resp.json()["millm"]["sae_activations"]["positions"]
            assert [e["position"] for e in listed] == sorted(want)
            assert_matches(listed, want)


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
        ({"top_k": 2, "features": []}, {}, "return_sae_activations.features", "invalid_parameter"),
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


COMPLETION_PROMPT = "Once upon a time"


@pytest.mark.parametrize("positions", ["all", "prompt"])
def test_a_text_completion_reads_its_prompt_with_special_tokens_then_its_completion(
    act_server: Any, tiny_engine: Any, sae_paths: dict[str, str], positions: str
) -> None:
    """``/v1/completions`` with one prompt: positions are absolute over the prompt as the
    tokenizer encodes it (its BOS included: add_special_tokens defaults to on there) then
    the generated tokens; the final draw is never fed back, so it is not listed."""
    body = {"model": "tiny", "prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_sae_activations": {"top_k": 5, "positions": positions}}  # fmt: skip
    resp = httpx.post(act_server.base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    acts = resp.json()["millm"]["sae_activations"]
    assert (acts["sae_id"], acts["layer"], acts["read_point"]) == ("reader", LAYER, "post_steering")
    tokenizer = tiny_engine.tokenizer
    bare = list(tokenizer(COMPLETION_PROMPT, add_special_tokens=False)["input_ids"])
    assert tokenizer.bos_token_id is not None  # the tiny tokenizer adds one: the case this test is for
    prompt = [tokenizer.bos_token_id, *bare]
    assert list(tokenizer(COMPLETION_PROMPT)["input_ids"]) == prompt
    assert resp.json()["usage"]["prompt_tokens"] == len(prompt)
    generated = greedy_reference(tiny_engine, prompt, None)
    assert resp.json()["usage"]["completion_tokens"] == len(generated)
    assert len(generated) > 1  # some generated token is fed back, so "all" reaches past the prompt
    want = expected_for_ids(tiny_engine, sae_paths["reader"], "post_steering", 5, None, None, prompt)
    listed = acts["positions"]
    last = len(prompt) + len(generated) - 1  # positions run 0 .. this, exclusive
    assert [e["position"] for e in listed] == list(range(last if positions == "all" else len(prompt)))
    assert listed[0]["token_id"] == tokenizer.bos_token_id
    assert [e["token_id"] for e in listed] == [*prompt, *generated[:-1]][: len(listed)]
    assert_matches(listed, want)


def test_float32_scoring_is_refused_with_activations(act_server: Any) -> None:
    """The reads come from the served model (not the float32 copy): a float32 scoring
    request that asks for them is refused, not reported as float32; native is served."""
    body = {"model": "tiny", "prompt": COMPLETION_PROMPT, "max_tokens": 1, "logprobs": 1, "return_sae_activations": {"top_k": 2}}
    refused = httpx.post(act_server.base_url + "/v1/completions", json={**body, "scoring_precision": "float32"}, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("field_not_honoured", "scoring_precision") and "return_sae_activations" in error["message"]
    native = httpx.post(act_server.base_url + "/v1/completions", json={**body, "scoring_precision": "native"}, timeout=60)
    assert native.status_code == 200 and native.json()["millm"]["sae_activations"]["read_point"] == "unsteered", native.text
    alone = httpx.post(act_server.base_url + "/v1/completions", json={**body, "scoring_precision": "float32", "return_sae_activations": None}, timeout=60)
    assert alone.status_code == 200 and alone.headers["x-millm-scoring-precision"] == "float32", alone.text


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
        elsewhere = chat(srv, {"top_k": 2, "layer": 0}).json()["error"]
        assert (elsewhere["code"], elsewhere["param"]) == ("sae_not_attached", "return_sae_activations.layer")
        assert elsewhere["message"].startswith("no SAE is attached at layer 0 (attached: "), elsewhere


def test_an_sae_attached_at_two_layers_is_read_at_the_layer_named(make_server: Any, sae_paths: dict[str, str], tiny_engine: Any) -> None:
    with make_server() as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": sae_paths["reader"], "id": "reader"}).status_code == 201
        for layer in (0, LAYER):
            assert httpx.post(srv.base_url + "/api/saes/reader/attach", json={"layer": layer}).status_code == 200
        both = chat(srv, {"top_k": 2, "sae_id": "reader"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "return_sae_activations.layer"
        assert "(reader, layer 0)" in both.json()["error"]["message"] and "(reader, layer 1)" in both.json()["error"]["message"]
        named = chat(srv, {"top_k": 4, "sae_id": "reader", "layer": LAYER, "positions": "all"})
        assert named.status_code == 200, named.text
        assert named.json()["millm"]["sae_activations"]["layer"] == LAYER
        assert_matches(named.json()["millm"]["sae_activations"]["positions"], expected(tiny_engine, sae_paths["reader"], "post_steering", 4, None, None))
        missing = chat(srv, {"top_k": 2, "layer": 2})
        assert missing.status_code == 400 and missing.json()["error"]["code"] == "sae_not_attached"


def test_gguf_is_refused_before_anything_runs(gguf_server: Any) -> None:
    body = {"model": gguf_server_model(gguf_server), "messages": MESSAGES, "max_tokens": 2, "return_sae_activations": {"top_k": 2}}
    resp = httpx.post(gguf_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == ("return_sae_activations", "field_not_honoured")


def gguf_server_model(srv: Any) -> str:
    return str(httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"])


def test_a_scoring_request_reads_its_prompt_unsteered(act_server: Any, tiny_engine: Any, sae_paths: dict[str, str]) -> None:
    """Scoring mode: the prompt's positions from an unsteered pass (manual steering is live
    on the server meanwhile), reported as ``unsteered``, with ``X-miLLM-Steering: none``."""
    put = httpx.put(act_server.base_url + "/api/steering", json={"features": [{"index": 5, "strength": 9.0}]})
    assert put.status_code == 200, put.text
    try:
        resp = chat(act_server, {"top_k": 4, "positions": "all"}, logprobs=True, max_tokens=1)
        last = chat(act_server, {"top_k": 4, "positions": "last"}, logprobs=True, max_tokens=1)
    finally:
        httpx.put(act_server.base_url + "/api/steering", json={"features": []})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-steering"] == "none"
    read = resp.json()["millm"]["sae_activations"]
    assert read["read_point"] == "unsteered" and "unsteered" in read["note"]
    prompt = prompt_ids(tiny_engine)
    acts = reference_encode(sae_paths["reader"], hooked_residuals(tiny_engine, prompt, None)["post_steering"])
    want = {p: (prompt[p], sorted(((int(i), float(row[i])) for i in np.flatnonzero(row)), key=lambda iv: (-iv[1], iv[0]))[:4]) for p, row in enumerate(acts)}
    assert [e["position"] for e in read["positions"]] == list(range(len(prompt)))
    assert_matches(read["positions"], want)
    assert [e["position"] for e in last.json()["millm"]["sae_activations"]["positions"]] == [len(prompt) - 1]


def test_without_the_steering_plugin_the_refusal_says_why(make_server: Any) -> None:
    """No plugin attaches SAEs here: the refusal says so instead of pointing at a route that
    is not served."""
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"block_plugins": ("steering", "circuits", "probes")}, environ={}))
    assert host.has("activations") and not host.has("steering")
    with make_server(host=host) as srv:
        error = chat(srv, {"top_k": 2}).json()["error"]
        assert error["code"] == "sae_not_attached" and "does not run the steering plugin" in error["message"], error
        assert httpx.post(srv.base_url + "/api/saes", json={"path": "x"}).status_code == 404
