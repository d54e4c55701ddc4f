"""Inline ``steering`` on a request: its shape, its rules, and what it applies.

Rules (the API contract): ``sae_id`` may be omitted only when exactly one (SAE, layer)
is attached; every ``index`` is in ``[0, d_sae)`` and listed once; ``strength`` is a finite
number (booleans refused) and is clamped to ±200 when applied, with the clamp counted;
``features: []`` means explicitly unsteered (and then ``sae_id`` is refused); ``steering``
never comes with ``profile`` or ``steering_intensity``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from millm_core.api import AppliedSet, InvalidRequest, Problem

from .sae import SAE


class Feature(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One SAE feature and the strength its decoder direction is added with."""

    index: int
    strength: float


class InlineSteering(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The request's ``steering``: its own feature set, for this request only.
    ``sae_id`` may be omitted when exactly one (SAE, layer) is attached; ``features: []``
    runs explicitly unsteered."""

    sae_id: str | None = None
    features: list[Feature]


class SAENotAttached(InvalidRequest):
    code = "sae_not_attached"


class InvalidFeatureIndex(InvalidRequest):
    code = "invalid_feature_index"


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def check(steering: InlineSteering) -> list[Problem]:
    """The problems with a decoded steering object (each naming its path)."""
    problems: list[Problem] = []
    seen: set[int] = set()
    for position, feature in enumerate(steering.features):
        if not math.isfinite(feature.strength):
            problems.append(Problem("strength must be a finite number", param=f"steering.features[{position}].strength"))
        if feature.index in seen:
            problems.append(Problem(f"feature index {feature.index} is listed twice", param=f"steering.features[{position}].index"))
        seen.add(feature.index)
    if not steering.features and steering.sae_id is not None:
        problems.append(Problem("features: [] turns steering off on every SAE; sae_id cannot be given with it", param="steering.sae_id"))
    return problems


def conflicts(request: Any) -> list[Problem]:
    others = [name for name in ("profile", "steering_intensity") if _sent(getattr(request, name, None))]
    if others:
        return [Problem(f"steering cannot be combined with {' or '.join(others)}: send one of steering, {', '.join(others)}", param="steering")]
    return []


@dataclass(frozen=True)
class Resolved:
    """What the request applies: the SAE, its layer and the applied set (or nothing)."""

    sae_id: str
    layer: int
    applied: AppliedSet


def resolve(steering: InlineSteering, attachments: Iterable[tuple[str, int]], saes: dict[str, SAE]) -> Resolved | None:
    """Pick the (SAE, layer) the request names, check its indexes, and build the applied
    set. ``None`` for ``features: []`` (explicitly unsteered). ``saes`` holds at least the
    SAE the request names."""
    if not steering.features:
        return None
    sae_id, layer = target(steering, attachments)
    width = saes[sae_id].d_sae
    for position, feature in enumerate(steering.features):
        if not 0 <= feature.index < width:
            raise InvalidFeatureIndex(f"feature index {feature.index} is outside [0, {width}) for SAE {sae_id!r}", param=f"steering.features[{position}].index")
    return Resolved(sae_id=sae_id, layer=layer, applied=AppliedSet.build(sae_id, [(f.index, f.strength) for f in steering.features]))


def target(steering: InlineSteering, attachments: Iterable[tuple[str, int]]) -> tuple[str, int]:
    """The (SAE, layer) a non-empty set applies at, or the request's 400."""
    attached = list(attachments)
    if not attached:
        raise SAENotAttached("steering needs an attached SAE; none is attached (POST /api/saes/{id}/attach)", param="steering")
    if steering.sae_id is None:
        if len(attached) > 1:
            listed = ", ".join(f"({s}, layer {layer})" for s, layer in attached)
            raise InvalidRequest(f"several SAEs are attached: {listed}; name one with steering.sae_id", param="steering.sae_id")
        sae_id, layer = attached[0]
    else:
        layers = [layer for s, layer in attached if s == steering.sae_id]
        if not layers:
            raise SAENotAttached(f"SAE {steering.sae_id!r} is not attached", param="steering.sae_id")
        if len(layers) > 1:
            listed = ", ".join(f"({steering.sae_id}, layer {layer})" for layer in layers)
            raise InvalidRequest(f"SAE {steering.sae_id!r} is attached at several layers: {listed}", param="steering.sae_id")
        sae_id, layer = steering.sae_id, layers[0]
    return sae_id, layer
