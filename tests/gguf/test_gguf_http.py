"""The GGUF engine behind the real server: the same OpenAI surface, headers and error
shapes as the transformers engine, its refusals, names, continuation and embeddings."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from .helpers import load_gguf

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def post(srv: Any, path: str, **body: Any) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=60)


def chat(srv: Any, **extra: Any) -> httpx.Response:
    return post(srv, "/v1/chat/completions", **{"model": "tiny:F32", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, **extra})


def test_chat_and_completions_match_the_transformers_engine(gguf_server, server) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=gguf_server.base_url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="tiny:F32", messages=MESSAGES, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    resp = raw.parse()
    reference = post(server, "/v1/chat/completions", model="tiny", messages=MESSAGES, max_tokens=16, temperature=0).json()
    assert resp.choices[0].message.content == reference["choices"][0]["message"]["content"]
    assert resp.usage is not None and resp.usage.completion_tokens == reference["usage"]["completion_tokens"]
    assert resp.system_fingerprint is not None and resp.system_fingerprint.endswith(":f32/F32:gguf")
    assert raw.headers["x-millm-steering"] == "none"
    text = post(gguf_server, "/v1/completions", model="tiny:F32", prompt=["The capital", "def f"], max_tokens=8, temperature=0).json()
    text_ref = post(server, "/v1/completions", model="tiny", prompt=["The capital", "def f"], max_tokens=8, temperature=0).json()
    assert [c["text"] for c in text["choices"]] == [c["text"] for c in text_ref["choices"]]


def test_streaming_stop_and_budget(gguf_server) -> None:  # type: ignore[no-untyped-def]
    full = chat(gguf_server).json()["choices"][0]["message"]["content"]
    client = openai.OpenAI(base_url=gguf_server.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="tiny:F32", messages=MESSAGES, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})  # type: ignore[arg-type]
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert usage.completion_tokens == 16
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stopped = chat(gguf_server, stop=[stop]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == full[: full.index(stop)]
    budget = post(gguf_server, "/v1/chat/completions", model="tiny:F32", messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert budget.json()["usage"]["completion_tokens"] == 3
    sampled = [chat(gguf_server, temperature=1.0, top_p=0.9, top_k=20, frequency_penalty=0.5).status_code for _ in range(2)]
    assert sampled == [200, 200]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", True),
        ("top_logprobs", 2),
        ("allowed_token_ids", [1, 2]),
        # (response_format is honoured on GGUF: tests/http/test_structured.py; tools are
        # refused here because the tiny model's embedded template takes none)
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("steering", {"features": []}),
        ("profile", "p"),
        ("steering_intensity", 0.5),
        ("n", 2),
        ("return_sae_activations", {"sae_id": "x", "layer": 0}),
    ],
)
def test_refusals_name_the_field(gguf_server, field: str, value: Any) -> None:  # type: ignore[no-untyped-def]
    # max_tokens 1 makes the scoring fields a well-formed scoring request: only the engine refuses it.
    resp = chat(gguf_server, **{field: value, "max_tokens": 1, **({"logprobs": True} if field == "top_logprobs" else {})})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "field_not_honoured" and field in error["message"]
    assert error["param"] == ("logprobs" if field == "top_logprobs" else field)  # the first refused field of the request
    # The message says why: the capability the engine lacks, or that nothing declares the field.
    why = {"tools": "takes no tools"}
    assert why.get(field, "the gguf engine lacks the capability") in error["message"], error["message"]


def test_scoring_and_float32_scoring_are_refused(gguf_server) -> None:  # type: ignore[no-untyped-def]
    for extra in ({"logprobs": 5}, {"logprobs": 5, "scoring_precision": "float32"}):
        resp = post(gguf_server, "/v1/completions", model="tiny:F32", prompt="The sea", max_tokens=1, **extra)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "field_not_honoured", resp.text


def test_more_prompts_than_sequences_is_a_clear_error(gguf_server, gguf_model) -> None:  # type: ignore[no-untyped-def]
    too_many = ["x"] * (gguf_model.engine.parallel + 1)
    for stream in (False, True):
        # Refused in admission from the engine's declared capacity: a stream gets its 400
        # before any 200, never an error event after it.
        resp = post(gguf_server, "/v1/completions", model="tiny:F32", prompt=too_many, max_tokens=2, stream=stream)
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == ("capacity_exceeded", "prompt")
    assert chat(gguf_server).status_code == 200  # the scheduler goes on


def test_context_length_is_measured_before_llama_cpp(gguf_server, gguf_model) -> None:  # type: ignore[no-untyped-def]
    limit = gguf_model.info.context_length
    resp = post(gguf_server, "/v1/completions", model="tiny:F32", prompt="word " * (limit + 10), max_tokens=4)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert str(limit) in resp.json()["error"]["message"]


def test_tool_history_is_reported_and_template_kwargs_are_template_variables(gguf_server) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "so?"},
    ]
    resp = post(gguf_server, "/v1/chat/completions", model="tiny:F32", messages=messages, max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    assert resp.status_code == 200, resp.text
    ignored = resp.headers["x-millm-ignored-fields"]
    # The variables reach the template (tests/reasoning/test_reasoning_gguf.py renders one
    # that reads them); this template reads no enable_thinking, so the key changes nothing
    # and is reported by name (the field itself is honoured).
    assert '"chat_template_kwargs.enable_thinking"' in ignored and '"messages[1].tool_calls"' in ignored
    assert '"chat_template_kwargs"' not in ignored
    plain = post(gguf_server, "/v1/chat/completions", model="tiny:F32", messages=messages, max_tokens=4)
    assert resp.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("which", ["gguf_server", "server"])
def test_a_trailing_assistant_message_is_continued(which: str, request: pytest.FixtureRequest, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    srv = request.getfixturevalue(which)
    model = "tiny:F32" if which == "gguf_server" else "tiny"
    partial = "The sea is"
    continued = post(srv, "/v1/chat/completions", model=model, messages=[*MESSAGES, {"role": "assistant", "content": partial}], max_tokens=12, temperature=0)
    # The reference: the template's own render of the chat before the partial answer, with
    # the generation prompt, the partial appended, completed as raw text.
    head = tiny_engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    raw = post(srv, "/v1/completions", model=model, prompt=head + partial, add_special_tokens=False, max_tokens=12, temperature=0)
    assert continued.status_code == 200 and raw.status_code == 200, continued.text + raw.text
    assert continued.json()["choices"][0]["message"]["content"] == raw.json()["choices"][0]["text"]
    assert continued.json()["usage"]["prompt_tokens"] == raw.json()["usage"]["prompt_tokens"]
    restarted = post(srv, "/v1/chat/completions", model=model, messages=MESSAGES, max_tokens=12, temperature=0).json()
    assert restarted["usage"]["prompt_tokens"] < continued.json()["usage"]["prompt_tokens"]


def test_embeddings_are_mean_pooled_and_other_poolings_refused(gguf_server, gguf_model) -> None:  # type: ignore[no-untyped-def]
    resp = post(gguf_server, "/v1/embeddings", model="tiny:F32", input=["The sea is calm", "x"], normalize=True)
    assert resp.status_code == 200, resp.text
    vectors = [np.array(d["embedding"]) for d in resp.json()["data"]]
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-5 for v in vectors)
    raw = post(gguf_server, "/v1/embeddings", model="tiny:F32", input="The sea is calm").json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), vectors[0], atol=1e-6)
    for pooling in ("last", "cls"):
        refused = post(gguf_server, "/v1/embeddings", model="tiny:F32", input="x", pooling=pooling)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "pooling" and refused.json()["error"]["code"] == "field_not_honoured"
    assert chat(gguf_server).status_code == 200  # the model is still resident


def test_embeddings_mean_matches_hidden_states(gguf_server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    text = "The sea is calm"
    got = np.array(post(gguf_server, "/v1/embeddings", model="tiny:F32", input=text).json()["data"][0]["embedding"])
    reference = np.array(tiny_engine.embed([tiny_engine.encode(text, add_special_tokens=True)], "mean")[0])
    np.testing.assert_allclose(got, reference, atol=2e-3)


def test_embeddings_disabled_by_setting(make_server, gguf_path: str) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf(gguf_path, gguf_enable_embeddings=False)
    with make_server(models=[model]) as srv:
        resp = post(srv, "/v1/embeddings", model="tiny:F32", input="x")
    assert resp.status_code == 400 and "gguf_enable_embeddings=false" in resp.json()["error"]["message"]


def test_bare_names_and_quantizations_side_by_side(make_server, gguf_model, gguf_path: str) -> None:  # type: ignore[no-untyped-def]
    with make_server(models=[gguf_model]) as srv:
        one = chat(srv, model="tiny")
        assert one.status_code == 404 and one.json()["error"]["code"] == "model_not_found" and "'tiny:F32'" in one.json()["error"]["message"]
    twin = load_gguf(gguf_path, served="tiny:Q8_0")
    with make_server(models=[gguf_model, twin]) as srv:
        listed = [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]]
        assert listed[:2] == ["tiny:F32", "tiny:Q8_0"]  # the loaded ones first
        both = chat(srv, model="tiny")
        assert both.status_code == 400 and both.json()["error"]["code"] == "ambiguous_model_name"
        assert "tiny:F32" in both.json()["error"]["message"] and "tiny:Q8_0" in both.json()["error"]["message"]


def test_concurrent_streams_share_batches_and_each_gets_its_own_text(gguf_server) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    alone = [post(gguf_server, "/v1/completions", model="tiny:F32", prompt=p, max_tokens=24, temperature=0).json()["choices"][0]["text"] for p in prompts]
    before = httpx.get(gguf_server.base_url + "/api/health/inference").json()
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        body = {"model": "tiny:F32", "prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True}
        with httpx.stream("POST", gguf_server.base_url + "/v1/completions", json=body, timeout=60) as resp:
            parts = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        results[i] = "".join(c["choices"][0]["text"] for c in parts if c.get("choices"))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = httpx.get(gguf_server.base_url + "/api/health/inference").json()
    assert [results[i] for i in range(len(prompts))] == alone
    tokens = after["scheduler"]["generated_tokens"] - before["scheduler"]["generated_tokens"]
    steps = after["scheduler"]["steps"] - before["scheduler"]["steps"]
    assert steps < tokens, "concurrent requests should share decode steps"


def test_a_stream_leaving_a_shared_batch_frees_only_its_row(make_server, gguf_model) -> None:  # type: ignore[no-untyped-def]
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    from ..http.helpers import GatePlugin

    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.01)  # 10 ms a token, so both requests are surely running together
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host, models=[gguf_model]) as srv:
        stay_body = {"model": "tiny:F32", "prompt": "The capital of France is", "max_tokens": 40, "temperature": 0}
        alone = post(srv, "/v1/completions", **stay_body).json()["choices"][0]["text"]
        result: dict[str, Any] = {}
        stayer = threading.Thread(target=lambda: result.__setitem__("stay", post(srv, "/v1/completions", **stay_body).json()))
        leave_body = {"model": "tiny:F32", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=leave_body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            stayer.start()
            for _ in range(10):
                next(lines)
        stayer.join(60)
        stats = httpx.get(srv.base_url + "/api/health/inference").json()["scheduler"]
    assert result["stay"]["choices"][0]["text"] == alone
    assert stats["cancelled_rows"] == 1 and stats["active_rows"] == 0 and stats["running_jobs"] == 0


def test_a_seed_on_shared_f32_batches_promises_best_effort(gguf_server) -> None:  # type: ignore[no-untyped-def]
    """The f32 file's shared batches are not invariant (unfused f32 attention), so a seed
    is honoured — the same draws — with the promise scoped to what the load allows."""
    first = chat(gguf_server, temperature=1.0, seed=11, max_tokens=6)
    assert first.status_code == 200 and first.headers["x-millm-seed"] == '11;scope="best-effort"'
    again = chat(gguf_server, temperature=1.0, seed=11, max_tokens=6)
    assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_the_backend_header_says_whether_answers_can_depend_on_the_load(make_server, gguf_path: str) -> None:  # type: ignore[no-untyped-def]
    """Shared llama.cpp batches are not batch-invariant, and say so; --batch-invariant
    decodes one sequence at a time (serial, invariant)."""
    from .helpers import load_gguf

    for model, backend in ((load_gguf(gguf_path), "batched;invariant=?0"), (load_gguf(gguf_path, batch_invariant=True), "serial")):
        with make_server(models=[model]) as srv:
            resp = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": model.info.served_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert resp.status_code == 200 and resp.headers["x-millm-backend"] == backend
            assert httpx.get(srv.base_url + "/api/health/inference").json()["models"] == {model.info.served_name: backend}
