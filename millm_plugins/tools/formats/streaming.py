"""What a stream must hold back while a reply may still turn into a call."""

from __future__ import annotations

from .base import CallFormat


def holdback(fmt: CallFormat, text: str) -> int:
    """How many characters at the end of ``text`` (the reply so far) must not be streamed yet
    because they may belong to a call: ``len(text)`` minus the index where a complete or partial
    ``fmt.start`` begins (0 when none does).

    Whitespace just before that index (or at the very end) is held too, because ``parse`` drops
    the whitespace between content and a call: streamed content then equals the content of the
    same reply served whole. For a whole-reply format everything is held while the reply is only
    whitespace or once it (stripped) starts with ``fmt.start``. The held start never moves back,
    so ``text[:len(text) - holdback(fmt, text)]`` only grows as ``text`` does; once the reply is
    done, the caller parses it and releases as content whatever was held and is not a call."""
    if fmt.whole_reply:
        stripped = text.lstrip()
        return len(text) if not stripped or stripped.startswith(fmt.start) else 0
    start = fmt.start
    index = text.find(start)
    if index < 0:
        index = len(text)
        for size in range(min(len(start) - 1, len(text)), 0, -1):
            if text.endswith(start[:size]):
                index = len(text) - size
                break
    while index > 0 and text[index - 1].isspace():
        index -= 1
    return len(text) - index
