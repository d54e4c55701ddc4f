"""Inline ``steering`` on a request: its shape, its rules, and what it applies.

Rules (the API contract): ``sae_id`` and ``layer`` may be omitted only while what is sent
leaves exactly one attached (SAE, layer); every ``index`` is in ``[0, d_sae)`` and listed once; ``strength`` is a finite
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
    ``sae_id`` and ``layer`` pick the (SAE, layer) attachment it applies at; each may be
    omitted while the rest leaves exactly one; ``features: []`` runs explicitly unsteered."""

    sae_id: str | None = None
    layer: int | None = None
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
    for name in ("sae_id", "layer"):
        if not steering.features and getattr(steering, name) is not None:
            problems.append(Problem(f"features: [] turns steering off on every SAE; {name} cannot be given with it", param=f"steering.{name}"))
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
    """The (SAE, layer) a non-empty set applies at, or the request's 400: the attachments
    that ``sae_id`` and ``layer`` (those sent) leave must be exactly one."""
    attached = list(attachments)
    if not attached:
        raise SAENotAttached("steering needs an attached SAE; none is attached (POST /api/saes/{id}/attach)", param="steering")
    if steering.sae_id is not None and not any(s == steering.sae_id for s, _ in attached):
        raise SAENotAttached(f"SAE {steering.sae_id!r} is not attached", param="steering.sae_id")
    left = [(s, layer) for s, layer in attached if steering.sae_id in (None, s) and steering.layer in (None, layer)]
    if not left:
        raise SAENotAttached(_not_at_layer(steering.sae_id, steering.layer, attached), param="steering.layer")
    if len(left) > 1:
        listed = ", ".join(f"({s}, layer {layer})" for s, layer in left)
        unnamed = [f"steering.{name}" for name in ("sae_id", "layer") if getattr(steering, name) is None]  # both sent: one fits
        raise InvalidRequest(f"several attachments fit: {listed}; name one with {' and '.join(unnamed)}", param=unnamed[0])
    return left[0]


def _not_at_layer(sae_id: str | None, layer: int | None, attached: list[tuple[str, int]]) -> str:
    """Why nothing attached fits ``layer`` (with ``sae_id``, when named), and where the
    attachments are, so the client can pick one."""
    if sae_id is not None:
        layers = sorted(at for s, at in attached if s == sae_id)
        where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers}"
        return f"SAE {sae_id!r} is not attached at layer {layer}; it is attached at {where}"
    listed = ", ".join(f"({s}, layer {at})" for s, at in sorted(attached, key=lambda a: (a[1], a[0])))
    return f"no SAE is attached at layer {layer}; the attachments are {listed}"
