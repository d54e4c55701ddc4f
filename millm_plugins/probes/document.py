"""The probe document (``mi.probe/v1``): what a probe reads, how it scores, how it decides,
the model it was fitted on, its evidence and its test vectors. Checked when it is
imported (400 naming the path of a bad value); its digests name the detector and the
decision in every result."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from millm_core.api import InvalidRequest

SCHEMA = "mi.probe/v1"
Window = Literal["all", "prompt", "response", "last_user"]
WINDOWS: tuple[Window, ...] = ("all", "prompt", "response", "last_user")
ReadPoint = Literal["pre_steering", "post_steering"]
Aggregation = Literal["mean", "max", "last"]
Link = Literal["logistic", "identity"]

MAX_TEST_VECTORS = 64
MAX_TEST_TOKENS = 65_536  # over all test vectors
# Route names under /api/probes that a probe id may not take.
RESERVED_IDS = frozenset({"import", "events", "score", "identity"})
_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Name = Annotated[str, Meta(min_length=1, max_length=128)]
NonNegative = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]


class Basis(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the head reads at each position: the residual vector itself, or the
    activations of an SAE (``sae_id``) attached at the probe's layer."""

    kind: Literal["residual", "sae_features"] = "residual"
    sae_id: str | None = None


class Normalization(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``(x - mean) / std`` before the weights, per basis dimension."""

    mean: list[float]
    std: list[float]


class Head(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The linear head: a per-position logit ``weights · normalise(x) + bias``; the
    aggregated logit goes through ``link`` (``logistic``: a probability)."""

    weights: Annotated[list[float], Meta(min_length=1)]
    bias: float = 0.0
    normalization: Normalization | None = None
    link: Link = "logistic"


class Decision(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A score at or above the threshold is ``flagged``; ``windows`` overrides it per window."""

    threshold: float
    windows: dict[Window, float] = msgspec.field(default_factory=dict)


class ModelIdentity(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The model a probe was fitted on: residual width, block count, and the SHA-256 (hex)
    of its chat template's source (null: a model without one)."""

    d_model: Positive
    n_layers: Positive
    chat_template_sha256: str | None


class Evidence(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How far the probe was validated, on the same 0–3 ladder as circuits: arming below
    rung 2 needs an explicit acknowledgement."""

    rung: Annotated[int, Meta(ge=0, le=3)]
    summary: str = ""


class TestVector(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Token ids and the score the probe gave them where it was fitted (window ``all``)."""

    __test__ = False  # not a pytest class

    token_ids: Annotated[list[NonNegative], Meta(min_length=1)]
    expected: float


class ProbeDocument(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A probe, as imported and exported (``mi.probe/v1``)."""

    schema: Literal["mi.probe/v1"] = "mi.probe/v1"
    id: str | None = None
    name: Name
    description: str = ""
    layer: NonNegative
    read_point: ReadPoint = "pre_steering"
    basis: Basis = msgspec.field(default_factory=Basis)
    head: Head
    aggregation: Aggregation = "mean"
    decision: Decision
    model: ModelIdentity
    evidence: Evidence
    test_vectors: Annotated[list[TestVector], Meta(max_length=MAX_TEST_VECTORS)] = msgspec.field(default_factory=list)
    # The parity gate's tolerance for this probe; the server's setting caps it.
    parity_tolerance: float | None = None


def canonical(value: Any) -> bytes:
    """Canonical JSON (sorted keys, msgspec's shortest float form) for digests."""
    return msgspec.json.encode(msgspec.to_builtins(value), order="sorted")


def _digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()


def detector_digest(doc: ProbeDocument) -> str:
    """What the probe computes: layer, read point, basis, head, aggregation and the model."""
    return _digest({"schema": doc.schema, "layer": doc.layer, "read_point": doc.read_point, "basis": doc.basis,
                    "head": doc.head, "aggregation": doc.aggregation, "model": doc.model})  # fmt: skip


def decision_digest(doc: ProbeDocument) -> str:
    """How it decides: the thresholds."""
    return _digest(doc.decision)


def _finite(values: Iterable[float], param: str) -> None:
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise InvalidRequest(f"{param}[{index}] must be a finite number", param=f"{param}[{index}]")


def _finite_one(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise InvalidRequest(f"{param} must be a finite number", param=param)


def check(doc: ProbeDocument) -> ProbeDocument:
    """Refuse (400) what the types cannot say; returns the document with its id set (a
    readable one derived from the name and the detector digest when none was given)."""
    if doc.id is not None and (not _ID.match(doc.id) or doc.id in RESERVED_IDS):
        raise InvalidRequest(f"id must be 1–128 characters of A-Z a-z 0-9 . _ - and not one of {sorted(RESERVED_IDS)}", param="id")
    if doc.layer >= doc.model.n_layers:
        raise InvalidRequest(f"layer {doc.layer} is past the model's {doc.model.n_layers} layers", param="layer")
    sha = doc.model.chat_template_sha256
    if sha is not None and not _SHA256.match(sha):
        raise InvalidRequest("chat_template_sha256 must be 64 lowercase hex digits, or null", param="model.chat_template_sha256")
    if doc.basis.kind == "sae_features" and not doc.basis.sae_id:
        raise InvalidRequest("a sae_features basis names its SAE (sae_id)", param="basis.sae_id")
    if doc.basis.kind == "residual" and doc.basis.sae_id is not None:
        raise InvalidRequest("a residual basis takes no sae_id", param="basis.sae_id")
    width = len(doc.head.weights)
    if doc.basis.kind == "residual" and width != doc.model.d_model:
        raise InvalidRequest(f"head.weights has {width} entries; a residual basis has d_model = {doc.model.d_model}", param="head.weights")
    _finite(doc.head.weights, "head.weights")
    _finite_one(doc.head.bias, "head.bias")
    norm = doc.head.normalization
    if norm is not None:
        for name, values in (("mean", norm.mean), ("std", norm.std)):
            if len(values) != width:
                raise InvalidRequest(
                    f"normalization.{name} has {len(values)} entries; the weights have {width}", param=f"head.normalization.{name}"
                )
            _finite(values, f"head.normalization.{name}")
        for index, value in enumerate(norm.std):
            if value <= 0:
                raise InvalidRequest("normalization.std entries must be positive", param=f"head.normalization.std[{index}]")
    _finite_one(doc.decision.threshold, "decision.threshold")
    for window, value in doc.decision.windows.items():
        _finite_one(value, f"decision.windows.{window}")
    if sum(len(v.token_ids) for v in doc.test_vectors) > MAX_TEST_TOKENS:
        raise InvalidRequest(f"the test vectors hold more than {MAX_TEST_TOKENS} tokens in all", param="test_vectors")
    for index, vector in enumerate(doc.test_vectors):
        _finite_one(vector.expected, f"test_vectors[{index}].expected")
    if doc.parity_tolerance is not None and not 0 < doc.parity_tolerance < math.inf:
        raise InvalidRequest("parity_tolerance must be a positive number", param="parity_tolerance")
    if doc.id is None:
        slug = re.sub(r"[^A-Za-z0-9._\-]+", "-", doc.name).strip("-")[:100] or "probe"
        doc = msgspec.structs.replace(doc, id=f"{slug}-{detector_digest(doc)[7:15]}")
    return doc
