"""The field policy table: complete, and true — every cell is checked against the server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from millm_core.contracts.known import KNOWN_FIELDS

# A valid, non-neutral value for every declared request field. A new contract field
# without a sample fails test_every_cell_behaves_as_the_table_says.
SAMPLES: dict[str, Any] = {
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "n": 2, "max_tokens": 2, "max_completion_tokens": 2, "seed": 1, "stop": ["x"], "frequency_penalty": 0.5,
    "presence_penalty": 0.5, "logit_bias": {"1": 1.0}, "logprobs": True, "top_logprobs": 2, "allowed_token_ids": [1],
    "return_tokens_as_token_ids": True, "scoring_precision": "float32", "profile": "p", "steering": {"features": []},
    "steering_intensity": 0.5, "return_sae_activations": {"sae_id": "s"}, "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "parallel_tool_calls": False,
    "chat_template_kwargs": {"flag": True}, "add_special_tokens": False, "echo": True, "suffix": "x", "best_of": 2,
    "encoding_format": "float", "pooling": "last", "normalize": True, "dimensions": 8,
    # Known output-changing fields that no built-in plugin declares yet.
    "functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "low", "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2,
    "ignore_eos": True, "circuit": "c", "probes": ["p"], "extra_messages": [[{"role": "user", "content": "x"}]],
    "thinking_budget": 8, "enable_thinking": False, "class": "agent",
}
# Endpoint-specific samples, and what a conditionally honoured field needs beside it.
SAMPLE_OVERRIDES: dict[tuple[str, str], Any] = {("logprobs", "completions"): 2}
# The value a conditionally honoured field takes to meet its condition, where the sample does not.
CONDITIONAL_SAMPLES: dict[str, Any] = {"pooling": "mean"}
SCORING = {"max_tokens": 1}
CONDITIONS: dict[str, dict[str, Any]] = {
    "logprobs": SCORING,
    "allowed_token_ids": SCORING,
    "return_tokens_as_token_ids": {**SCORING, "allowed_token_ids": [1]},
    "top_logprobs": {**SCORING, "logprobs": True},
    "scoring_precision": {**SCORING, "logprobs": 1},
    "stream_options": {"stream": True},
}
STRUCTURAL = {"model", "messages", "prompt", "input"}
# Honoured fields whose sample names something that does not exist: the lookup proves the
# field was read (a refusal would be 400 field_not_honoured).
HONOURED_LOOKUPS: dict[str, tuple[int, str]] = {"profile": (404, "profile_not_found"), "return_sae_activations": (400, "sae_not_attached")}
PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}
BASES: dict[str, dict[str, Any]] = {
    "chat.completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"model": "tiny", "prompt": "x", "max_tokens": 2},
    "embeddings": {"model": "tiny", "input": "x"},
}


def table(base_url: str) -> list[dict[str, Any]]:
    return httpx.get(base_url + "/api/policy").json()["data"]


def test_table_has_one_cell_per_field_endpoint_and_engine(server) -> None:  # type: ignore[no-untyped-def]
    """Every field the served request schemas declare, and every known output-changing
    field they do not, has one cell per endpoint and engine."""
    cells = table(server.base_url)
    keys = [(c["field"], c["endpoint"], c["engine"]) for c in cells]
    assert len(keys) == len(set(keys))
    schemas = httpx.get(server.base_url + "/v1/openapi.json").json()["components"]["schemas"]
    names = {"chat.completions": "ChatCompletionRequest", "completions": "CompletionRequest", "embeddings": "EmbeddingRequest"}
    declared = {e: set(schemas[name]["properties"]) for e, name in names.items()}
    expected = {(f, e, engine) for e, fields in declared.items() for f in fields | set(KNOWN_FIELDS) for engine in ("transformers", "gguf")}
    assert set(keys) == expected
    for cell in cells:
        assert cell["status"] in ("honoured", "honoured-with-condition", "refused")
        assert (cell["status"] == "refused") == (cell["reason"] is not None)


def test_every_cell_behaves_as_the_table_says(server, gguf_server, tools_server) -> None:  # type: ignore[no-untyped-def]
    """Each engine's cells are checked on a server running that engine. ``tools`` is
    honoured when the model's template takes tools: checked on the tiny model served with
    a tools template (transformers), and refused where the template takes none (the tiny
    GGUF's embedded one)."""
    servers = {"transformers": (server, "tiny"), "gguf": (gguf_server, "tiny:F32")}
    # One client, its connections kept, for the ~270 requests: httpx.post builds a client
    # (and its TLS context) per call, most of this test's time. Requests and checks as before.
    with httpx.Client(timeout=30) as http:
        for cell in table(server.base_url):
            field, endpoint = cell["field"], cell["endpoint"]
            if field in STRUCTURAL:
                continue
            assert field in SAMPLES, f"add a sample value for {field}"
            srv, model = servers[cell["engine"]]
            if field == "tools" and cell["status"] == "honoured-with-condition":
                if cell["engine"] == "transformers":
                    srv = tools_server
                else:  # the condition is not met: refused by name, with the template's reason
                    resp = http.post(srv.base_url + PATHS[endpoint], json={**BASES[endpoint], "model": model, field: SAMPLES[field]})
                    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "tools") and "takes no tools" in resp.text, resp.text
                    continue
            body = {**BASES[endpoint], "model": model, field: SAMPLE_OVERRIDES.get((field, endpoint), SAMPLES[field])}
            if field == "tool_choice" and cell["status"] != "refused":  # it chooses among tools: sent beside them
                if cell["engine"] != "transformers":  # no template here takes tools: alone, it is refused by name
                    resp = http.post(srv.base_url + PATHS[endpoint], json=body)
                    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "tool_choice") and "needs tools" in resp.text, resp.text
                    continue
                srv, body["tools"] = tools_server, SAMPLES["tools"]
            if cell["status"] == "honoured-with-condition":
                body.update(CONDITIONS.get(field, {}))
                body[field] = CONDITIONAL_SAMPLES.get(field, SAMPLE_OVERRIDES.get((field, endpoint), SAMPLES[field]))
            resp = http.post(srv.base_url + PATHS[endpoint], json=body)
            error = resp.json().get("error") if resp.headers["content-type"].startswith("application/json") else None
            if cell["status"] == "refused":
                assert resp.status_code == 400, (cell, resp.text)
                assert error["code"] == "field_not_honoured" and error["param"] == field, (cell, error)
            elif field in HONOURED_LOOKUPS:
                assert (resp.status_code, error["code"]) == HONOURED_LOOKUPS[field], (cell, resp.text)
            else:
                assert resp.status_code == 200, (cell, resp.text)


def test_unconditional_honour_wins_and_conditions_are_listed(server) -> None:  # type: ignore[no-untyped-def]
    cells = {(c["field"], c["endpoint"]): c for c in table(server.base_url) if c["engine"] == "transformers"}
    assert cells[("temperature", "completions")] | {"reason": None} == {
        "field": "temperature", "endpoint": "completions", "engine": "transformers", "status": "honoured", "by": "sampling", "condition": None, "reason": None,
    }
    n = cells[("n", "chat.completions")]
    assert n["status"] == "honoured-with-condition" and n["by"] == "sampling, scoring"
    assert n["condition"] == "not streaming (sampling); scoring mode (scoring)"


@pytest.mark.parametrize("field", ["temperature", "seed", "stop", "top_k", "steering"])
def test_disabling_a_plugin_turns_its_cells_to_refused(make_server, field: str) -> None:  # type: ignore[no-untyped-def]
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"plugins": ()}, environ={}))
    with make_server(host=host) as srv:
        cells = [c for c in table(srv.base_url) if c["field"] == field]
        assert cells and all(c["status"] == "refused" for c in cells)
