"""Which reasoning block a model writes, read off its chat template (never its name).

A template that renders a reasoning block names both of its markers (Qwen3 and DeepSeek-R1
write ``<think>`` … ``</think>``); the first known pair whose two markers both appear in
the template is the model's. ``--reasoning-markers`` names a pair the list lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KNOWN_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<reasoning>", "</reasoning>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
)

# How far back into a prompt the reasoning state is read (tokens).
PROMPT_TAIL_TOKENS = 48

Start = str  # "reasoning" | "content" | "open": where a row starts


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning block: its markers, and token ids the reasoning processor
    forces: ``open_ids`` (the opening and a newline), ``close_ids`` (the close after
    reasoning text that ends a line; ``close_nl_ids`` after text that does not) and
    ``gap_ids`` (the blank line a template writes after the close)."""

    open: str
    close: str
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    close_nl_ids: tuple[int, ...]
    gap_ids: tuple[int, ...]

    def start(self, engine: Any, prompt_ids: Sequence[int], opening: str = "") -> Start:
        """Where a row with this prompt starts, read off the prompt's end (``opening``,
        text the prompt ends with for a forced call, set aside): inside the block (the
        prompt opened it), in the answer (the prompt closed it: thinking off), or
        ``open``: the model may open the block itself. A block of an earlier turn is
        followed by more of the conversation, so it never decides."""
        tail = engine.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])).rstrip()
        if opening.strip() and tail.endswith(opening.rstrip()):
            tail = tail[: len(tail) - len(opening.rstrip())].rstrip()
        if tail.endswith(self.open):
            return "reasoning"
        if tail.endswith(self.close):
            return "content"
        return "open"


def markers_of(template: str | None, override: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """The reasoning markers this template renders, or None for a model without a
    reasoning block. ``override`` (from the settings) is used when the template has both."""
    if not template:
        return None
    for pair in ((override,) if override else ()) + KNOWN_MARKERS:
        if pair[0] in template and pair[1] in template:
            return pair
    return None


def reasoning_format(engine: Any, pair: tuple[str, str]) -> ReasoningFormat:
    """The format with its forced-close token ids (tokenised once, when the model loads)."""
    opening, close = pair

    def ids(text: str) -> tuple[int, ...]:
        return tuple(engine.encode(text, add_special_tokens=False))

    return ReasoningFormat(
        open=opening,
        close=close,
        open_ids=ids(opening + "\n"),
        close_ids=ids(close + "\n\n"),
        close_nl_ids=ids("\n" + close + "\n\n"),
        gap_ids=ids("\n\n"),
    )
