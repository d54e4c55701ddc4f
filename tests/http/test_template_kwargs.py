"""chat_template_kwargs keys are honoured or reported: a key the model's chat template never
reads, and no plugin reads either, is named in X-miLLM-Ignored-Fields (refused under
X-miLLM-Strict); a key the template reads changes the prompt and is not reported."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from millm_core.config import load_settings
from millm_core.registry import ServedModel
from millm_core.templatevars import template_variables
from millm_engines.transformers.testing import tiny_model_dir

from ..conftest import TEMPLATES, _load
from .test_honesty import ignored

MESSAGES = [{"role": "user", "content": "Say something."}]
# A template that reads one variable of its own, ``greeting``, besides the usual ones.
GREETING = (
    "{% if greeting %}{{ greeting }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _served(tmp: pathlib.Path, name: str, template: str) -> ServedModel:
    path = tmp / f"{name}.jinja"
    path.write_text(template)
    return _load(tiny_model_dir(context=2048), name, load_settings({"log_level": "warning", "chat_template": str(path)}, environ={}))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServedModel]:
    tmp = tmp_path_factory.mktemp("kwargs-templates")
    think = re.sub(r"\{#.*?#\}", "", (pathlib.Path(TEMPLATES) / "think.jinja").read_text(), flags=re.S)
    # A reasoning template (its <think> block) that never reads enable_thinking itself.
    always = think.replace("enable_thinking is defined and enable_thinking is false", "false")
    assert "enable_thinking" not in always
    return {"greeting": _served(tmp, "tiny-greeting", GREETING), "always-thinks": _served(tmp, "tiny-always-thinks", always)}


@pytest.fixture(scope="module")
def srv(make_server, models: dict[str, ServedModel], tiny_model: ServedModel) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    with make_server(models=[*models.values(), tiny_model]) as running:
        yield running


def _chat(srv: Any, model: str, kwargs: dict[str, Any], **headers: str) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0, "chat_template_kwargs": kwargs}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_key_the_template_reads_is_honoured_and_one_it_never_reads_is_reported(srv: Any) -> None:
    plain = _chat(srv, "tiny-greeting", {})
    greeted = _chat(srv, "tiny-greeting", {"greeting": "Hello there, friend."})
    both = _chat(srv, "tiny-greeting", {"greeting": "Hello there, friend.", "flag": True, "a b": 1})
    assert plain.status_code == greeted.status_code == both.status_code == 200, both.text
    # The template read greeting: the prompt grew; flag and "a b" changed nothing.
    assert greeted.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    assert both.json()["usage"]["prompt_tokens"] == greeted.json()["usage"]["prompt_tokens"]
    assert ignored(greeted) is None
    assert ignored(both) == ["chat_template_kwargs.flag", 'chat_template_kwargs["a b"]']


def test_strict_mode_refuses_a_key_nothing_reads(srv: Any) -> None:
    resp = _chat(srv, "tiny-greeting", {"flag": True}, **{"X-miLLM-Strict": "true"})
    error = resp.json()["error"]
    assert (resp.status_code, error["code"], error["param"]) == (400, "unused_fields_refused", "chat_template_kwargs.flag")
    assert _chat(srv, "tiny-greeting", {"greeting": "hi"}, **{"X-miLLM-Strict": "true"}).status_code == 200


def test_enable_thinking_is_reported_only_where_nothing_reads_it(srv: Any, make_server, tiny_model: ServedModel) -> None:  # type: ignore[no-untyped-def]
    off = {"enable_thinking": False}
    # The tiny model's template has no such variable, it has no reasoning block, and the
    # sampling defaults are the same in both modes: nothing reads it.
    assert "enable_thinking" not in (template_variables(str(tiny_model.engine.chat_template)) or ("enable_thinking",))
    assert ignored(_chat(srv, "tiny", off)) == ["chat_template_kwargs.enable_thinking"]
    # The reasoning plugin reads it on a model with a reasoning block, whatever the template
    # reads; a template without the switch cannot turn thinking off: refused, not ignored.
    assert ignored(_chat(srv, "tiny-always-thinks", {"enable_thinking": True})) is None
    refused = _chat(srv, "tiny-always-thinks", off)
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "chat_template_kwargs.enable_thinking"), refused.text
    assert "no enable_thinking switch" in error["message"]
    # The sampling plugin reads it when it picks other defaults for thinking off (not for a greedy request).
    with make_server(sampling_defaults_no_thinking={"temperature": 0.5}) as modes:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": off}
        assert ignored(httpx.post(modes.base_url + "/v1/chat/completions", json=body, timeout=60)) is None
        assert ignored(_chat(modes, "tiny", off)) == ["chat_template_kwargs.enable_thinking"]  # temperature 0 sent: no defaults apply

