"""/v1/embeddings against an independent computation with transformers."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import torch

from millm_core.config import load_settings
from millm_core.server.app import build_host

TEXTS = ["The capital of France is Paris.", "def f(x): return x", "naïve café 東京"]


def reference(engine, text: str, pooling: str) -> list[float]:  # type: ignore[no-untyped-def]
    ids = engine.tokenizer(text, return_tensors="pt")  # the tokenizer's own rule (BOS)
    with torch.no_grad():
        hidden = engine.model.model(**ids).last_hidden_state[0].float()
    return {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling].tolist()


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_vectors_match_transformers(client, tiny_engine, pooling: str) -> None:  # type: ignore[no-untyped-def]
    resp = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float", extra_body={"pooling": pooling})
    assert [d.index for d in resp.data] == [0, 1, 2]
    for item, text in zip(resp.data, TEXTS):
        ref = reference(tiny_engine, text, pooling)
        assert len(item.embedding) == tiny_engine.info.d_model
        assert max(abs(a - b) for a, b in zip(item.embedding, ref)) < 1e-4
    assert resp.usage.prompt_tokens == sum(len(tiny_engine.tokenizer(t)["input_ids"]) for t in TEXTS)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_an_input_gets_the_same_vector_whatever_it_is_sent_with(client, pooling: str) -> None:  # type: ignore[no-untyped-def]
    """Exactly: inputs padded to a common length moved each other's vectors."""
    longer = "A much longer sentence about the sea, the wind and the ships that sail on it all year."
    alone = [client.embeddings.create(model="tiny", input=text, extra_body={"pooling": pooling}).data[0].embedding for text in TEXTS]
    mixed = client.embeddings.create(model="tiny", input=[longer, *TEXTS, longer], extra_body={"pooling": pooling}).data[1:-1]
    assert [item.embedding for item in mixed] == alone


def test_base64_and_normalize(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    raw = httpx.post(server.base_url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS[0], "encoding_format": "base64", "normalize": True}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert abs(math.sqrt(sum(v * v for v in vector)) - 1.0) < 1e-5
    ref = reference(tiny_engine, TEXTS[0], "mean")
    norm = math.sqrt(sum(v * v for v in ref))
    assert max(abs(a - b / norm) for a, b in zip(vector, ref)) < 1e-5


def test_refusals(server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    def post(body: dict) -> dict:  # type: ignore[type-arg]
        resp = httpx.post(server.base_url + "/v1/embeddings", json={"model": "tiny", **body})
        assert resp.status_code == 400, resp.text
        return resp.json()["error"]

    assert post({"input": "x", "dimensions": 8}) | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "dimensions", "code": "field_not_honoured"}
    assert post({"input": "x", "pooling": "max"})["param"] == "pooling"
    assert post({"input": "x", "scoring_precision": "float32"})["code"] == "field_not_honoured"
    for name in ("max_tokens", "max_completion_tokens"):  # generation lengths: nothing to generate here
        assert post({"input": "x", name: 5}) | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": name, "code": "field_not_honoured"}
    assert post({"input": ""})["param"] == "input"
    assert post({"input": []})["param"] == "input"
    error = post({"input": ["ok", "", "fine", ""]})
    assert error["param"] == "input" and "index 1, 3" in error["message"]  # the field, as the contract says; the message names them
    too_long = "word " * 600
    error = post({"input": ["short", too_long, too_long]})
    assert error["code"] == "context_length_exceeded" and error["param"] == "input[1]"
    assert "input[1] has" in error["message"] and "input[2] has" in error["message"] and "512" in error["message"]
    assert post({"input": too_long})["param"] == "input"


def test_input_cap_is_a_plugin_setting(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    with make_server(host=host, embeddings_max_inputs=2) as srv:
        resp = httpx.post(srv.base_url + "/v1/embeddings", json={"model": "tiny", "input": ["a", "b", "c"]})
        assert resp.status_code == 400
        assert "3 strings" in resp.json()["error"]["message"] and "at most 2" in resp.json()["error"]["message"]
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        assert len(client.embeddings.create(model="tiny", input=["a", "b"]).data) == 2


def test_generation_fields_are_unknown_here(server) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(server.base_url + "/v1/embeddings", json={"model": "tiny", "input": "x", "user": "u", "temperature": 0.5})
    assert resp.status_code == 200
    assert resp.headers["x-millm-ignored-fields"] == '"user", "temperature"'
