"""The query string of OpenAI's list endpoints (``after``, ``limit``, …), checked by name."""

from __future__ import annotations

from collections.abc import Mapping

from millm_core.api import InvalidRequest


def query(params: Mapping[str, str], allowed: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, refusing any this endpoint does not take (400 naming it)."""
    for name in params:
        if name not in allowed:
            raise InvalidRequest(
                f"unknown query parameter {name!r}; this endpoint takes {', '.join(allowed)}", code="unknown_parameter", param=name
            )
    return dict(params)


def limit(params: Mapping[str, str], default: int, most: int) -> int:
    """``limit``: an integer from 1 to ``most``."""
    text = params.get("limit")
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= most:
        raise InvalidRequest(f"limit must be an integer from 1 to {most}, not {text!r}", param="limit")
    return int(text)
