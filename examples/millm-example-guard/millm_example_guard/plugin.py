"""Refuses requests whose text contains a banned word, and marks every response.

It shows what a feature plugin usually does, using only ``millm_core.api`` as any third
party would:

- declare a setting (``--guard-word`` / ``MILLM_GUARD_WORD``);
- own a request field (``guard_words``: more words to refuse for this one request), which
  the server then decodes, range-checks, publishes in its OpenAPI document and lists in
  ``/api/policy``;
- validate (refuse with a clear 400 naming the field);
- pre-forward (set a header) and finalize (add a body extension).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from msgspec import Meta

from millm_core.api import (
    GENERATION_ENDPOINTS,
    Finalization,
    ForwardPlan,
    Outcome,
    PluginSetting,
    Problem,
    RequestContext,
    RequestField,
    hookimpl,
)

NAME = "guard"
WORD = PluginSetting("guard_word", "forbidden", "the word this server refuses")
Word = Annotated[str, Meta(min_length=1, max_length=32)]
WORDS: RequestField[list[str]] = RequestField(
    "guard_words",
    Annotated[list[Word], Meta(max_length=8)],
    GENERATION_ENDPOINTS,
    owner=NAME,
    neutral=lambda value: value == [],
    description="more words (at most 8) to refuse in this request's text",
)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(WORD)


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(WORDS)


def _texts(request: Any) -> list[tuple[str, str]]:
    if hasattr(request, "messages"):
        return [(f"messages[{i}].content", m.text()) for i, m in enumerate(request.messages)]
    prompts: list[str] = request.prompts()
    return [("prompt" if isinstance(request.prompt, str) else f"prompt[{i}]", p) for i, p in enumerate(prompts)]


@hookimpl(tryfirst=True)
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    if ctx.endpoint == "embeddings":
        return []
    banned = [WORD.get(ctx.settings), *(WORDS.get(request) or [])]
    return [
        Problem(f"{where} contains the word {word!r}, which this server refuses", param=where, code="content_refused")
        for where, text in _texts(request)
        for word in banned
        if word in text
    ]


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    ctx.set_header("X-Guard", "checked")


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    out.extensions["guard"] = {"choices_checked": len(outcome.choices)}
