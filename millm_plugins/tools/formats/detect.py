"""Reading a chat template's source: whether it takes tools, and which call format it writes.
Data-driven: markers and shapes in the template text, never a model's name."""

from __future__ import annotations

import re
from typing import Any

from .base import CallFormat
from .hermes import HERMES
from .llama3 import LLAMA3
from .pythonic import PYTHONIC

# LFM2's first template lists tools between <|tool_list_start|> markers and never writes a call
# itself; LFM2.5's writes its history's calls between <|tool_call_start|> markers.
_PYTHONIC_MARKERS = ("<|tool_call_start|>", "<|tool_list_start|>")
_HERMES_MARKER = "<tool_call>"
# Templates that reuse <tool_call> around a body that is not JSON (XML-like parameters).
_NOT_JSON_BODY = ("<function=", "<parameter=", "<arg_key>")
# A quoted key followed by a colon, as the template source spells it (quotes may be escaped
# inside a Jinja string literal).
_ARGUMENTS_KEY = re.compile(r'\\?"arguments\\?"\s*:')
_LLAMA3_SHAPE = re.compile(r'\\?"name\\?"\s*:[\s\S]{0,200}?\\?"parameters\\?"\s*:')
_TOOLS_WORD = re.compile(r"\btools\b")


def detect_format(template: str) -> CallFormat | None:
    """The call format a chat template writes, read off its source: ``<|tool_call_start|>`` or
    ``<|tool_list_start|>`` → pythonic; ``<tool_call>`` around a JSON body with an
    ``"arguments"`` key → hermes; a template that takes tools and shows a ``{"name": …,
    "parameters": …}`` object (in its instructions or its rendering of a call) → llama3; else
    None (no recognised format: tools are then refused)."""
    if any(marker in template for marker in _PYTHONIC_MARKERS):
        return PYTHONIC
    if _HERMES_MARKER in template:
        if any(marker in template for marker in _NOT_JSON_BODY) or not _ARGUMENTS_KEY.search(template):
            return None
        return HERMES
    if _LLAMA3_SHAPE.search(template) and takes_tools(template):
        return LLAMA3
    return None


def takes_tools(template: str) -> bool:
    """Whether the template reads the ``tools`` variable at all: the undeclared variables of the
    parsed template, or a word search when the template does not parse here."""
    try:
        import jinja2
        import jinja2.meta
    except ImportError:  # pragma: no cover - jinja2 comes with the transformers engine
        return bool(_TOOLS_WORD.search(template))
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _generation_tags()])
    try:
        parsed = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return bool(_TOOLS_WORD.search(template))
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def _generation_tags() -> type:
    """An extension reading transformers' ``{% generation %}…{% endgeneration %}`` (which marks
    the assistant's tokens) as a plain block, so such templates parse here too."""
    from jinja2.ext import Extension

    class GenerationTags(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTags
