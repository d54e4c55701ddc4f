"""Scoring mode against independent references computed here with torch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from millm_core.config import load_settings
from millm_core.engine import ModelLocation
from millm_core.registry import ServedModel

PROMPT = "The capital of France is"


def reference_logprobs(engine: Any, ids: list[int], allowed: list[int] | None = None, temperature: float = 0.0, model: Any = None) -> dict[int, float]:
    model = model or engine.model
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    if temperature:
        logits = logits / temperature
    pool = torch.tensor(allowed) if allowed is not None else torch.arange(logits.shape[0])
    logp = torch.log_softmax(logits[pool], dim=0)
    return {int(t): float(v) for t, v in zip(pool, logp)}


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": "tiny", **body}, timeout=60)


def test_completion_scoring_matches_reference(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 5})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ref = reference_logprobs(tiny_engine, tiny_engine.tokenizer(PROMPT)["input_ids"])
    best = max(ref, key=ref.get)
    lp = choice["logprobs"]
    assert choice["text"] == tiny_engine.tokenizer.decode([best]) and choice["finish_reason"] == "length"
    assert lp["tokens"] == [choice["text"]] and abs(lp["token_logprobs"][0] - ref[best]) < 1e-5
    assert lp["text_offset"] == [len(PROMPT)]
    expected: dict[str, float] = {}
    for token, value in sorted(ref.items(), key=lambda kv: -kv[1])[:5]:
        expected.setdefault(tiny_engine.tokenizer.decode([token]), value)  # colliding texts: one entry, the likelier
    got = lp["top_logprobs"][0]
    assert set(got) == set(expected)
    assert all(abs(got[k] - expected[k]) < 1e-5 for k in expected)
    usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(tiny_engine.tokenizer(PROMPT)["input_ids"])


def test_logprobs_zero_lists_the_chosen_token(server) -> None:  # type: ignore[no-untyped-def]
    """As OpenAI's legacy completions (up to logprobs + 1 entries): the chosen token is
    always in top_logprobs, so logprobs: 0 lists it alone."""
    zero = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{zero["tokens"][0]: zero["token_logprobs"][0]}]
    two = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert len(two["top_logprobs"][0]) == 2 and two["top_logprobs"][0][zero["tokens"][0]] == zero["token_logprobs"][0]


def test_a_prompt_scores_the_same_whatever_it_is_sent_with(server) -> None:  # type: ignore[no-untyped-def]
    """Exactly: prompts padded to a common length moved each other's log-probabilities."""
    prompts = [PROMPT, "x", "Once upon a time, in a land far away, there lived a"]
    body = {"max_tokens": 1, "logprobs": 5, "temperature": 1.0}
    alone = [post(server, "/v1/completions", {**body, "prompt": p}).json()["choices"][0]["logprobs"] for p in prompts]
    together = post(server, "/v1/completions", {**body, "prompt": [*prompts, *reversed(prompts)]}).json()["choices"]
    assert [c["logprobs"] for c in together] == [*alone, *reversed(alone)]


def test_allowed_ids_normalise_over_the_set_and_return_every_id(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    allowed = [17, 300, 512, 901]
    body = {"prompt": [PROMPT, "import os"], "max_tokens": 1, "logprobs": 2, "allowed_token_ids": allowed, "return_tokens_as_token_ids": True, "temperature": 0.7}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    for choice, prompt in zip(resp.json()["choices"], [PROMPT, "import os"]):
        ref = reference_logprobs(tiny_engine, tiny_engine.tokenizer(prompt)["input_ids"], allowed, 0.7)
        tops = choice["logprobs"]["top_logprobs"][0]
        assert set(tops) == {f"token_id:{t}" for t in allowed}  # every listed token, keyed by id
        for t in allowed:
            assert abs(tops[f"token_id:{t}"] - ref[t]) < 1e-5
        assert abs(sum(math.exp(v) for v in tops.values()) - 1.0) < 1e-6
        best = max(ref, key=ref.get)
        assert choice["logprobs"]["tokens"] == [f"token_id:{best}"]


def test_allowed_ids_without_logprobs_constrain_and_return_null(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    allowed = [40, 41, 42]
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "allowed_token_ids": allowed})
    choice = resp.json()["choices"][0]
    ref = reference_logprobs(tiny_engine, tiny_engine.tokenizer(PROMPT)["input_ids"], allowed)
    assert choice["logprobs"] is None and choice["text"] == tiny_engine.tokenizer.decode([max(ref, key=ref.get)])


def test_chat_scoring_equals_completion_scoring_of_the_render(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "logprobs": True, "top_logprobs": 3})
    assert chat.status_code == 200, chat.text
    rendered = tiny_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    completion = post(server, "/v1/completions", {"prompt": rendered, "max_tokens": 1, "logprobs": 3, "add_special_tokens": False})
    entry = chat.json()["choices"][0]["logprobs"]["content"][0]
    legacy = completion.json()["choices"][0]["logprobs"]
    assert entry["token"] == legacy["tokens"][0] and abs(entry["logprob"] - legacy["token_logprobs"][0]) < 1e-6
    assert entry["bytes"] == list(entry["token"].encode())
    assert len(entry["top_logprobs"]) == 3
    assert chat.json()["choices"][0]["message"]["content"] == entry["token"]
    assert chat.json()["usage"]["prompt_tokens"] == completion.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "max_tokens": 5}, "max_tokens", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, "max_tokens", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "max_tokens": 1, "n": 2}, "n", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "max_tokens": 1, "stream": True}, "stream", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "max_tokens": 1, "temperature": 0.0005}, "temperature", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21, "max_tokens": 1}, "logprobs", "invalid_parameter"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "allowed_token_ids": [5, 10**7]}, "allowed_token_ids", "invalid_scoring_request"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 2, "allowed_token_ids": [5, 9, 5]}, "allowed_token_ids", "invalid_scoring_request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "max_tokens": 1, "allowed_token_ids": [9, 9]}, "allowed_token_ids", "invalid_scoring_request"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1, "logprobs": 1, "add_special_tokens": False}, "prompt", "invalid_scoring_request"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 1, "profile": "p"}, "profile", "field_not_honoured"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 1, "steering": {"features": []}}, "steering", "field_not_honoured"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 3, "scoring_precision": "float32"}, "scoring_precision", "field_not_honoured"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "max_tokens": 1}, "top_logprobs", "invalid_parameter"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "max_tokens": 1, "response_format": {"type": "json_object"}}, "response_format", "field_not_honoured"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "max_tokens": 1, "scoring_precision": "float32"}, "scoring_precision", "field_not_honoured"),
    ],
)
def test_refusals(server, path: str, body: dict[str, Any], param: str, code: str) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_chat_scoring_needs_a_chat_template(server) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "tiny-no-template", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_chat_template"


def test_inert_fields_are_reported_and_seed_echoed(server) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 1, "top_p": 0.5, "stop": ["a"], "seed": 4})
    assert resp.status_code == 200
    assert resp.headers["x-millm-ignored-fields"] == '"top_p", "stop"'
    assert resp.headers["x-millm-seed"] == '4;scope="request"'


def test_greedy_scoring_reports_top_p_and_top_k_too(server) -> None:  # type: ignore[no-untyped-def]
    """Scoring draws nothing, so top_p and top_k are unused there at any temperature:
    reported, not refused as they are on a greedy generation."""
    body = {"prompt": "x", "max_tokens": 1, "logprobs": 1, "temperature": 0, "top_p": 0.5, "top_k": 3}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-millm-ignored-fields"] == '"top_p", "top_k"'
    generation = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": 0, "top_p": 0.5})
    assert generation.status_code == 400 and generation.json()["error"]["code"] == "invalid_sampling_parameter"


def test_neutral_values_are_accepted_on_scoring_requests(server) -> None:  # type: ignore[no-untyped-def]
    """The contract's neutral values ask for nothing, so scoring accepts them; other
    values of the same fields are refused."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "max_tokens": 1}
    neutral = {"response_format": {"type": "text"}, "tool_choice": "none", "tools": []}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json={**base, **neutral}, timeout=30)
    assert resp.status_code == 200, resp.text
    for name, value in (("response_format", {"type": "json_object"}), ("tool_choice", "auto")):
        refused = httpx.post(server.base_url + "/v1/chat/completions", json={**base, name: value}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


# ----------------------------------------------------------------- float32 scoring


@pytest.fixture(scope="module")
def bf16_model(tiny_dir: str) -> ServedModel:
    from millm_engines.transformers.loader import load_engine

    engine = load_engine(ModelLocation(path=tiny_dir, served_name="tiny"), load_settings({"dtype": "bfloat16"}, environ={}))
    assert engine.info.dtype == "bfloat16"
    return ServedModel(info=engine.info, engine=engine)


@pytest.fixture(scope="module")
def bf16_server(make_server, bf16_model: ServedModel) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    with make_server(models=[bf16_model]) as srv:
        yield srv


def test_float32_scoring_matches_a_float32_reference_and_native_does_not(bf16_server, bf16_model: ServedModel) -> None:
    engine = bf16_model.engine
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    ids = engine.tokenizer(PROMPT)["input_ids"]
    allowed = list(range(0, 1000, 7))
    fp32_model = type(engine.model)(engine.model.config).float()
    fp32_model.load_state_dict({k: v.float() for k, v in engine.model.state_dict().items()})  # the served bf16 values, in float32
    reference = reference_logprobs(engine, ids, allowed, model=fp32_model)
    results = {}
    for precision in ("float32", "native"):
        resp = post(bf16_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "allowed_token_ids": allowed, "return_tokens_as_token_ids": True, "scoring_precision": precision})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-millm-scoring-precision"] == precision and resp.json()["scoring_precision"] == precision
        tops = resp.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        results[precision] = max(abs(tops[f"token_id:{t}"] - reference[t]) for t in allowed)
    assert results["float32"] < 1e-5
    assert results["native"] > 1e-3  # bf16 rounding moves log-probabilities measurably
    for name, param in engine.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, before[name])  # served weights untouched
    plain = post(bf16_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1})
    assert "x-millm-scoring-precision" not in plain.headers and "scoring_precision" not in plain.json()


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"scoring_float32_headroom_mb": 10**9}, "memory"),
        ({"scoring_float32_device": "cuda:0"}, "device"),  # no CUDA device on this machine
        ({"scoring_float32_device": "cuda"}, "device"),
        ({"scoring_float32_device": "tpu:7"}, "device"),
    ],
)
def test_float32_refusals_say_why(make_server, bf16_model: ServedModel, setting: dict[str, Any], reason: str) -> None:  # type: ignore[no-untyped-def]
    with make_server(models=[bf16_model], **setting) as srv:
        resp = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "scoring_precision": "float32"})
        assert resp.status_code == 409
        assert resp.json()["error"]["code"] == "scoring_precision_unavailable" and resp.json()["error"]["param"] == "scoring_precision"
        assert resp.headers["x-millm-scoring-precision-reason"] == reason


def test_float32_copy_on_cpu_is_accepted_and_matches_auto(bf16_model: ServedModel) -> None:
    """``cpu`` names the copy's device explicitly; on a CPU model it is where ``auto`` goes."""
    engine = bf16_model.engine
    ids = [engine.tokenizer(PROMPT)["input_ids"]]
    on_cpu = engine.next_token_logits(ids, float32=True, float32_device="cpu")
    auto = engine.next_token_logits(ids, float32=True, float32_device="auto")
    assert on_cpu.dtype.name == "float32" and (on_cpu == auto).all()


def test_float32_busy_and_not_castable(bf16_model: ServedModel) -> None:
    from millm_core.errors import ScoringPrecisionUnavailable

    engine = bf16_model.engine
    ids = [engine.tokenizer(PROMPT)["input_ids"]]
    with engine._fp32.hold():  # another request's copy in use
        with pytest.raises(ScoringPrecisionUnavailable) as info:
            engine.next_token_logits(ids, float32=True)
    assert info.value.reason == "busy"
    engine.model.config.quantization_config = {"quant_method": "bitsandbytes"}
    try:
        with pytest.raises(ScoringPrecisionUnavailable) as info:
            engine.next_token_logits(ids, float32=True)
        assert info.value.reason == "model_not_float32_castable"
    finally:
        del engine.model.config.quantization_config


def test_float32_on_a_float32_model_uses_it_as_is(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "scoring_precision": "float32"})
    native = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1})
    assert resp.status_code == 200 and resp.json()["choices"][0]["logprobs"] == native.json()["choices"][0]["logprobs"]


# ----------------------------------------------------------------- scoring-only deployment


def test_scoring_only_deployment(make_server) -> None:  # type: ignore[no-untyped-def]
    from millm_core.server.app import build_host

    host = build_host(load_settings({"plugins": ("scoring",)}, environ={}))
    assert host.has("scoring") and not host.has("sampling")
    with make_server(host=host) as srv:
        scored = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 2, "temperature": 1.0})
        assert scored.status_code == 200, scored.text
        generated = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert generated.status_code == 400 and generated.json()["error"]["code"] == "field_not_honoured"
        plain = post(srv, "/v1/completions", {"prompt": "hi"})
        assert plain.status_code == 400 and "no enabled plugin serves" in plain.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/api/health/inference").json()["scheduler"]["steps"] == 0
        # What a client sends with every call (OpenAI's defaults) is accepted; fields that
        # cannot change a scored answer are reported and a seed echoed, as on a full server.
        body = {"prompt": PROMPT, "max_tokens": 1, "logprobs": 2, "temperature": 1.0}
        defaults = post(srv, "/v1/completions", {**body, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "stop": []})
        assert defaults.status_code == 200, defaults.text
        assert defaults.headers["x-millm-ignored-fields"] == '"top_p", "stop", "frequency_penalty", "presence_penalty"'
        assert defaults.json()["choices"] == scored.json()["choices"]
        inert = post(srv, "/v1/completions", {**body, "top_p": 0.5, "stop": ["x"], "presence_penalty": 1, "seed": 7})
        assert inert.status_code == 200, inert.text
        assert inert.headers["x-millm-ignored-fields"] == '"top_p", "stop", "presence_penalty"'
        assert inert.headers["x-millm-seed"] == '7;scope="request"'
        assert inert.json()["choices"] == scored.json()["choices"]
        # top_k is the sampling plugin's field: with that plugin off nothing declares it.
        top_k = post(srv, "/v1/completions", {**body, "top_k": 5})
        assert (top_k.status_code, top_k.json()["error"]["param"]) == (400, "top_k"), top_k.text
