"""What another plugin may add to a scoring pass: reads of the scored prompts, run on the
model thread beside it (per-request SAE activations in scoring mode use it).

A plugin appends a :class:`ScoringReader` to :func:`readers` in its ``millm_startup``.
For each scoring request, before the forward pass, the scoring plugin calls every
reader's ``prepare``; a reader that has nothing to do returns None, one that does returns
a function that the scoring plugin runs on the model thread (``AppContext.run_model``)
after the pass. ``prepare`` may raise a request error (a 4xx): the request is then refused
before any model work. The reader keeps what it computed (in ``ctx.stash``) and reports it
from its own ``millm_finalize`` (``outcome.kind == "scoring"``). Scoring is unsteered, so
whatever a reader reads is too. A reader reads the served model in its own precision, so a
``scoring_precision: "float32"`` request for which a reader has work is refused (400
``field_not_honoured``, naming the reader's optional ``field`` attribute in its message).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from millm_core.api import AppContext, RequestContext, ServedModel, StashKey


class ScoringReader(Protocol):
    """A plugin's read of a scoring request's prompts (see the module)."""

    def prepare(
        self, ctx: RequestContext, request: Any, model: ServedModel, prompts: Sequence[Sequence[int]]
    ) -> Callable[[], None] | None: ...


READERS = StashKey[list[ScoringReader]]("scoring.readers")


def readers(app: AppContext) -> list[ScoringReader]:
    """The app's scoring readers (append yours in ``millm_startup``)."""
    return app.stash.setdefault(READERS, list)
