"""Which variables a chat template reads, from its Jinja source.

A request's ``chat_template_kwargs`` become template variables; a key the template never
reads changes nothing, and the core reports it unused (``chat_template_kwargs.<key>`` in
``X-miLLM-Ignored-Fields``) unless a plugin reads it itself. The tools plugin uses the same
reading to tell whether a template takes ``tools``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str] | None:
    """The names a Jinja template reads without setting them itself (its variables, and
    globals it calls such as ``raise_exception``); None when
    jinja2 is missing or the source does not parse here (the reading is then unknown).
    transformers' ``{% generation %}`` blocks and loop controls parse as they render."""
    try:
        import jinja2
        import jinja2.meta
    except ImportError:  # pragma: no cover - jinja2 comes with transformers
        return None
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _generation_tags()])
    try:
        parsed = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return None
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


def key_location(key: str) -> str:
    """Where a ``chat_template_kwargs`` key is, as error params and unused-field reports
    name it: ``chat_template_kwargs.enable_thinking``; a key that is not an identifier is
    quoted (``chat_template_kwargs["a b"]``)."""
    return f"chat_template_kwargs.{key}" if key.isidentifier() else f"chat_template_kwargs[{json.dumps(key)}]"


@lru_cache(maxsize=1)
def _generation_tags() -> type:
    """An extension reading transformers' ``{% generation %}…{% endgeneration %}`` (which
    marks the assistant's tokens) as a plain block, so such templates parse here too."""
    from jinja2.ext import Extension

    class GenerationTags(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTags
