"""Absent sampling fields: the model's generation_config.json, the operator's per-mode
values, and the greedy rule (top_p/top_k cannot change a greedy draw: refused)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import httpx
import pytest

from millm_core.config import ConfigError, load_settings
from millm_core.registry import ServedModel
from millm_core.testing import RunningServer
from millm_engines.transformers.testing import tiny_model_dir

from ..conftest import TEMPLATES, _load

MESSAGES = [{"role": "user", "content": "Say something."}]


def chat(srv: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 16, **body}, timeout=60)


def text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def stated_model(tmp: str, name: str, stated: dict[str, Any]) -> ServedModel:
    """The tiny model, copied with a generation_config.json that states ``stated``."""
    path = os.path.join(tmp, name)
    shutil.copytree(tiny_model_dir(), path)
    with open(os.path.join(path, "generation_config.json")) as fh:
        config = json.load(fh)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({**config, **stated}, fh)
    return _load(path, "tiny", load_settings({"log_level": "warning"}, environ={}))


def test_a_greedy_request_that_sends_top_p_or_top_k_is_refused(server: RunningServer) -> None:
    for field, value in (("top_p", 0.5), ("top_k", 5), ("top_k", 0)):
        resp = chat(server, temperature=0, **{field: value})
        error = resp.json()["error"]
        assert (resp.status_code, error["code"], error["param"]) == (400, "invalid_sampling_parameter", field)
    greedy = text(chat(server, temperature=0))
    assert text(chat(server, temperature=0, top_p=1)) == greedy  # the neutral value asks for nothing
    # Penalties change what a greedy draw reads: honoured.
    assert text(chat(server, temperature=0, frequency_penalty=2.0, max_tokens=48)) != text(chat(server, temperature=0, max_tokens=48))


def test_absent_fields_take_the_values_the_model_states(make_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    greedy_model = stated_model(str(tmp_path), "greedy", {"do_sample": True, "temperature": 0.0})
    with make_server(models=[greedy_model]) as srv:
        explicit = text(chat(srv, temperature=0))
        assert text(chat(srv)) == text(chat(srv)) == explicit
        assert text(chat(srv, temperature=1.0, seed=3)) != explicit  # a sent value wins
        refused = chat(srv, top_k=3)  # greedy by the model's default: top_k is pointless
        assert refused.json()["error"]["code"] == "invalid_sampling_parameter"
    top1 = stated_model(str(tmp_path), "top1", {"do_sample": True, "temperature": 1.0, "top_k": 1})
    with make_server(models=[top1]) as srv:
        assert text(chat(srv, seed=1)) == text(chat(srv, seed=2)) == explicit  # top_k 1 keeps the likeliest token
        assert text(chat(srv, seed=1, top_k=20)) != text(chat(srv, seed=2, top_k=20))
    for name, stated in (("greedy-off", {"do_sample": False, "temperature": 0.0}), ("unsaid", {"temperature": 0.0})):
        with make_server(models=[stated_model(str(tmp_path), name, stated)]) as srv:
            assert text(chat(srv)) != text(chat(srv))  # a model that does not say it samples states nothing: fresh seeds


@pytest.fixture(scope="module")
def think_model() -> ServedModel:
    settings = load_settings({"log_level": "warning", "chat_template": os.path.join(TEMPLATES, "think.jinja")}, environ={})
    return _load(tiny_model_dir(context=2048), "tiny", settings)


def test_the_operator_sets_defaults_per_mode(make_server, think_model: ServedModel) -> None:  # type: ignore[no-untyped-def]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with make_server(models=[think_model], sampling_defaults_no_thinking={"temperature": 0.0}, sampling_defaults_thinking={"temperature": 1.5}) as srv:
        greedy_off = text(chat(srv, temperature=0, **off))
        assert text(chat(srv, **off)) == greedy_off
        assert text(chat(srv, reasoning_effort="none")) == greedy_off
        sampled = [chat(srv, max_tokens=24).json()["choices"][0]["message"] for _ in range(2)]
        assert sampled[0] != sampled[1]  # thinking on: temperature 1.5, fresh seeds
    parsed = load_settings(environ={"MILLM_SAMPLING_DEFAULTS_NO_THINKING": "temperature=0.7, top_p=0.8,top_k=20,presence_penalty=1.5"}, plugin_settings=_plugin_settings())
    assert parsed.plugin_values["sampling_defaults_no_thinking"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0, "presence_penalty": 1.5}
    for bad in ("top_p=3", "top_k=2.5", "temp=1", "temperature"):
        with pytest.raises(ConfigError, match="MILLM_SAMPLING_DEFAULTS_THINKING"):
            load_settings(environ={"MILLM_SAMPLING_DEFAULTS_THINKING": bad}, plugin_settings=_plugin_settings())


def _plugin_settings() -> Any:
    from millm_core.server.app import build_host

    return build_host(load_settings(environ={})).plugin_settings()
