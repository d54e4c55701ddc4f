"""The circuit-definition document, and the circuit it compiles into.

A document names the SAEs the circuit spans (one per layer), its members per layer (a
feature and its authored strength, or a reference to an imported cluster at that layer,
expanded into the cluster's authored strengths on import), its edges (an upstream and a
downstream member and the rung of evidence for that edge), its budget (the initial dial λ
and the declared ``intensity_range``) and, optionally, the backing cluster that steers it in
``slice_fallback``. Compiling checks everything against the registered SAEs' widths, the
imported clusters and the configured size limits, before anything is stored.

The compiled :class:`Circuit` keeps the authored strengths: the dial is always applied to
them (absolute, never compounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from millm_core.api import InvalidRequest, NotFound
from millm_plugins.steering.public import Dial, InvalidFeatureIndex, Profile, check_dial, check_layer

from .ladder import LADDER
from .settings import MAX_EDGES, MAX_LAYERS, MAX_MEMBERS, Limits

Feature = tuple[int, int]  # (layer, feature index)


class CircuitTooLarge(InvalidRequest):
    """400: the document is over one of the configured size limits (the message names the
    setting)."""

    code = "circuit_limit_exceeded"


# ------------------------------------------------------------------ the document (wire)


class CircuitSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The SAE a circuit steers through at ``layer`` (registered; attached to steer)."""

    sae_id: str
    layer: int


class CircuitMemberSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One member: ``feature_idx`` and ``strength``, or ``cluster``, the name of an imported
    cluster at this layer (expanded on import)."""

    layer: int
    feature_idx: int | None = None
    strength: float | None = None
    cluster: str | None = None


class CircuitEdgeEnd(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One end of a document's edge: a member of the circuit, named by its ``layer`` and ``feature_idx``."""

    layer: int
    feature_idx: int


class CircuitEdgeSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An edge from an upstream member to a downstream one, with its rung (0–3)."""

    up: CircuitEdgeEnd
    down: CircuitEdgeEnd
    rung: int


class CircuitBudget(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The initial dial λ and the author's declared range (both ends clamp)."""

    intensity: float = 1.0
    intensity_range: tuple[float, float] | None = None


class CircuitDocument(msgspec.Struct, kw_only=True):
    """A circuit-definition document (``POST /api/circuits/import``). Top-level fields
    beyond these are kept in the stored document (export gives them back) and listed in
    the import response's ``ignored_fields``."""

    name: str
    saes: list[CircuitSAE]
    members: list[CircuitMemberSpec]
    edges: list[CircuitEdgeSpec] = msgspec.field(default_factory=list)
    budget: CircuitBudget = msgspec.field(default_factory=CircuitBudget)
    backing_cluster: str | None = None


KNOWN_FIELDS = frozenset(f.name for f in msgspec.structs.fields(CircuitDocument))


# ------------------------------------------------------------------ the compiled circuit


class Slice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The circuit at one layer: its SAE, the authored ``(index, strength)`` pairs, and the
    SAE's width when the circuit was imported (None in circuits stored before it was kept)."""

    layer: int
    sae_id: str
    features: tuple[tuple[int, float], ...]
    d_sae: int | None = None


class Edge(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A compiled edge: its upstream and downstream members as ``(layer, feature index)``, and its rung."""

    up: tuple[int, int]
    down: tuple[int, int]
    rung: int


class Circuit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A compiled circuit, as stored: slices by layer, edges, the rung (the minimum over
    edges, 0 without any), the declared range and the backing cluster."""

    name: str
    slices: tuple[Slice, ...]
    edges: tuple[Edge, ...]
    rung: int
    intensity_range: tuple[float, float] | None = None
    backing_cluster: str | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(s.layer for s in self.slices)

    def features(self) -> set[Feature]:
        return {(s.layer, index) for s in self.slices for index, _ in s.features}


def check_name(name: str) -> None:
    if not 1 <= len(name) <= 128 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidRequest("a circuit name is 1–128 characters, without control characters", param="name")


def _limit(count: int, limit: int, setting: str, what: str, param: str) -> None:
    if count > limit:
        raise CircuitTooLarge(f"the circuit has {count} {what}; {setting} allows at most {limit}", param=param)


def _finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise InvalidRequest("must be a finite number", param=param)


Widths = Callable[[str, str], int]  # (sae_id, param) -> d_sae; raises NotFound naming param


def compile_document(doc: CircuitDocument, widths: Widths, clusters: Mapping[str, Profile], limits: Limits) -> tuple[Circuit, float]:
    """The circuit a document describes and its initial dial, or the 4xx naming what is
    wrong (its JSON path in ``param``). ``widths`` reads a registered SAE's width;
    ``clusters`` are the imported clusters by name (steering profiles with a dial)."""
    check_name(doc.name)
    _limit(len(doc.saes), limits.layers, MAX_LAYERS.name, "layers", "saes")
    _limit(len(doc.edges), limits.edges, MAX_EDGES.name, "edges", "edges")
    if not doc.saes:
        raise InvalidRequest("a circuit spans at least one SAE", param="saes")
    sae_at: dict[int, str] = {}
    width_at: dict[int, int] = {}
    for position, ref in enumerate(doc.saes):
        check_layer(ref.layer, f"saes[{position}].layer")
        if ref.layer in sae_at:
            raise InvalidRequest(f"layer {ref.layer} is listed twice: a circuit has one SAE per layer", param=f"saes[{position}].layer")
        width_at[ref.layer] = widths(ref.sae_id, f"saes[{position}].sae_id")
        sae_at[ref.layer] = ref.sae_id
    features = _members(doc, sae_at, width_at, clusters)
    for layer, found in features.items():
        _limit(len(found), limits.members_per_layer, MAX_MEMBERS.name, f"members at layer {layer}", "members")
    edges = _edges(doc, {(layer, index) for layer, found in features.items() for index in found})
    check_dial(Dial(intensity=doc.budget.intensity, intensity_range=doc.budget.intensity_range), param="budget")
    declared = doc.budget.intensity_range
    if declared is not None and doc.budget.intensity != 0.0 and not declared[0] <= doc.budget.intensity <= declared[1]:
        raise InvalidRequest(
            f"intensity {doc.budget.intensity} is outside the declared intensity_range [{declared[0]}, {declared[1]}] (only 0 may be)",
            param="budget.intensity",
        )
    if doc.backing_cluster is not None:
        backing = _cluster(clusters, doc.backing_cluster, "backing_cluster")
        if sae_at.get(backing.layer) != backing.sae_id:
            raise InvalidRequest(
                f"the backing cluster {backing.name!r} steers SAE {backing.sae_id!r} at layer {backing.layer}, which is not one of the circuit's SAEs",
                param="backing_cluster",
            )
        if backing.cluster is not None:
            backing.cluster.check_width(backing.name, backing.sae_id, backing.layer, width_at[backing.layer], param="backing_cluster")
    slices = tuple(
        Slice(layer=layer, sae_id=sae_at[layer], features=tuple(sorted(features.get(layer, {}).items())), d_sae=width_at[layer])
        for layer in sorted(sae_at)
    )
    rung = min((e.rung for e in edges), default=0)
    circuit = Circuit(name=doc.name, slices=slices, edges=edges, rung=rung, intensity_range=declared, backing_cluster=doc.backing_cluster)
    return circuit, float(doc.budget.intensity)


def _cluster(clusters: Mapping[str, Profile], name: str, param: str) -> Profile:
    found = clusters.get(name)
    if found is None or found.cluster is None:
        raise NotFound(f"no cluster named {name!r} (import it with POST /api/clusters/import first)", code="cluster_not_found", param=param)
    return found


def _members(
    doc: CircuitDocument, sae_at: Mapping[int, str], width_at: Mapping[int, int], clusters: Mapping[str, Profile]
) -> dict[int, dict[int, float]]:
    """layer → {index: authored strength}, clusters expanded; each (layer, index) once."""
    if not doc.members:
        raise InvalidRequest("a circuit has at least one member", param="members")
    found: dict[int, dict[int, float]] = {}
    for position, member in enumerate(doc.members):
        where = f"members[{position}]"
        if member.layer not in sae_at:
            raise InvalidRequest(f"layer {member.layer} is not one of the circuit's layers {sorted(sae_at)}", param=f"{where}.layer")
        at = found.setdefault(member.layer, {})
        if member.cluster is not None:
            if member.feature_idx is not None or member.strength is not None:
                raise InvalidRequest("a member is either a feature_idx with a strength, or a cluster", param=where)
            cluster = _cluster(clusters, member.cluster, f"{where}.cluster")
            if (cluster.sae_id, cluster.layer) != (sae_at[member.layer], member.layer):
                raise InvalidRequest(
                    f"cluster {cluster.name!r} steers SAE {cluster.sae_id!r} at layer {cluster.layer}; this member is at layer "
                    f"{member.layer}, whose SAE is {sae_at[member.layer]!r}",
                    param=f"{where}.cluster",
                )
            if cluster.cluster is not None:  # imported for another SAE under that id: refused as when it steers
                cluster.cluster.check_width(cluster.name, cluster.sae_id, cluster.layer, width_at[member.layer], param=f"{where}.cluster")
            pairs = [(f.index, f.strength) for f in cluster.features]
            index_param = f"{where}.cluster"
        else:
            if member.feature_idx is None or member.strength is None:
                raise InvalidRequest("a member needs feature_idx and strength (or a cluster)", param=where)
            _finite(member.strength, f"{where}.strength")
            pairs = [(member.feature_idx, member.strength)]
            index_param = f"{where}.feature_idx"
        for index, strength in pairs:
            if not 0 <= index < width_at[member.layer]:
                raise InvalidFeatureIndex(
                    f"feature index {index} is outside [0, {width_at[member.layer]}) for SAE {sae_at[member.layer]!r}", param=index_param
                )
            if index in at:
                raise InvalidRequest(f"feature {index} at layer {member.layer} is listed twice", param=index_param)
            at[index] = float(strength)
    return found


def _edges(doc: CircuitDocument, members: set[Feature]) -> tuple[Edge, ...]:
    """The compiled edges: each between two members, up at an earlier layer than down, with
    a rung on the ladder, and each (up, down) pair once (twice, even with the same rung,
    would leave the evidence for that edge ambiguous)."""
    edges: list[Edge] = []
    seen: set[tuple[Feature, Feature]] = set()
    for position, edge in enumerate(doc.edges):
        where = f"edges[{position}]"
        pair = ((edge.up.layer, edge.up.feature_idx), (edge.down.layer, edge.down.feature_idx))
        if pair in seen:
            raise InvalidRequest(
                f"the edge from feature {pair[0][1]} at layer {pair[0][0]} to feature {pair[1][1]} at layer {pair[1][0]} is listed twice",
                param=where,
            )
        seen.add(pair)
        for end, name in ((edge.up, "up"), (edge.down, "down")):
            if (end.layer, end.feature_idx) not in members:
                raise InvalidRequest(
                    f"feature {end.feature_idx} at layer {end.layer} is not a member of the circuit", param=f"{where}.{name}"
                )
        if not edge.up.layer < edge.down.layer:
            raise InvalidRequest("an edge goes from an earlier layer (up) to a later one (down)", param=where)
        if edge.rung not in LADDER:
            raise InvalidRequest(f"rung is one of {sorted(LADDER)}", param=f"{where}.rung")
        edges.append(Edge(up=(edge.up.layer, edge.up.feature_idx), down=(edge.down.layer, edge.down.feature_idx), rung=edge.rung))
    return tuple(edges)


def ignored_fields(raw: Mapping[str, Any]) -> list[str]:
    """The document's top-level fields the circuit does not use (kept for export)."""
    return sorted(k for k in raw if k not in KNOWN_FIELDS)
