"""Chat rendering rules every engine shares.

- **Fallback format** for a model without a chat template: one ``role: content`` line per
  message, then ``assistant:`` (documented in docs/chat-templates.md).
- **Continuation**: a chat whose last message is the assistant's is a partial answer to
  continue, not to restart. The messages before it are rendered with the generation
  prompt, and the partial text is appended as it is, so generation resumes exactly where
  it ended.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidRequest


def generic_chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The fallback format: one ``role: content`` line per message, then ``assistant:``."""
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def split_continuation(messages: Sequence[Mapping[str, Any]]) -> tuple[Sequence[Mapping[str, Any]], str | None]:
    """``(messages to render, partial answer)``; the partial is None unless the chat ends
    with an assistant message (its content, as text)."""
    if len(messages) > 1 and messages[-1].get("role") == "assistant":
        content = messages[-1].get("content") or ""
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
        return messages[:-1], content
    return messages, None


# A rendered chat longer than this is refused before it is tokenised: a template cannot
# turn a 4 MiB body into an unbounded prompt.
MAX_RENDERED_CHARS = 16 * 2**20


def render_with_continuation(render: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """``render(messages) -> text`` (with the generation prompt), continuing a trailing
    assistant message. A render past :data:`MAX_RENDERED_CHARS` is refused."""
    head, partial = split_continuation(messages)
    text = str(render(head))
    text = text if partial is None else text + partial
    if len(text) > MAX_RENDERED_CHARS:
        raise InvalidRequest(
            f"the chat template renders these messages to {len(text)} characters; the limit is {MAX_RENDERED_CHARS}",
            code="prompt_too_large",
            param="messages",
        )
    return text
