"""What one request is steered with, and the ``X-miLLM-Steering`` value that reports it.

A request's steering is decided once, before its rows are built, and carried by those rows
alone (the global state is never written for a request):

- inline ``steering``: exactly that set on the named SAE; ``features: []`` is unsteered;
- ``profile``: that profile replaces the global state for the request (``source=request``);
- otherwise the global state: the active profile (``source=active``) and the manual values;
- ``steering_intensity`` scales the base (the request's profile, else the active profile,
  else the manual values); 0 / ``"off"`` turns everything off without validating the base.

Report members are ordered by layer, then SAE; ``changed`` is added to every member when
the steering epoch moved between admission and the end of generation. Other plugins'
global steering (circuits) joins a request that runs with the global state through
:mod:`.contrib`: its members come first, by id. A request that would
need an attachment that cannot be applied (its SAE unreadable after a restart, or not
fitting the model) runs without it and reports ``unknown;reason=claims_unreadable``.

The decision reads one snapshot of the steering state (``state.live``: the live state,
the saved profiles and the attached SAEs), so it is consistent even when an operator write
lands at the same moment, and it reads memory only: no database, no files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np

from millm_core.api import AppliedSet, MillmError

from . import inline
from .contrib import CircuitMember, Contributor
from .inline import SAENotAttached
from .intensity import Intensity, is_off
from .intensity import parse as parse_intensity
from .intensity import resolve as resolve_intensity
from .live import CLAIMS_UNREADABLE, Live
from .profiles import Profile, check_features, named
from .registry import AttachmentUnusable


@dataclass(frozen=True)
class Entry:
    """One applied steering item: its kind (``inline``/``profile``/``manual``), where it
    applies and its applied set; profiles add their name, source and λ."""

    kind: str
    sae_id: str
    layer: int
    applied: AppliedSet
    name: str | None = None
    source: str | None = None
    intensity: float | None = None


@dataclass(frozen=True)
class Plan:
    """A request's steering: the non-empty entries, the epoch it was decided at, and the
    λ to echo in ``X-miLLM-Steering-Intensity`` (None: the dial changes nothing).

    Contributions (:mod:`.contrib`) add ``circuits`` members (reported first, by id), the
    deltas they apply (``added``: layer → vector), response ``headers`` and ``watches``
    (each says whether its contributor's state moved since: ``changed``)."""

    entries: tuple[Entry, ...] = ()
    epoch: int = 0
    echo: float | None = None
    unknown: str | None = None  # the state could not be determined (reported, never guessed)
    circuits: tuple[CircuitMember, ...] = ()
    added: Mapping[int, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    watches: tuple[Callable[[], bool], ...] = ()

    def moved(self, epoch: int) -> bool:
        """Whether the steering epoch is no longer the plan's, or a contribution's state
        moved: the report then says ``changed``."""
        return epoch != self.epoch or any(watch() for watch in self.watches)


@dataclass(frozen=True)
class Dials:
    """The configured floor and ceiling for bases that declare no range."""

    floor: float
    ceiling: float


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def profile_entry(profile: Profile, source: str, dial: Intensity | None, live: Live, dials: Dials) -> Entry:
    """A profile applied at its (SAE, layer) in ``live``, scaled by λ: the request's dial
    if given, else the profile's own (a cluster's stored dial; 1 for a plain profile).
    Raises :class:`AttachmentUnusable` when that attachment cannot be applied, and
    :class:`~.profiles.WidthMismatch` for a cluster whose SAE there is not as wide as the
    one it was imported for."""
    if (profile.sae_id, profile.layer) not in live.attachments:
        raise SAENotAttached(
            f"profile {profile.name!r} steers SAE {profile.sae_id!r} at layer {profile.layer}, which is not attached", param="profile"
        )
    if (profile.sae_id, profile.layer) in live.unusable:
        raise AttachmentUnusable(
            f"profile {profile.name!r} steers SAE {profile.sae_id!r} at layer {profile.layer}, which is unusable", param="profile"
        )
    width = live.saes[profile.sae_id].d_sae
    if profile.cluster is not None:
        profile.cluster.check_width(profile.name, profile.sae_id, profile.layer, width)
    check_features(profile.features, width, prefix="profile.features")
    declared = profile.cluster.intensity_range if profile.cluster else None
    lam = profile.intensity if dial is None else resolve_intensity(dial, declared, dials.floor, dials.ceiling)
    applied = AppliedSet.build(profile.sae_id, [(f.index, f.strength * lam) for f in profile.features])
    return Entry("profile", profile.sae_id, profile.layer, applied, name=profile.name, source=source, intensity=lam)


def _manual(live: Live, lam: float) -> list[Entry]:
    return [
        Entry("manual", sae_id, layer, AppliedSet.build(sae_id, [(i, s * lam) for i, s in values.items()]))
        for (sae_id, layer), values in live.manual.items()
    ]


def plan_for(request: Any, live: Live, dials: Dials, contributors: Sequence[Contributor] = ()) -> Plan:
    """Decide a validated request's steering from one snapshot ``live``. Raises the
    request's 4xx (unknown profile, profile invalid for the attached SAE, bad inline
    set). ``contributors`` are asked only when the request runs with the global state."""
    epoch = live.epoch
    steering = getattr(request, "steering", None)
    if isinstance(steering, inline.InlineSteering):
        if not steering.features:
            return Plan(epoch=epoch)
        target = inline.target(steering, live.attachments)
        if target in live.unusable:
            return Plan(epoch=epoch, unknown=CLAIMS_UNREADABLE)
        resolved = inline.resolve(steering, live.attachments, {target[0]: live.saes[target[0]]})
        if resolved is None:
            return Plan(epoch=epoch)
        return Plan(entries=_nonempty([Entry("inline", resolved.sae_id, resolved.layer, resolved.applied)]), epoch=epoch)
    dial: Intensity | None = None
    if _sent(getattr(request, "steering_intensity", None)):
        dial, _ = parse_intensity(request.steering_intensity)
    if _sent(getattr(request, "profile", None)):
        profile = named(live.profiles, request.profile)  # unknown: 404 before anything else
        if not live.attachments:
            return Plan(epoch=epoch)  # nothing to steer with: runs unsteered, no echo
        if dial is not None and is_off(dial):
            return Plan(epoch=epoch, echo=0.0 if profile.features else None)
        try:
            entry = profile_entry(profile, "request", dial, live, dials)
        except AttachmentUnusable:
            return Plan(epoch=epoch, unknown=CLAIMS_UNREADABLE)
        # The dial echoes whenever the base is not empty, a λ that applies nothing too
        # (a cluster capped at 0 by its range), as for "off" above.
        return Plan(entries=_nonempty([entry]), epoch=epoch, echo=entry.intensity if dial is not None and profile.features else None)
    contributed = [c for c in (contributor.contribute(live, dial) for contributor in contributors) if c is not None]
    watches = tuple(c.moved for c in contributed)
    unknown = next((c.unknown for c in contributed if c.unknown), None)
    if unknown is not None:
        return Plan(epoch=epoch, unknown=unknown, watches=watches)
    based = [c for c in contributed if c.base]
    if dial is not None and is_off(dial):
        own = _global(live, dials, dial, epoch)
        return replace(own, echo=0.0 if based and not own.unknown else own.echo, watches=watches)
    own = _global(live, dials, None if based else dial, epoch)
    if own.unknown:
        return replace(own, watches=watches)
    added: dict[int, Any] = {}
    for contribution in contributed:
        for layer, given in contribution.deltas.items():
            vector = np.asarray(given, dtype=np.float32)  # a tuple would concatenate, not add
            added[layer] = vector if layer not in added else added[layer] + vector
    return Plan(
        entries=_nonempty([*own.entries, *(e for c in contributed for e in c.entries)]),
        epoch=epoch,
        echo=based[0].echo if based else own.echo,
        circuits=tuple(sorted((m for c in contributed for m in c.circuits), key=lambda m: m.id)),
        added=added,
        headers={k: v for c in contributed for k, v in c.headers.items()},
        watches=watches,
    )


def _global(live: Live, dials: Dials, dial: Intensity | None, epoch: int) -> Plan:
    """The steering plugin's own global state for a request with no ``steering`` or
    ``profile``: the active profile and the manual values, scaled by ``dial``."""
    try:
        active = named(live.profiles, live.active[0]) if live.active else None
        as_stored = profile_entry(active, "active", None, live, dials) if active else None
    except AttachmentUnusable:
        return Plan(epoch=epoch, unknown=CLAIMS_UNREADABLE)
    except MillmError:  # deleted or no longer valid underneath: say so, never guess
        return Plan(epoch=epoch, unknown="profile_unreadable")
    if any(values and entry in live.unusable for entry, values in live.manual.items()):
        return Plan(epoch=epoch, unknown=CLAIMS_UNREADABLE)  # values an unusable attachment cannot apply
    if dial is None:
        entries = ([as_stored] if as_stored else []) + _manual(live, 1.0)
        return Plan(entries=_nonempty(entries), epoch=epoch)
    base_empty = not (active.features if active else any(live.manual.values()))
    if is_off(dial):
        return Plan(epoch=epoch, echo=None if base_empty else 0.0)
    if active:
        entry = profile_entry(active, "active", dial, live, dials)
        entries, lam = [entry, *_manual(live, 1.0)], entry.intensity
    else:
        lam = resolve_intensity(dial, None, dials.floor, dials.ceiling)
        entries = _manual(live, lam)
    return Plan(entries=_nonempty(entries), epoch=epoch, echo=None if base_empty else lam)


def _nonempty(entries: list[Entry]) -> tuple[Entry, ...]:
    return tuple(sorted((e for e in entries if e.applied.features), key=lambda e: (e.layer, e.sae_id)))


def deltas(plan: Plan, live: Live) -> dict[int, tuple[float, ...]]:
    """layer → Σ strength · W_dec[index] over the plan's entries at that layer, plus what
    contributions add there (``live``: the snapshot the plan was decided from)."""
    out: dict[int, Any] = {}
    for entry in plan.entries:
        direction = live.saes[entry.sae_id].direction(entry.applied.features)
        out[entry.layer] = direction if entry.layer not in out else out[entry.layer] + direction
    for layer, vector in plan.added.items():  # contributed (circuits): summed with the rest
        out[layer] = vector if layer not in out else out[layer] + vector
    return {layer: tuple(float(v) for v in vector) for layer, vector in out.items()}


def percent_encode(name: str) -> str:
    """The spec's encoding for ``name``: bytes outside %x20-7E and each of % " \\ as %XX."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and chr(b) not in '%"\\' else f"%{b:02X}" for b in name.encode("utf-8"))


def _member(entry: Entry) -> str:
    applied = entry.applied
    head = entry.kind
    if entry.kind == "profile":
        assert entry.name is not None and entry.intensity is not None
        head += f';name="{percent_encode(entry.name)}";source={entry.source};intensity="{entry.intensity!r}"'
    value = f'{head};sae="{entry.sae_id}";layer={entry.layer};features={len(applied.features)};hash="{applied.hash}"'
    return value + clamped_param(applied.clamped)  # manual values too: a dialled manual set can reach the clamp


def clamped_param(clamped: int) -> str:
    """``;clamped=N`` for a member whose applied strengths the ±200 clamp changed ``N``
    times (nothing when none did): every kind of member reports its clamps this way."""
    return f";clamped={clamped}" if clamped else ""


def sf_string(value: str) -> str:
    """``value`` as an RFC 8941 String (printable ASCII only; ``"`` and ``\\`` escaped)."""
    if any(not 0x20 <= ord(c) <= 0x7E for c in value):
        raise ValueError(f"{value!r} cannot be an RFC 8941 String")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def circuit_member(member: CircuitMember) -> str:
    """``circuit;id="…";intensity="…"[;clamped=N][;composed]`` (without ``changed``)."""
    value = f'circuit;id={sf_string(member.id)};intensity="{float(member.intensity)!r}"' + clamped_param(member.clamped)
    return value + (";composed" if member.composed else "")


def report(plan: Plan, changed: bool) -> str:
    """The ``X-miLLM-Steering`` value (an RFC 8941 List) for what the rows ran with:
    circuits first by id, then SAE items by layer, then SAE."""
    if plan.unknown:
        members = [f"unknown;reason={plan.unknown}"]
    else:
        members = [*(circuit_member(m) for m in plan.circuits), *(_member(e) for e in plan.entries)] or ["none"]
    return ", ".join(m + (";changed" if changed else "") for m in members)
