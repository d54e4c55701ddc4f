"""/v1/models, health and readiness."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import structlog

from millm_core.config import load_settings
from millm_core.registry import ServedModel
from millm_core.server.app import create_app
from millm_core.testing import RunningServer


def test_models_list_and_retrieve(client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    listed = client.models.list().data
    # The loaded models first; then what a request would load (the packaged default model here).
    assert [m.id for m in listed][:2] == ["tiny", "tiny-no-template"]
    assert {m.model_extra["millm"]["state"] for m in listed[2:]} <= {"available"}
    model = client.models.retrieve("tiny")
    details = model.model_extra["millm"]
    config = tiny_engine.model.config
    assert details == {
        "state": "loaded",
        "engine": "transformers",
        "context_length": config.max_position_embeddings,
        "d_model": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "dtype": "float32",
        "revision": "tiny-llama-v1",
        "quantization": "none",
    }
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("missing")
    assert info.value.body["code"] == "model_not_found"


def test_unknown_route_and_method_are_openai_shaped(server) -> None:  # type: ignore[no-untyped-def]
    missing = httpx.get(server.base_url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.base_url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"


def test_readiness_follows_the_model_load(tiny_model: ServedModel) -> None:
    release = threading.Event()

    def loader() -> ServedModel:
        release.wait(20)
        return tiny_model

    settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})
    with RunningServer(create_app(settings, loader=loader)) as srv:
        assert httpx.get(srv.base_url + "/api/health").json() == {"status": "ok"}
        not_ready = httpx.get(srv.base_url + "/api/health/ready")
        assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "model_not_loaded"
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 503 and info.value.body["code"] == "model_not_loaded"
        release.set()
        for _ in range(200):
            if httpx.get(srv.base_url + "/api/health/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert httpx.get(srv.base_url + "/api/health/ready").json() == {"status": "ready", "models": ["tiny"]}
        assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices


def test_failed_load_is_reported(tiny_model: ServedModel) -> None:
    """Readiness (open without a key) says the load failed and the error's class; the
    error's text, which may name paths, is only in the server's log."""

    def loader() -> ServedModel:
        raise OSError("weights unreadable at /secret/path")

    settings = load_settings({"log_level": "critical", "db": ":memory:"}, environ={})
    with structlog.testing.capture_logs() as logs, RunningServer(create_app(settings, loader=loader)) as srv:
        for _ in range(100):
            resp = httpx.get(srv.base_url + "/api/health/ready")
            if "failed" in resp.text:
                break
            threading.Event().wait(0.05)
        error = resp.json()["error"]
        assert resp.status_code == 503 and error["code"] == "model_not_loaded"
        assert "OSError" in error["message"] and "failed to load" in error["message"]
        assert "weights unreadable" not in resp.text and "/secret/path" not in resp.text
    # The log has it: one error with the exception's traceback (which carries its text).
    [failed] = [entry for entry in logs if entry["event"] == "model_load_failed"]
    assert failed["log_level"] == "error" and failed["exc_info"] is True
