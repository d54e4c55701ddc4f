"""Refuses requests whose text contains a banned word, and marks every response.

It shows what a feature plugin usually does: declare a setting (``--guard-word`` /
``MILLM_GUARD_WORD``), validate (refuse with a clear 400 naming the field), pre-forward
(set a header) and finalize (add a body extension). It imports only millm_core.
"""

from __future__ import annotations

from typing import Any

from millm_core.config import PluginSetting
from millm_core.hookspecs import hookimpl
from millm_core.pipeline_types import Problem


@hookimpl
def millm_register_settings(register: Any) -> None:
    register(PluginSetting("guard_word", "forbidden", "the word this server refuses"))


def _texts(request: Any) -> list[tuple[str, str]]:
    if hasattr(request, "messages"):
        return [(f"messages[{i}].content", m.text()) for i, m in enumerate(request.messages)]
    prompts = request.prompts()
    return [("prompt" if isinstance(request.prompt, str) else f"prompt[{i}]", p) for i, p in enumerate(prompts)]


@hookimpl(tryfirst=True)
def millm_validate(ctx: Any, request: Any) -> list[Problem]:
    banned = ctx.settings.plugin("guard_word")
    return [
        Problem(f"{where} contains the word {banned!r}, which this server refuses", param=where, code="content_refused")
        for where, text in _texts(request)
        if banned in text
    ]


@hookimpl
def millm_pre_forward(ctx: Any, request: Any, plan: Any) -> None:
    ctx.set_header("X-Guard", "checked")


@hookimpl
def millm_finalize(ctx: Any, request: Any, outcome: Any, out: Any) -> None:
    out.extensions["guard"] = {"choices_checked": len(outcome.choices)}
