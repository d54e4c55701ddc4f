"""How the active circuits steer one request: the serving mode, λ, what each layer applies,
and the contribution handed to the steering plugin (:mod:`millm_plugins.steering.contrib`).

Per active circuit, from one snapshot of the steering state (``live``) and of the circuits:

- ``full`` when every SAE the circuit spans is attached (and usable) at its layer: each
  layer applies clamp(authored strength × λ, ±200) through its own SAE. λ is the request's
  ``steering_intensity``, else the circuit's persistent dial, resolved by the circuit rule
  (clamped at both ends into the declared range ∩ the configured envelope; only an exact 0
  or ``"off"`` below the floor). The strengths are re-derived from the authored ones every
  time: the dial never compounds.
- ``slice_fallback`` otherwise: the circuit is steered by its backing cluster, applied as
  that cluster would be when active (the cluster rule: its own dial, or the request's
  resolved with the 0.5 floor and no clamp up), and reported as a ``profile`` member. With
  no backing cluster, or none attached, it does not steer.

A circuit genuinely steers a request only in ``full`` mode with a non-empty applied set: it
is then a ``circuit`` member of ``X-miLLM-Steering`` (``clamped`` counting its features the
±200 clamp changed, over all its layers; ``composed`` when one of its layers carries another
circuit) and the response carries ``X-miLLM-Circuit-Rung`` (the lowest rung
of the circuits steering it). An active circuit whose stored definition cannot be parsed
makes the request report ``unknown;reason=claims_unreadable`` and run unsteered, as the
steering plugin does for its own unreadable state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from millm_core.api import AppliedSet, MillmError
from millm_plugins.steering.contrib import CircuitMember, Contribution
from millm_plugins.steering.public import CLAIMS_UNREADABLE, Dials, Entry, Intensity, Live, is_off, profile_entry, resolve_clamped

from .book import Book, Row
from .document import Circuit
from .ladder import HEADER, header_value
from .settings import Envelope

FULL = "full"
SLICE_FALLBACK = "slice_fallback"


@dataclass(frozen=True)
class Serving:
    """How one active circuit serves a request.

    ``steers``: it applies as a circuit (the rung header applies); ``applied_as`` is
    ``"circuit"``, ``"profile"`` (the backing cluster, in ``slice_fallback``) or None;
    ``servable``: it would steer at a non-zero λ (so it takes the request's dial);
    ``reason``: why it does not steer as a circuit (None when it does)."""

    id: str
    name: str
    rung: int | None
    mode: str | None
    steers: bool = False
    applied_as: str | None = None
    intensity: float | None = None
    composed: bool = False
    reason: str | None = None
    servable: bool = False
    slices: tuple[tuple[int, AppliedSet], ...] = ()
    entry: Entry | None = None

    @property
    def served_layers(self) -> tuple[int, ...]:
        if self.entry is not None:
            return (self.entry.layer,)
        return tuple(layer for layer, applied in self.slices if applied.features)


def _usable(live: Live, sae_id: str, layer: int) -> bool:
    return (sae_id, layer) in live.attachments and (sae_id, layer) not in live.unusable and sae_id in live.saes


def circuit_lambda(circuit: Circuit, stored: float, dial: Intensity | None, envelope: Envelope) -> float:
    """λ for a full serve: the request's dial, else the persistent one, by the circuit rule."""
    value: Intensity = dial if dial is not None else (stored if stored != 0.0 else "off")
    return resolve_clamped(value, circuit.intensity_range, envelope.floor, envelope.ceiling)


def _full(row: Row, circuit: Circuit, live: Live, dial: Intensity | None, envelope: Envelope) -> Serving:
    lam = circuit_lambda(circuit, row.intensity, dial, envelope)
    base = Serving(id=row.id, name=row.name, rung=circuit.rung, mode=FULL, intensity=lam)
    for piece in circuit.slices:
        width = live.saes[piece.sae_id].d_sae
        if (piece.d_sae is not None and width != piece.d_sae) or any(index >= width for index, _ in piece.features):
            return replace(base, reason="width_mismatch")  # the SAE registered under that id changed since import
    authored = any(strength != 0.0 for piece in circuit.slices for _, strength in piece.features)
    slices = tuple((piece.layer, AppliedSet.build(piece.sae_id, [(i, s * lam) for i, s in piece.features])) for piece in circuit.slices)
    if not any(applied.features for _, applied in slices):
        return replace(base, reason="dialled_off" if lam == 0.0 else "empty", servable=authored)
    return replace(base, steers=True, applied_as="circuit", servable=True, slices=slices)


def _fallback(row: Row, circuit: Circuit, live: Live, dial: Intensity | None, dials: Dials, attached_any: bool) -> Serving:
    base = Serving(
        id=row.id, name=row.name, rung=circuit.rung, mode=SLICE_FALLBACK, reason="no_sae_attached" if not attached_any else SLICE_FALLBACK
    )
    if not attached_any:
        return base
    name = circuit.backing_cluster
    if name is None:
        return replace(base, reason="no_backing_cluster")
    cluster = live.profiles.get(name)
    if cluster is None or cluster.cluster is None or not _usable(live, cluster.sae_id, cluster.layer):
        return replace(base, reason="backing_cluster_unavailable")
    if live.active is not None and live.active[0] == name:
        # Already steering as steering's active profile (which then also takes the dial).
        return replace(base, applied_as="profile", intensity=cluster.intensity)
    try:
        entry = profile_entry(cluster, "active", dial if dial is not None and not is_off(dial) else None, live, dials)
    except MillmError:
        return replace(base, reason="backing_cluster_unavailable")
    servable = any(f.strength != 0.0 for f in cluster.features)
    if not entry.applied.features:
        return replace(base, intensity=entry.intensity, servable=servable)
    return replace(base, applied_as="profile", intensity=entry.intensity, servable=True, entry=entry)


def decide(book: Book, live: Live, dial: Intensity | None, envelope: Envelope, dials: Dials) -> list[Serving]:
    """How each active circuit (by id) serves a request with ``dial`` (None: no dial)."""
    servings: list[Serving] = []
    for row in book.active():
        circuit = row.circuit
        if circuit is None:
            servings.append(Serving(id=row.id, name=row.name, rung=None, mode=None, reason="definition_unreadable"))
            continue
        attached = [_usable(live, piece.sae_id, piece.layer) for piece in circuit.slices]
        if all(attached):
            servings.append(_full(row, circuit, live, dial, envelope))
        else:
            servings.append(_fallback(row, circuit, live, dial, dials, any(attached)))
    steering = [s for s in servings if s.steers]
    return [replace(s, composed=_composed(s, steering)) if s.steers else s for s in servings]


def _composed(serving: Serving, steering: list[Serving]) -> bool:
    mine = set(serving.served_layers)
    return any(other.id != serving.id and mine & set(other.served_layers) for other in steering)


def contribution(servings: list[Serving], live: Live, dial: Intensity | None, moved: Callable[[], bool]) -> Contribution | None:
    """What the active circuits add to a request (None: no active circuit)."""
    if not servings:
        return None
    if any(s.reason == "definition_unreadable" for s in servings):
        return Contribution(unknown=CLAIMS_UNREADABLE, moved=moved)
    steering = [s for s in servings if s.steers]
    deltas: dict[int, Any] = {}
    for serving in steering:
        for layer, applied in serving.slices:
            if applied.features:
                direction = live.saes[applied.sae_id].direction(applied.features)
                deltas[layer] = direction if layer not in deltas else deltas[layer] + direction
    servable = [s for s in servings if s.servable]
    echo = servable[0].intensity if servable and dial is not None else None
    rungs = [s.rung for s in steering if s.rung is not None]
    return Contribution(
        circuits=tuple(
            CircuitMember(
                id=s.id, intensity=float(s.intensity or 0.0), composed=s.composed, clamped=sum(applied.clamped for _, applied in s.slices)
            )
            for s in steering
        ),
        deltas={layer: np.asarray(vector, dtype=np.float32) for layer, vector in deltas.items()},
        entries=tuple(s.entry for s in servings if s.entry is not None),
        base=bool(servable),
        echo=echo,
        headers={HEADER: header_value(min(rungs))} if rungs else {},
        moved=moved,
    )
