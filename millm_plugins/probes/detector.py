"""A probe ready to run: its head with the normalisation folded in, and the arithmetic
every path shares (live rows, parity at arming, ``POST /api/probes/score``), so that a
score means the same wherever it was computed.

A position's logit is ``z = w · (x - mean) / std + b`` over the basis vector ``x`` (the
residual, or the SAE's activations of it). A window's score is ``link(aggregate(z))``
over the window's positions: ``mean``, ``max`` or ``last`` of the logits, then the
logistic function (or none, for an ``identity`` link).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from millm_core.api import ServedModel

from .document import ModelIdentity, ProbeDocument, Window, decision_digest, detector_digest


@dataclass(frozen=True)
class Detector:
    """One probe compiled for scoring: float64 weights ``w`` (normalisation folded in)
    and bias ``b``."""

    probe_id: str
    name: str
    layer: int
    read_point: str
    basis: str
    sae_id: str | None
    w: np.ndarray
    b: float
    aggregation: str
    link: str
    threshold: float
    window_thresholds: dict[str, float]
    detector_digest: str
    decision_digest: str
    identity: ModelIdentity

    @classmethod
    def of(cls, doc: ProbeDocument) -> Detector:
        assert doc.id is not None
        w = np.asarray(doc.head.weights, dtype=np.float64)
        b = float(doc.head.bias)
        norm = doc.head.normalization
        if norm is not None:
            std = np.asarray(norm.std, dtype=np.float64)
            mean = np.asarray(norm.mean, dtype=np.float64)
            w = w / std
            b = b - float(np.dot(w, mean))
        return cls(
            probe_id=doc.id, name=doc.name, layer=doc.layer, read_point=doc.read_point, basis=doc.basis.kind,
            sae_id=doc.basis.sae_id, w=w, b=b, aggregation=doc.aggregation, link=doc.head.link,
            threshold=doc.decision.threshold, window_thresholds={str(k): v for k, v in doc.decision.windows.items()},
            detector_digest=detector_digest(doc), decision_digest=decision_digest(doc), identity=doc.model,
        )  # fmt: skip

    @property
    def width(self) -> int:
        return int(self.w.shape[0])

    def threshold_for(self, window: Window) -> float:
        return self.window_thresholds.get(window, self.threshold)

    def features(self, vectors: np.ndarray, sae: Any | None) -> np.ndarray:
        """The basis vectors of residual vectors ``[n, d_model]`` (``sae``: the attached SAE
        of a ``sae_features`` probe)."""
        if self.basis != "sae_features":
            return np.asarray(vectors)
        assert sae is not None
        return np.asarray(sae.encode(vectors))

    def score(self, logits: np.ndarray) -> float | None:
        """The score of a window whose per-position logits are ``logits`` (None: empty)."""
        if len(logits) == 0:
            return None
        return link(aggregate(logits, self.aggregation), self.link)

    def linked(self, aggregated: float | None) -> float | None:
        """The score of a window whose logits aggregated to ``aggregated`` (None: empty)."""
        return None if aggregated is None else link(aggregated, self.link)


ROWS = 256  # positions encoded and scored at a time
_BLOCK = 1 << 21  # the most elements of one float64 copy (16 MiB)
_SMALL = 1 << 16  # below this many elements a product is not worth torch's thread pool


def slices(n: int, rows: int = ROWS) -> Iterator[slice]:
    """``0 .. n`` in slices of at most ``rows`` positions."""
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def logits(features: np.ndarray, weights: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Per-position logits ``[n, P]`` of basis vectors ``[n, width]`` under ``P`` heads
    (``weights [width, P]`` float64, ``bias [P]``), accumulated in float64. The features are
    converted a column block at a time, so no float64 copy holds more than 2**21 values,
    and the products run on torch's thread pool (this runs on the model thread)."""
    x = np.asarray(features)
    n, width = x.shape
    step = max(1, _BLOCK // max(n, 1))
    if step >= width:  # one block: the usual case (a decode step, a residual basis)
        return _matmul64(x, weights) + bias
    out = np.zeros((n, weights.shape[1]), dtype=np.float64)
    for start in range(0, width, step):
        out += _matmul64(x[:, start : start + step], weights[start : start + step])
    return out + bias


def _matmul64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = np.ascontiguousarray(x, dtype=np.float64)
    if x64.size < _SMALL:  # a decode step's few values: numpy, which stays on this thread, is quicker
        return np.asarray(x64 @ w)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of millm
        return np.asarray(x64 @ w)
    with torch.inference_mode():
        return (torch.from_numpy(x64) @ torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))).numpy()


def position_logits(vectors: np.ndarray, sae: Any | None, weights: np.ndarray, bias: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(offset, logits [rows, P])`` of residual vectors ``[n, d_model]``, ``ROWS``
    positions at a time (``sae``: encode each slice first), so that an SAE's activations
    are never held for more than ``ROWS`` positions."""
    if len(vectors) <= ROWS:
        yield 0, logits(sae.encode(vectors) if sae is not None else vectors, weights, bias)
        return
    for part in slices(len(vectors)):
        rows = vectors[part]
        feats = sae.encode(rows) if sae is not None else rows
        yield part.start, logits(feats, weights, bias)


def aggregate(values: np.ndarray, how: str) -> float:
    if how == "mean":
        return float(np.mean(values))
    if how == "max":
        return float(np.max(values))
    return float(values[-1])


def link(value: float, kind: str) -> float:
    if kind == "identity":
        return value
    if value >= 0:
        return 1.0 / (1.0 + math.exp(-value))
    e = math.exp(value)
    return e / (1.0 + e)


def score_tokens(detector: Detector, residual: np.ndarray, sae: Any | None, span: tuple[int, int] | None = None) -> float | None:
    """The score of residual vectors ``[n, d_model]`` read for one sequence, over
    positions ``span`` (half-open; None: all of them). Only the span's positions are
    encoded, ``ROWS`` at a time."""
    start, end = span if span is not None else (0, len(residual))
    own = sae if detector.basis == "sae_features" else None
    assert detector.basis != "sae_features" or own is not None
    weights, bias = detector.w[:, None], np.array([detector.b])
    parts = [z[:, 0] for _, z in position_logits(residual[start:end], own, weights, bias)]
    return detector.score(np.concatenate(parts) if parts else np.zeros(0))


def template_sha256(template: str | None) -> str | None:
    """The chat-template hash a probe document records: SHA-256 (hex) of the UTF-8 source."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest() if template else None


def identity_of(model: ServedModel) -> ModelIdentity:
    """The served model's identity, as probe documents record it."""
    template = getattr(model.engine, "chat_template", None)
    return ModelIdentity(
        d_model=model.info.d_model,
        n_layers=model.info.n_layers,
        chat_template_sha256=template_sha256(template if isinstance(template, str) else None),
    )


def identity_mismatches(want: ModelIdentity, have: ModelIdentity) -> list[str]:
    """The identity fields that differ, as ``model.<field>`` paths."""
    return [f"model.{name}" for name in ("d_model", "n_layers", "chat_template_sha256") if getattr(want, name) != getattr(have, name)]


def stack(detectors: Sequence[Detector]) -> tuple[np.ndarray, np.ndarray]:
    """The heads of probes sharing a basis, side by side: ``([width, P], [P])``."""
    return np.stack([d.w for d in detectors], axis=1), np.array([d.b for d in detectors], dtype=np.float64)
