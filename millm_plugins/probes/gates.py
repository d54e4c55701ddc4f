"""Arming a probe: its gates, in order, each refusal a ``409`` naming the gate (its code is
``probe_gate_<gate>``, the ``X-miLLM-Probe-Gate`` header says the gate too):

1. ``limit``: no more than ``probes_max_armed`` probes armed at once (re-arming an armed
   probe does not count twice);
2. ``model_identity``: the served model's width, block count and chat-template hash are
   the document's;
3. ``evidence``: rung 2 or more, or ``acknowledge_below_rung2``;
4. ``basis``: a ``sae_features`` probe's SAE is attached (and usable) at the probe's
   layer, with as many features as the head has weights, and millm encodes it faithfully
   (no input normalisation it does not apply: ``SAE.encode_refusal``);
5. ``parity``: every test vector, re-scored on this server (window ``all``, unsteered),
   is within the tolerance of its expected score (and there is at least one). The
   vectors are read and scored on the model thread; only their scores come back.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from millm_core.api import AppContext, MillmError, ModelNotLoaded, ResidualReader, ServedModel

from .book import Arming, ParityReport, Stored, VectorCheck
from .detector import identity_mismatches, identity_of, score_tokens
from .document import Window
from .saes import attached_sae, encode_refusal

GATE_HEADER = "X-miLLM-Probe-Gate"
GATES = ("limit", "model_identity", "evidence", "basis", "parity")


class GateRefused(MillmError):
    """409: a gate refused to arm the probe."""

    status = 409
    type = "invalid_request_error"

    def __init__(self, gate: str, message: str, *, param: str | None = None) -> None:
        super().__init__(f"the {gate} gate refused to arm this probe: {message}", code=f"probe_gate_{gate}", param=param,
                         headers={GATE_HEADER: gate})  # fmt: skip
        self.gate = gate


def resident(app: AppContext) -> ServedModel:
    """The model probes are armed against: the first one served."""
    model = next(iter(app.models), None)
    if model is None:
        raise ModelNotLoaded("probes are armed against the served model, and none is loaded yet")
    return model


def check_limit(armed_ids: set[str], probe_id: str, limit: int) -> None:
    others = armed_ids - {probe_id}
    if len(others) >= limit:
        raise GateRefused(
            "limit", f"{len(others)} probes are armed and this server arms at most {limit} (probes_max_armed); disarm one first"
        )


def check_identity(stored: Stored, model: ServedModel) -> None:
    have = identity_of(model)
    differ = identity_mismatches(stored.doc.model, have)
    if differ:
        detail = "; ".join(
            f"{path} is {getattr(stored.doc.model, path[6:])!r} in the document, {getattr(have, path[6:])!r} here" for path in differ
        )
        raise GateRefused(
            "model_identity", f"the probe was fitted on another model than {model.info.served_name!r} ({detail})", param=differ[0]
        )


def check_evidence(stored: Stored, acknowledged: bool) -> None:
    rung = stored.doc.evidence.rung
    if rung < 2 and not acknowledged:
        raise GateRefused(
            "evidence", f"the probe's evidence is rung {rung}, below 2; send acknowledge_below_rung2: true to arm it anyway",
            param="acknowledge_below_rung2",
        )  # fmt: skip


def check_basis(app: AppContext, stored: Stored) -> Any | None:
    """The SAE a ``sae_features`` probe reads (None for a residual probe)."""
    det = stored.detector
    if det.basis != "sae_features":
        return None
    assert det.sae_id is not None
    sae = attached_sae(app, det.sae_id, det.layer)
    if sae is None:
        raise GateRefused("basis", f"SAE {det.sae_id!r} is not attached (and usable) at layer {det.layer}", param="basis.sae_id")
    if sae.d_sae != det.width:
        raise GateRefused("basis", f"SAE {det.sae_id!r} has {sae.d_sae} features; the head has {det.width} weights", param="head.weights")
    refusal = encode_refusal(sae)
    if refusal is not None:
        raise GateRefused("basis", f"SAE {det.sae_id!r} cannot be read faithfully: {refusal}", param="basis.sae_id")
    return sae


async def check_parity(app: AppContext, stored: Stored, model: ServedModel, sae: Any | None, tolerance: float) -> ParityReport:
    vectors = stored.doc.test_vectors
    if not vectors:
        raise GateRefused("parity", "the document has no test vectors to re-score", param="test_vectors")
    engine = model.engine
    if not isinstance(engine, ResidualReader):
        raise GateRefused("parity", f"the {model.info.engine} engine cannot read the residual stream to re-score test vectors")
    for index, vector in enumerate(vectors):
        if max(vector.token_ids) >= model.info.vocab_size:
            raise GateRefused("parity", f"test vector {index} has a token id past the vocabulary ({model.info.vocab_size})",
                              param=f"test_vectors[{index}].token_ids")  # fmt: skip
        if len(vector.token_ids) > model.info.context_length:
            raise GateRefused("parity", f"test vector {index} is longer than the model's context", param=f"test_vectors[{index}].token_ids")
    detector, layer = stored.detector, stored.detector.layer

    def rescore() -> list[float | None]:  # on the model thread, one vector after another; only scores come back
        residuals = list(engine.residuals([v.token_ids for v in vectors], layer))
        scores: list[float | None] = []
        for index in range(len(residuals)):
            residual, residuals[index] = np.asarray(residuals[index]), None
            scores.append(score_tokens(detector, residual, sae))
        return scores

    scores = await app.run_model(rescore)
    checks: list[VectorCheck] = []
    for index, (vector, got) in enumerate(zip(vectors, scores, strict=True)):
        error = abs(got - vector.expected) if got is not None and math.isfinite(got) else None
        ok = error is not None and error <= tolerance
        checks.append(VectorCheck(index=index, tokens=len(vector.token_ids), expected=vector.expected, got=got, abs_error=error, ok=ok))
    errors = [c.abs_error for c in checks if c.abs_error is not None]
    report = ParityReport(tolerance=tolerance, max_abs_error=max(errors) if errors else None, vectors=checks)
    bad = next((c for c in checks if not c.ok), None)
    if bad is not None:
        raise GateRefused(
            "parity", f"test vector {bad.index} scores {bad.got} here against {bad.expected} expected "
            f"(|error| {bad.abs_error}, tolerance {tolerance}); the probe does not read this server as it was fitted",
            param=f"test_vectors[{bad.index}].expected",
        )  # fmt: skip
    return report


async def run_gates(
    app: AppContext, stored: Stored, armed_ids: set[str], windows: list[Window], acknowledged: bool, limit: int, tolerance: float
) -> Arming:
    """Every gate in order; the :class:`Arming` to persist when all pass."""
    check_limit(armed_ids, stored.detector.probe_id, limit)
    model = resident(app)
    check_identity(stored, model)
    check_evidence(stored, acknowledged)
    sae = check_basis(app, stored)
    own = stored.doc.parity_tolerance
    report = await check_parity(app, stored, model, sae, min(own, tolerance) if own is not None else tolerance)
    return Arming(
        windows=list(windows), acknowledged_below_rung2=acknowledged, model=model.info.served_name, parity=report, armed_at=time.time()
    )
