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


def has_tool_history(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a chat carries function-calling history (an assistant's ``tool_calls`` or
    a ``tool`` message), which only a chat template can render."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def refuse_tools_without_template(messages: Sequence[Mapping[str, Any]], tools: object) -> None:
    """A model without a chat template cannot show tools or render tool history: refuse
    with 400 rather than drop them (the generic format has no place for them)."""
    if tools:
        raise InvalidRequest("this model has no chat template, so it cannot be shown tools", code="field_not_honoured", param="tools")
    if has_tool_history(messages):
        raise InvalidRequest(
            "this model has no chat template, so it cannot render tool calls or tool results in messages", param="messages"
        )


def operator_chat_template(path: str | None) -> str | None:
    """The chat template file an operator named (``--chat-template``), read once at
    load; an unreadable file stops the load with its reason."""
    if not path:
        return None
    from .errors import ConfigError

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"--chat-template {path}: {exc.strerror or exc}") from exc
    if not text.strip():
        raise ConfigError(f"--chat-template {path}: the file is empty")
    return text
