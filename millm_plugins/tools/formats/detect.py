"""Reading a chat template's source: whether it takes tools, and which call format it writes.
Data-driven: markers and shapes in the template text, never a model's name."""

from __future__ import annotations

import re

from millm_core.api import template_variables

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
    found = template_variables(template)
    if found is None:
        return bool(_TOOLS_WORD.search(template))
    return "tools" in found
