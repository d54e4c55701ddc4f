"""``POST /v1/completions``."""

from __future__ import annotations

from ...contracts.common import Usage
from ...contracts.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionResponse,
)
from ..respond import Shapes


def _full(
    rid: str, created: int, model: str, fingerprint: str, texts: list[str], reasons: list[str], usage: Usage, fields: object = None
) -> CompletionResponse:
    # ``fields`` (message fields of chat choices) have no place in a text completion.
    choices = [CompletionChoice(index=i, text=text, finish_reason=reasons[i]) for i, text in enumerate(texts)]  # type: ignore[arg-type]
    return CompletionResponse(id=rid, created=created, model=model, system_fingerprint=fingerprint, choices=choices, usage=usage)


def _chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    reason: str | None,
    first: bool,
    usage: Usage | None,
    fields: object = None,
) -> CompletionChunk:
    choice = CompletionChunkChoice(index=index, text=text or "", finish_reason=reason)  # type: ignore[arg-type]
    chunk = CompletionChunk(id=rid, created=created, model=model, choices=[choice])
    if usage is not None:
        chunk.usage = usage
    return chunk


SHAPES = Shapes(id_prefix="cmpl", full=_full, chunk=_chunk)
