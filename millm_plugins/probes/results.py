"""The result contract ``mi.probe.result/v1``: one result per probe, window and row, in
the response (``millm_probe_verdicts``, ``X-miLLM-Probe-Verdicts``), in the events log
and from ``POST /api/probes/score``. Published as ``docs/schemas/mi-probe-result-v1.json``
(:mod:`.published`)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import msgspec

from .detector import Detector
from .document import Window
from .trace import Trace

SCHEMA = "mi.probe.result/v1"

ResultOutcome = Literal["scored", "skipped", "not_monitored", "interrupted", "error"]
# Each outcome's reason codes.
REASONS: dict[str, tuple[str, ...]] = {
    "scored": ("ok",),
    "skipped": (
        "model_mismatch",  # the served model is not the one the probe was fitted on
        "engine_cannot_tap",  # the engine cannot read residuals back (GGUF)
        "sae_not_attached",  # a sae_features probe's SAE is not attached (usable) at its layer
        "empty_window",  # the window holds no position that was read
        "not_a_chat",  # last_user on a text completion or raw token ids
        "no_user_message",  # last_user on a chat without a user message
        "window_unplaced",  # the render could not be repeated to place last_user
        "no_response",  # response on POST /api/probes/score (nothing is generated)
    ),
    "not_monitored": ("scoring_request", "embeddings_request"),
    "interrupted": ("stream_ended_early",),
    "error": ("non_finite_score", "probe_failed"),
}
Reason = Literal[
    "ok", "model_mismatch", "engine_cannot_tap", "sae_not_attached", "empty_window", "not_a_chat", "no_user_message",
    "window_unplaced", "no_response", "scoring_request", "embeddings_request", "stream_ended_early", "non_finite_score",
    "probe_failed",
]  # fmt: skip
Verdict = Literal["flagged", "clear"]


class ProbeRef(msgspec.Struct, kw_only=True):
    """Which probe this result is from."""

    id: str
    name: str
    layer: int
    read_point: str
    basis: Literal["residual", "sae_features"]
    sae_id: str | None
    aggregation: Literal["mean", "max", "last"]


class Positions(msgspec.Struct, kw_only=True):
    """The half-open positions the window covered (absolute over prompt then response)."""

    start: int
    end: int


class Served(msgspec.Struct, kw_only=True):
    """How the row was served: the request, the model and engine, whether its rows could
    share decode steps (``backend``), which choice (``choice``) of which prompt, where the
    probe read (``read_point``: ``unsteered`` for POST /api/probes/score) and whether this
    row carried a steering delta at the probe's layer."""

    request_id: str
    endpoint: str
    model: str
    engine: str
    backend: Literal["batched", "serial"] | None = None
    stream: bool = False
    choice: int | None = None
    prompt_index: int | None = None
    input: int | None = None
    read_point: Literal["pre_steering", "post_steering", "unsteered"]
    steered_at_layer: bool | None = None
    positions: Positions | None = None


class ProbeResult(msgspec.Struct, kw_only=True):
    """``mi.probe.result/v1``: what one probe found in one window of one row.

    ``outcome`` is ``scored`` (``score`` and ``verdict`` set), ``skipped`` (nothing to
    read: ``reason`` says why), ``not_monitored`` (scoring and embeddings requests),
    ``interrupted`` (a stream that ended early: ``score`` over what was read) or
    ``error``. ``verdict`` is ``flagged`` when ``score >= threshold``. ``name`` and
    ``scored`` are the older keys, kept beside ``probe`` and ``outcome``."""

    schema: Literal["mi.probe.result/v1"] = "mi.probe.result/v1"
    result_id: str
    probe: ProbeRef
    window: Window
    outcome: ResultOutcome
    reason: Reason
    score: float | None
    threshold: float
    verdict: Verdict | None
    detector_digest: str
    decision_digest: str
    served: Served
    trace_id: str
    parent_id: str | None
    trace_source: Literal["traceparent", "minted"]
    created: float
    name: str
    scored: bool


def probe_ref(detector: Detector) -> ProbeRef:
    return ProbeRef(
        id=detector.probe_id, name=detector.name, layer=detector.layer, read_point=detector.read_point,
        basis=detector.basis, sae_id=detector.sae_id, aggregation=detector.aggregation,  # type: ignore[arg-type]
    )  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """What a window came to before it becomes a result."""

    outcome: str
    reason: str
    score: float | None = None
    span: tuple[int, int] | None = None


def scored(score: float | None, span: tuple[int, int] | None, interrupted: bool = False) -> Finding:
    """A window's finding from its score (None: nothing read in it)."""
    if score is None:
        return Finding("interrupted" if interrupted else "skipped", "stream_ended_early" if interrupted else "empty_window", None, span)
    if not math.isfinite(score):
        return Finding("error", "non_finite_score", None, span)
    if interrupted:
        return Finding("interrupted", "stream_ended_early", score, span)
    return Finding("scored", "ok", score, span)


def result(detector: Detector, window: Window, finding: Finding, served: Served, trace: Trace) -> ProbeResult:
    threshold = detector.threshold_for(window)
    score = finding.score
    verdict: Verdict | None = None if score is None else ("flagged" if score >= threshold else "clear")
    if finding.span is not None:
        served = msgspec.structs.replace(served, positions=Positions(start=finding.span[0], end=finding.span[1]))
    return ProbeResult(
        result_id="pr_" + uuid.uuid4().hex, probe=probe_ref(detector), window=window, outcome=finding.outcome,  # type: ignore[arg-type]
        reason=finding.reason, score=score, threshold=threshold, verdict=verdict,  # type: ignore[arg-type]
        detector_digest=detector.detector_digest, decision_digest=detector.decision_digest, served=served,
        trace_id=trace.trace_id, parent_id=trace.parent_id, trace_source=trace.source, created=time.time(),
        name=detector.name, scored=finding.outcome == "scored",
    )  # fmt: skip


def ordered(results: list[ProbeResult]) -> list[ProbeResult]:
    """Sorted by probe name, then window (both as strings), then probe id and choice: the
    header's order too."""
    return sorted(results, key=lambda r: (r.probe.name, r.window, r.probe.id, r.served.choice or 0, r.served.input or 0))
