"""The reasoning plugin's request fields and settings."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from millm_core.api import Endpoint, PluginSetting, RequestField

from .loops import LoopGuard

NAME = "reasoning"
CHAT: tuple[Endpoint, ...] = ("chat.completions",)
Effort = Literal["none", "minimal", "low", "medium", "high", "max"]


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def _guard(text: str) -> str:
    value = text.strip().lower()
    if value not in ("rewind", "off"):
        raise ValueError('must be "rewind" or "off"')
    return value


def _markers(text: str) -> tuple[str, str] | None:
    parts = [p for p in text.split(",") if p]
    if not parts:
        return None
    if len(parts) != 2:
        raise ValueError('give the opening and the closing marker, comma-separated: "<think>,</think>"')
    return parts[0], parts[1]


THINKING_BUDGET = PluginSetting(
    "thinking_budget", 0, "reasoning tokens a request may spend before its close is forced, when it sends no thinking_budget (0: no budget)",
    _non_negative,
)  # fmt: skip
ANSWER_RESERVE = PluginSetting(
    "thinking_answer_reserve", 2048, "tokens of max_tokens a thinking budget always leaves for the answer (at most half of max_tokens)",
    _non_negative,
)  # fmt: skip
LOOP_GUARD = PluginSetting("loop_guard", "rewind", 'take a repeated span in the reasoning back ("rewind") or not ("off")', _guard)
MARKERS = PluginSetting[tuple[str, str] | None](
    "reasoning_markers", None, 'the reasoning block\'s markers when the built-in list lacks them: "<open>,<close>"', _markers
)

BUDGET: RequestField[int] = RequestField(
    "thinking_budget", Annotated[int, Meta(ge=0)], CHAT, owner=NAME,
    description="reasoning tokens this request may spend before its close is forced (0: no budget; absent: the server's --thinking-budget)",
)  # fmt: skip
EFFORT: RequestField[str] = RequestField(
    "reasoning_effort", Effort, CHAT, owner=NAME,
    description='"none" turns thinking off, "max" runs with no thinking budget; the other values are reported unused',
)  # fmt: skip

DEFAULT_GUARD = LoopGuard()
