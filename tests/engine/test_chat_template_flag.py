"""``--chat-template``: an operator's template replaces the model's own on both engines,
and a file that cannot be read stops the load with its reason."""

from __future__ import annotations

import pathlib

import pytest

from millm_core.config import ConfigError, load_settings
from millm_core.engine import ModelLocation
from millm_engines.transformers.loader import load_engine

from ..gguf.helpers import load_gguf

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}<<assistant|{% endif %}"


def test_the_operators_template_is_rendered_on_both_engines(tiny_dir: str, gguf_path: str, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    settings = load_settings({"chat_template": str(path)}, environ={})
    hf = load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)
    gguf = load_gguf(gguf_path, "g", chat_template=str(path)).engine
    messages = [{"role": "user", "content": "hi"}]
    for engine in (hf, gguf):
        assert engine.chat_template == TEMPLATE
        assert engine.decode(engine.render_chat(messages)).endswith("<<user|hi>><<assistant|")


@pytest.mark.parametrize("content", [None, "  \n"])
def test_a_missing_or_empty_template_stops_the_load(tiny_dir: str, tmp_path: pathlib.Path, content: str | None) -> None:
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    settings = load_settings({"chat_template": str(path)}, environ={})
    with pytest.raises(ConfigError, match="--chat-template"):
        load_engine(ModelLocation(path=tiny_dir, served_name="t"), settings)
