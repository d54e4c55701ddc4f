"""``return_sae_activations`` on a scoring request: the prompt's positions, read from an
unsteered forward pass (the engine's ``ResidualReader``) beside the scoring pass, through
the scoring plugin's reader extension. The read point is reported as ``unsteered``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from millm_core.api import Readout, RequestContext, ResidualReader, ServedModel, StashKey, Tap

from .collect import Collector
from .fields import FIELD, MAX_ENTRIES
from .select import PARAM, AttachmentUnusable, Selected, check_model, check_size

SCORED = StashKey[dict[str, Any]]("activations.scored")
NOTE = (
    "unsteered: a scoring pass is never steered, so this is what the model computed at this layer for this prompt "
    "with no steering anywhere"
)


class ScoringActivations:
    """A scoring reader (see :mod:`millm_plugins.scoring.contrib`)."""

    field = "return_sae_activations"

    def __init__(self, select: Callable[[Any, Any], Selected]) -> None:
        self._select = select

    def prepare(
        self, ctx: RequestContext, request: Any, model: ServedModel, prompts: Sequence[Sequence[int]]
    ) -> Callable[[], None] | None:
        asked = FIELD.get(request)
        if asked is None:
            return None
        engine = model.engine
        if not isinstance(engine, ResidualReader):
            raise AttachmentUnusable(f"the {model.info.engine} engine cannot read the residual stream for scoring", param=PARAM)
        selected = self._select(ctx.app, asked)
        check_model(selected, model.info.d_model, model.info.n_layers)
        prompt = tuple(prompts[0])
        check_size(asked, selected, len(prompt), 0, int(MAX_ENTRIES.get(ctx.settings)))

        def read() -> None:
            [vectors] = engine.residuals([prompt], selected.layer)
            collector = Collector(asked, selected, prompt)
            collector.on_residuals(Readout(start=0, vectors={Tap(selected.layer, asked.read_point): vectors}))
            collector.end("length")
            ctx.stash[SCORED] = {**collector.result(), "read_point": "unsteered", "note": NOTE}

        return read
