"""Which positions each window covers, and where the last user message sits in the
render that was served.

Positions are absolute over the prompt's tokens followed by the generated ones. A row's
readable positions are ``0 .. fed - 1``: the last token a row draws is never fed back, so
it is never read.

- ``all``: every read position; ``prompt``: the prompt's; ``response``: the generated
  tokens that were fed (one fewer than were generated);
- ``last_user``: the tokens of the last ``user`` message's content in the served prompt.
  The chat is rendered a second time, exactly as served (the same messages after every
  plugin's ``millm_render_chat``, tools, template variables and opening) but with that
  message's content emptied; the window is what lies between the longest common prefix
  and the longest common suffix of the two renders. It therefore covers every token that
  depends on the content: a token the tokenizer merged across the content's edge is
  included, and a template that repeats the content elsewhere widens the window to span
  both places.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .document import Window

Span = tuple[int, int]


@dataclass(frozen=True)
class Placement:
    """The last user message's span in the served prompt, or why there is none
    (a reason code)."""

    span: Span | None
    reason: str = "ok"


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return None


def blanked(messages: Sequence[Mapping[str, Any]], index: int) -> list[dict[str, Any]]:
    """The messages with message ``index``'s content emptied."""
    out = [dict(m) for m in messages]
    out[index]["content"] = ""
    return out


def place(served: Sequence[int], other: Sequence[int]) -> Placement:
    """The span of ``served`` that differs from ``other`` (the render without the
    message's content): between their longest common prefix and suffix."""
    limit = min(len(served), len(other))
    prefix = 0
    while prefix < limit and served[prefix] == other[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and served[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    end = len(served) - suffix
    if end <= prefix:
        return Placement(None, "empty_window")
    return Placement((prefix, end))


def span_of(window: Window, prompt_tokens: int, fed: int, last_user: Span | None) -> Span | None:
    """The half-open positions ``window`` covers in a row that read ``fed`` positions
    (None: ``last_user`` without a placement)."""
    if window == "all":
        return 0, fed
    if window == "prompt":
        return 0, min(prompt_tokens, fed)
    if window == "response":
        return prompt_tokens, max(prompt_tokens, fed)
    if last_user is None:
        return None
    return min(last_user[0], fed), min(last_user[1], fed)
