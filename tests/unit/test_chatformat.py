"""The rendering rules every engine shares: continuation and the size bound."""

from __future__ import annotations

import pytest

from millm_core.chatformat import MAX_RENDERED_CHARS, render_with_continuation
from millm_core.errors import InvalidRequest


def test_a_trailing_assistant_message_is_continued() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert render_with_continuation(lambda head: f"[{len(head)}]", messages) == "[1]Hel"


def test_a_render_past_the_limit_is_refused() -> None:
    """A template that expands its messages enormously is refused before tokenising."""

    def explode(head: object) -> str:
        return "x" * (MAX_RENDERED_CHARS + 1)

    with pytest.raises(InvalidRequest) as info:
        render_with_continuation(explode, [{"role": "user", "content": "hi"}])
    assert (info.value.code, info.value.param) == ("prompt_too_large", "messages")
    assert render_with_continuation(lambda head: "x" * MAX_RENDERED_CHARS, [{"role": "user", "content": "hi"}])
