"""The per-row reader: takes the row's residual vectors at the SAE's layer as the engine
reads them (prefill, then one position per decode step), encodes the wanted positions
with the SAE's own encoder and keeps the ``top_k`` largest candidates per position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from millm_core.api import Readout, Tap

from .fields import PositionRange, ReturnSAEActivations
from .select import Selected

NOTES = {
    "post_steering": (
        "post_steering is what the model computed at this layer for this request, this layer's steering delta included; "
        "it is not an unsteered counterfactual: steering at earlier layers, and tokens generated under steering, "
        "shaped it too"
    ),
    "pre_steering": (
        "pre_steering is this layer's output before this request's delta at this layer; steering at earlier layers, "
        "and tokens generated under steering, still shaped it: it is not an unsteered counterfactual"
    ),
}


class Collector:
    """A :class:`~millm_core.api.TokenProcessor` (and residual listener) for one row."""

    def __init__(self, asked: ReturnSAEActivations, selected: Selected, prompt_ids: tuple[int, ...]) -> None:
        self.asked = asked
        self.selected = selected
        self.tap = Tap(selected.layer, asked.read_point)
        self.prompt_tokens = len(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.read: list[tuple[int, list[tuple[int, float]]]] = []  # (position, [(index, value)])
        self.last: tuple[int, np.ndarray] | None = None  # for positions "last": the latest vector
        self.candidates = np.asarray(selected.features, dtype=np.int64) if selected.features is not None else None
        # The candidates' encoder columns alone when possible: their activations, for a
        # fraction of the work (indices then map through ``self.candidates``).
        self.encoder = selected.encoder
        self.restricted = self.encoder is not selected.sae

    # ------------------------------------------------------------------ per-token stage

    def logit_bias(self) -> Mapping[int, float] | None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        if token_id >= 0:  # -1: text released as the row ends, no new token
            self.token_ids.append(token_id)
        return text, False

    def flush(self) -> str:
        return ""

    def on_residuals(self, readout: Readout) -> None:
        vectors = readout.vectors.get(self.tap)
        if vectors is None:
            return
        positions = range(readout.start, readout.start + len(vectors))
        if self.asked.positions == "last":
            self.last = (positions[-1], np.array(vectors[-1:], copy=True))
            return
        wanted = [i for i, p in enumerate(positions) if self._wanted(p)]
        if wanted:
            acts = self.encoder.encode(np.asarray(vectors)[wanted])
            self.read += [(positions[i], self._top(row)) for i, row in zip(wanted, acts, strict=True)]

    def end(self, finish_reason: str) -> None:
        """As the row ends, on the model thread: encode the last position read."""
        if self.last is not None:
            position, vector = self.last
            self.read.append((position, self._top(self.encoder.encode(vector)[0])))
            self.last = None

    # ------------------------------------------------------------------ result

    def _wanted(self, position: int) -> bool:
        positions = self.asked.positions
        if positions == "all":
            return True
        if positions == "prompt":
            return position < self.prompt_tokens
        if positions == "completion":
            return position >= self.prompt_tokens
        assert isinstance(positions, PositionRange)
        return positions.start <= position < positions.end

    def _top(self, acts: np.ndarray) -> list[tuple[int, float]]:
        """The ``top_k`` largest candidates, by value then index. Without a candidate list
        only active features (value ≠ 0) are listed; a listed candidate is listed even at 0."""
        if self.candidates is not None:
            indices, values = self.candidates, (acts if self.restricted else acts[self.candidates])
        else:
            active = np.flatnonzero(acts)
            indices, values = active, acts[active]
        k = min(self.asked.top_k, len(indices))
        if k == 0:
            return []
        order = np.lexsort((indices, -values))[:k]
        return [(int(indices[i]), float(values[i])) for i in order]

    def result(self) -> dict[str, Any]:
        """The ``millm.sae_activations`` object: the positions actually read, ascending."""
        read = list(self.read)
        return {
            "sae_id": self.selected.sae_id,
            "layer": self.selected.layer,
            "read_point": self.asked.read_point,
            "positions": [
                {"position": p, "token_id": self.token_ids[p], "features": [{"index": i, "value": v} for i, v in feats]} for p, feats in read
            ],
            "note": NOTES[self.asked.read_point],
        }
