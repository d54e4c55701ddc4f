"""Saved steering profiles and imported clusters, persisted in the server's database (the
``profiles`` table) and held in the steering snapshot (:class:`~.live.Live`), which the
routes and requests read; every write goes through :meth:`~.registry.SteeringState.commit`.

A profile is a named feature set for one SAE at one layer. A cluster is a profile imported
from a cluster-definition document: its members' strengths are the profile's features, and
it carries an intensity dial λ (persisted, set with ``PUT /api/clusters/{id}/intensity``)
and the range its author declared. Applied strengths are ``clamp(stored × λ)``; a plain
profile's λ is 1.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from millm_core.api import InvalidRequest, MillmError, NotFound

from .inline import Feature, InvalidFeatureIndex

# Names the routes use for their own paths under /api/profiles.
RESERVED_NAMES = frozenset({"active", "deactivate", "export", "import"})
DIAL_ENVELOPE = (0.0, 2.0)
EXPORT_FORMAT = "millm.profile/v1"


class ProfileExists(MillmError):
    status = 409
    type = "invalid_request_error"
    code = "profile_exists"


class ProfileNotFound(NotFound):
    code = "profile_not_found"


class WidthMismatch(InvalidRequest):
    """400: a cluster was imported for an SAE of one width, and the SAE attached where it
    steers now has another (an SAE registered anew under that id): it is another SAE, so
    the cluster is not applied to it. The circuits' ``width_mismatch``, for a cluster; a
    400 like the other refusals of what cannot steer there (``sae_not_attached``, an SAE
    of the wrong width at attach)."""

    code = "width_mismatch"


class Dial(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A cluster's intensity dial (the persisted λ and the author's declared range) and
    ``n_features``, the width of the SAE it was imported for: it applies to an SAE of that
    width only (None in clusters stored before the width was kept: not checked)."""

    intensity: float = 1.0
    intensity_range: tuple[float, float] | None = None
    n_features: int | None = None

    def check_width(self, name: str, sae_id: str, layer: int, width: int, param: str = "profile") -> None:
        """Refuse (400 ``width_mismatch``) an SAE whose width is not the one the cluster
        ``name`` was imported for."""
        if self.n_features is not None and width != self.n_features:
            raise WidthMismatch(
                f"cluster {name!r} was imported for an SAE of width {self.n_features}; SAE {sae_id!r} at layer {layer} has width "
                f"{width} (another SAE registered under that id): import the cluster again for it",
                param=param,
            )


class Profile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/profiles``: a named feature set for ``sae_id`` at ``layer``. Imported
    clusters also carry ``cluster`` (their dial); plain profiles have none."""

    name: str
    sae_id: str
    layer: int
    features: list[Feature]
    cluster: Dial | None = None

    @property
    def intensity(self) -> float:
        return self.cluster.intensity if self.cluster else 1.0


class ProfileExport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The export document: profiles (clusters included) as JSON, read back by import."""

    format: str = EXPORT_FORMAT
    profiles: list[Profile]


class ClusterSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The SAE a cluster document needs: attached at ``layer``, of width ``n_features`` (the import binds the one attached
    SAE that matches)."""

    layer: int
    n_features: int


class ClusterMember(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One member of a cluster document: a feature and its strength; ``sign`` (``1``, ``-1``, ``"+"``, ``"-"``,
    ``"positive"`` or ``"negative"``; default positive) multiplies the strength."""

    feature_idx: int
    strength: float
    sign: int | str | None = None


class ClusterBudget(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A cluster document's ``budget``: the initial dial λ and the author's declared ``intensity_range``, which become the
    profile's dial."""

    intensity: float | None = None  # not sent: 1, within the dial's bounds
    intensity_range: tuple[float, float] | None = None


class ClusterDocument(msgspec.Struct, kw_only=True):
    """A cluster-definition document (``POST /api/clusters/import``). Fields it carries
    beyond these are kept out of the profile and listed in the import response."""

    name: str
    sae: ClusterSAE
    members: list[ClusterMember]
    budget: ClusterBudget = msgspec.field(default_factory=ClusterBudget)


def _finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise InvalidRequest("must be a finite number", param=param)


def check_name(name: str) -> None:
    if not 1 <= len(name) <= 128 or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or "/" in name:
        raise InvalidRequest("a profile name is 1–128 characters, without control characters or '/'", param="name")
    if name in RESERVED_NAMES:
        raise InvalidRequest(f"{name!r} is reserved by the profile routes; choose another name", param="name")


# No model has more layers; a larger number could not even be stored (msgpack holds 64 bits).
MAX_LAYER = 2**31 - 1


def check_layer(layer: int, param: str = "layer") -> None:
    """A layer number in ``[0, MAX_LAYER]``."""
    if not 0 <= layer <= MAX_LAYER:
        raise InvalidRequest(f"layer must be in [0, {MAX_LAYER}]", param=param)


def check_features(features: list[Feature], d_sae: int, prefix: str = "features", index_key: str = "index") -> None:
    """Indexes in ``[0, d_sae)`` and listed once; strengths finite. ``index_key`` is the
    index's name in the document the features came from (a cluster's ``feature_idx``)."""
    seen: set[int] = set()
    for position, feature in enumerate(features):
        if not 0 <= feature.index < d_sae:
            raise InvalidFeatureIndex(f"feature index {feature.index} is outside [0, {d_sae})", param=f"{prefix}[{position}].{index_key}")
        if feature.index in seen:
            raise InvalidRequest(f"feature index {feature.index} is listed twice", param=f"{prefix}[{position}].{index_key}")
        seen.add(feature.index)
        _finite(feature.strength, f"{prefix}[{position}].strength")


def check_dial(dial: Dial, param: str = "budget") -> None:
    """A dial's values: finite, a declared range [low, high] with 0 ≤ low ≤ high that
    overlaps the dial's [0, 2] envelope (one beyond it would leave no λ to dial: its
    "min" would exceed its "max"), an intensity in the envelope, a width of at least 1."""
    _finite(dial.intensity, f"{param}.intensity")
    low, high = DIAL_ENVELOPE
    if dial.intensity_range is not None:
        lo, hi = dial.intensity_range
        _finite(lo, f"{param}.intensity_range")
        _finite(hi, f"{param}.intensity_range")
        if not 0.0 <= lo <= hi:
            raise InvalidRequest(
                f"intensity_range must be [low, high] with 0 ≤ low ≤ high; got [{lo}, {hi}]", param=f"{param}.intensity_range"
            )
        if lo > high:
            raise InvalidRequest(
                f"intensity_range [{lo}, {hi}] does not overlap the dial's bounds [{low}, {high}]: no λ could be dialled",
                param=f"{param}.intensity_range",
            )
    if dial.n_features is not None and dial.n_features < 1:
        raise InvalidRequest("n_features must be at least 1", param=f"{param}.n_features")
    if not low <= dial.intensity <= high:
        raise InvalidRequest(f"intensity must be in [{low}, {high}]", param=f"{param}.intensity")


def _sign(member: ClusterMember, position: int) -> float:
    signs: dict[Any, float] = {None: 1.0, 1: 1.0, -1: -1.0, "+": 1.0, "-": -1.0, "positive": 1.0, "negative": -1.0}
    if isinstance(member.sign, bool) or member.sign not in signs:
        raise InvalidRequest("sign is 1, -1, '+', '-', 'positive' or 'negative'", param=f"members[{position}].sign")
    return signs[member.sign]


def cluster_profile(doc: ClusterDocument, sae_id: str) -> Profile:
    """The profile a cluster document becomes: member strength × sign per feature (a
    ``sign`` with a negative strength flips it, as written)."""
    features = [Feature(index=m.feature_idx, strength=m.strength * _sign(m, i)) for i, m in enumerate(doc.members)]
    check_features(features, doc.sae.n_features, prefix="members", index_key="feature_idx")
    dial = Dial(
        intensity=1.0 if doc.budget.intensity is None else doc.budget.intensity,
        intensity_range=doc.budget.intensity_range,
        n_features=doc.sae.n_features,
    )
    check_dial(dial)
    return Profile(name=doc.name, sae_id=sae_id, layer=doc.sae.layer, features=features, cluster=dial)


def decode(body: object) -> Profile:
    """A profile from its stored msgpack body."""
    assert isinstance(body, bytes)
    return msgspec.msgpack.decode(body, type=Profile)


def write(conn: sqlite3.Connection, profile: Profile) -> None:
    """Insert or overwrite ``profile`` inside the caller's transaction."""
    conn.execute(
        "INSERT INTO profiles (name, body, created) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET body = excluded.body",
        (profile.name, msgspec.msgpack.encode(profile), time.time()),
    )


def remove(conn: sqlite3.Connection, name: str) -> None:
    conn.execute("DELETE FROM profiles WHERE name = ?", (name,))


def named(profiles: Mapping[str, Profile], name: str, *, param: str = "profile") -> Profile:
    """The saved profile ``name`` (404 ``profile_not_found``)."""
    profile = profiles.get(name)
    if profile is None:
        raise ProfileNotFound(f"no profile named {name!r}", param=param)
    return profile


def cluster_named(profiles: Mapping[str, Profile], name: str) -> Profile:
    """The imported cluster ``name`` (404 ``cluster_not_found``, a plain profile too)."""
    profile = profiles.get(name)
    if profile is None or profile.cluster is None:
        raise NotFound(f"no cluster named {name!r}", code="cluster_not_found", param="id")
    return profile


def added(profiles: Mapping[str, Profile], new: list[Profile], *, replace: bool, param: str = "profiles") -> dict[str, Profile]:
    """``profiles`` with ``new`` added. Without ``replace`` a name in use refuses them all
    (409 ``profile_exists``, naming ``param``: ``name`` for one profile, ``profiles`` for an
    import)."""
    existing = [] if replace else [p.name for p in new if p.name in profiles]
    if existing and param == "name":
        raise ProfileExists(f"a profile named {existing[0]!r} exists (delete it first, or import with replace)", param=param)
    if existing:
        raise ProfileExists(f"profiles {existing} exist; import with ?replace=true to overwrite", param=param)
    return {**profiles, **{p.name: p for p in new}}


def with_intensity(profile: Profile, intensity: float) -> Profile:
    """The cluster with its persistent dial set to ``intensity``."""
    if profile.cluster is None:
        raise NotFound(f"{profile.name!r} is a profile, not a cluster", code="cluster_not_found", param="id")
    return msgspec.structs.replace(profile, cluster=msgspec.structs.replace(profile.cluster, intensity=intensity))
