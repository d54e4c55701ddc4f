"""The steering management API, part 2: profiles (``/api/profiles``) and imported
clusters with their intensity dial (``/api/clusters``).

Profiles, clusters and which one is active persist in the database and are held in the
steering snapshot (see :mod:`.registry`). Activating, deactivating, deleting the active
one and turning an active cluster's dial move the steering epoch. An import writes all of
its profiles in one transaction. SQLite and SAE files are read off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import InvalidRequest, MillmError, NotFound, RouteDoc, app_context, convert, parse_bool

from .api import WRITE, LiveState, NoBody, Route, body_of, dials_of, json_response, live_response, steering_state
from .apply import Dials, profile_entry
from .inline import Feature, SAENotAttached
from .intensity import bounds
from .live import Live
from .profiles import (
    EXPORT_FORMAT,
    ClusterDocument,
    Dial,
    Profile,
    ProfileExport,
    added,
    check_dial,
    check_features,
    check_layer,
    check_name,
    cluster_named,
    cluster_profile,
    named,
    with_intensity,
)
from .registry import SteeringState
from .sae import SAE


class ProfileInfo(msgspec.Struct, kw_only=True):
    """A profile as the API reports it (clusters add their dial)."""

    name: str
    sae_id: str
    layer: int
    features: list[Feature]
    active: bool
    cluster: Dial | None = None


class ProfileList(msgspec.Struct, kw_only=True):
    """``GET /api/profiles`` (every profile, clusters included) and ``GET /api/clusters`` (clusters only), sorted by name."""

    object: str = "list"
    data: list[ProfileInfo]


class ProfileDeleted(msgspec.Struct, kw_only=True):
    """``DELETE /api/profiles/{name}`` and ``DELETE /api/clusters/{name}``: the name deleted (an active one is deactivated
    in the same write)."""

    name: str
    deleted: bool


class ActiveInfo(msgspec.Struct, kw_only=True):
    """``GET /api/profiles/active``: the active profile or cluster, or null when none is active."""

    active: ProfileInfo | None


class Imported(msgspec.Struct, kw_only=True):
    """``POST /api/profiles/import``: the names of the profiles written, in the document's order."""

    imported: list[str]


class ClusterImported(ProfileInfo, kw_only=True):
    """The cluster's profile, and the document's fields it did not use."""

    ignored_fields: list[str]


class Intensity(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``PUT /api/clusters/{id}/intensity``."""

    intensity: float


def _info(live: Live, profile: Profile) -> ProfileInfo:
    active = live.active is not None and live.active[0] == profile.name
    return ProfileInfo(
        name=profile.name,
        sae_id=profile.sae_id,
        layer=profile.layer,
        features=list(profile.features),
        active=active,
        cluster=profile.cluster,
    )


def _validate(state: SteeringState, profile: Profile) -> SAE:
    """Check a profile against its SAE, and return that SAE (blocking: may read the SAE's
    files)."""
    check_name(profile.name)
    check_layer(profile.layer)
    try:
        sae = state.get(profile.sae_id)
    except NotFound as exc:
        exc.param = "sae_id"
        raise
    check_features(profile.features, sae.d_sae)
    return sae


def _replace(request: Request) -> bool:
    """``?replace=``: true or false (``1``/``0``, ``yes``/``no``, ``on``/``off``); anything else is refused."""
    raw = request.query_params.get("replace")
    if raw is None:
        return False
    try:
        return parse_bool(raw)
    except ValueError:
        raise InvalidRequest("replace must be true or false", param="replace") from None


async def _current(request: Request) -> Live:
    """The snapshot, with other servers' writes picked up (off the event loop)."""
    return await steering_state(request).refresh()


async def _activate(request: Request, find: Callable[[Mapping[str, Profile]], Profile]) -> Response:
    """Activate the profile ``find`` picks from the state the write sees."""
    await body_of(request, NoBody)
    state = steering_state(request)
    dials = dials_of(app_context(request))

    def change(live: Live) -> Live:
        profile = find(live.profiles)
        entry = (profile.sae_id, profile.layer)
        profile_entry(profile, "active", None, live, dials)  # refuses what could not apply
        manual = {e: v for e, v in live.manual.items() if e != entry}  # the profile claims its entry
        return replace(live, manual=manual, active=(profile.name, entry))

    await state.commit(change)
    return live_response(request)


async def _deactivate(request: Request, only: str | None = None) -> Response:
    await body_of(request, NoBody)

    def change(live: Live) -> Live | None:
        return replace(live, active=None) if live.active is not None and (only is None or live.active[0] == only) else None

    await steering_state(request).commit(change)
    return live_response(request)


async def _delete(request: Request, find: Callable[[Mapping[str, Profile]], Profile]) -> Response:
    """Delete the profile ``find`` picks, deactivating it if it is active (one write)."""
    state = steering_state(request)
    name = ""

    def change(live: Live) -> Live:
        nonlocal name
        name = find(live.profiles).name
        active = None if live.active is not None and live.active[0] == name else live.active
        return replace(live, profiles={n: p for n, p in live.profiles.items() if n != name}, active=active)

    await state.commit(change)
    return json_response(ProfileDeleted(name=name, deleted=True))


def _profile(name: str) -> Callable[[Mapping[str, Profile]], Profile]:
    return lambda profiles: named(profiles, name)


def _cluster(name: str) -> Callable[[Mapping[str, Profile]], Profile]:
    return lambda profiles: cluster_named(profiles, name)


# ------------------------------------------------------------------ profiles


async def create_profile(request: Request) -> Response:
    body = await body_of(request, Profile)
    if body.cluster is not None:
        raise InvalidRequest("clusters are created with POST /api/clusters/import", param="cluster")
    state = steering_state(request)
    await asyncio.to_thread(_validate, state, body)
    live = await state.commit(lambda live: replace(live, profiles=added(live.profiles, [body], replace=False, param="name")))
    return json_response(_info(live, body), status=201)


async def list_profiles(request: Request) -> Response:
    live = await _current(request)
    return json_response(ProfileList(data=[_info(live, p) for _, p in sorted(live.profiles.items())]))


async def get_profile(request: Request) -> Response:
    live = await _current(request)
    return json_response(_info(live, named(live.profiles, request.path_params["name"])))


async def delete_profile(request: Request) -> Response:
    return await _delete(request, _profile(request.path_params["name"]))


async def activate_profile(request: Request) -> Response:
    return await _activate(request, _profile(request.path_params["name"]))


async def deactivate_profile(request: Request) -> Response:
    return await _deactivate(request)


async def active_profile(request: Request) -> Response:
    live = await _current(request)
    active = live.active_profile()
    return json_response(ActiveInfo(active=_info(live, active) if active else None))


async def export_all(request: Request) -> Response:
    live = await _current(request)
    return json_response(ProfileExport(profiles=[p for _, p in sorted(live.profiles.items())]))


async def export_one(request: Request) -> Response:
    live = await _current(request)
    return json_response(ProfileExport(profiles=[named(live.profiles, request.path_params["name"])]))


def _check_dial_bounds(dial: Dial, dials: Dials, param: str) -> None:
    """A stored dial within the bounds ``PUT …/intensity`` would take: [0, max], max the
    declared range's top or, without one, the server's ceiling."""
    _, high = bounds(dial.intensity_range, dials.floor, dials.ceiling)
    if not 0.0 <= dial.intensity <= high:
        raise InvalidRequest(
            f"intensity {dial.intensity} is outside [0, {high}], this cluster's dial bounds (its intensity_range, else the server's maximum)",
            param=f"{param}.intensity",
        )


def _check_import(state: SteeringState, document: ProfileExport) -> None:
    """Check every profile (blocking: may read SAE files). A cluster's dial is checked
    against its own declared range only: an export from a server with another ceiling
    imports as it was."""
    for position, profile in enumerate(document.profiles):
        try:
            sae = _validate(state, profile)
            if profile.cluster is not None:
                check_dial(profile.cluster, param="cluster")
                profile.cluster.check_width(profile.name, profile.sae_id, profile.layer, sae.d_sae, param="cluster.n_features")
                if profile.cluster.intensity_range is not None:
                    _check_dial_bounds(profile.cluster, Dials(floor=0.0, ceiling=2.0), "cluster")
        except MillmError as exc:
            exc.param = f"profiles[{position}].{exc.param}" if exc.param else f"profiles[{position}]"
            raise
    names = [p.name for p in document.profiles]
    if len(set(names)) != len(names):
        raise InvalidRequest("the document names a profile twice", param="profiles")


async def import_profiles(request: Request) -> Response:
    """Import an export document; every profile is checked before any is written, and
    all are written in one transaction. ``?replace=true`` overwrites profiles of the same
    name."""
    body = await body_of(request, ProfileExport)
    overwrite = _replace(request)
    if body.format != EXPORT_FORMAT:
        raise InvalidRequest(f"format {body.format!r} is not {EXPORT_FORMAT}", param="format")
    state = steering_state(request)
    await asyncio.to_thread(_check_import, state, body)
    await state.commit(lambda live: replace(live, profiles=added(live.profiles, body.profiles, replace=overwrite)))
    return json_response(Imported(imported=[p.name for p in body.profiles]), status=201)


# ------------------------------------------------------------------ clusters


async def import_cluster(request: Request) -> Response:
    """A cluster-definition document becomes a profile bound to the SAE attached at
    ``sae.layer`` whose width is ``sae.n_features``."""
    raw = await body_of(request, dict[str, Any])
    doc = convert(raw, ClusterDocument)
    overwrite = _replace(request)
    state = steering_state(request)
    live = await state.refresh()
    # Attached, usable SAEs are loaded; an unusable attachment is never a candidate.
    widths = {(s, layer): live.saes[s].d_sae for s, layer in live.attachments if (s, layer) not in live.unusable}
    candidates = [s for (s, layer), width in widths.items() if layer == doc.sae.layer and width == doc.sae.n_features]
    if not candidates:
        attached = [(s, layer, width) for (s, layer), width in widths.items()]
        raise SAENotAttached(
            f"the cluster needs an SAE of width {doc.sae.n_features} attached at layer {doc.sae.layer}; attached (id, layer, width): {attached}",
            param="sae",
        )
    if len(candidates) > 1:
        raise InvalidRequest(f"several SAEs of width {doc.sae.n_features} are attached at layer {doc.sae.layer}: {candidates}", param="sae")
    check_name(doc.name)
    dials = dials_of(app_context(request))
    if doc.budget.intensity is None:  # not sent: 1 within the dial's bounds, never a refusal
        _, high = bounds(doc.budget.intensity_range, dials.floor, dials.ceiling)
        doc = msgspec.structs.replace(doc, budget=msgspec.structs.replace(doc.budget, intensity=min(1.0, high)))
    profile = cluster_profile(doc, candidates[0])
    assert profile.cluster is not None
    _check_dial_bounds(profile.cluster, dials, "budget")
    live = await state.commit(lambda live: replace(live, profiles=added(live.profiles, [profile], replace=overwrite, param="name")))
    known = {"name", "sae", "members", "budget"}
    ignored = sorted(k for k in raw if k not in known) if isinstance(raw, dict) else []
    return json_response(ClusterImported(**msgspec.structs.asdict(_info(live, profile)), ignored_fields=ignored), status=201)


async def list_clusters(request: Request) -> Response:
    live = await _current(request)
    return json_response(ProfileList(data=[_info(live, p) for _, p in sorted(live.profiles.items()) if p.cluster is not None]))


async def get_cluster(request: Request) -> Response:
    live = await _current(request)
    return json_response(_info(live, cluster_named(live.profiles, request.path_params["name"])))


async def set_intensity(request: Request) -> Response:
    """Set the persistent dial: a number in [0, max], max being the declared range's top
    (or the configured ceiling) within [0, 2]. Moves the epoch when the cluster is active
    and the value is not the one it has (re-sending it writes nothing)."""
    body = await body_of(request, Intensity)
    state, name = steering_state(request), request.path_params["name"]
    dials = dials_of(app_context(request))
    cluster_named((await state.refresh()).profiles, name)  # 404 before the body's checks
    updated: Profile | None = None

    def change(live: Live) -> Live | None:
        nonlocal updated
        cluster = cluster_named(live.profiles, name)
        assert cluster.cluster is not None
        _, high = bounds(cluster.cluster.intensity_range, dials.floor, dials.ceiling)
        if isinstance(body.intensity, bool) or not 0.0 <= body.intensity <= high:
            raise InvalidRequest(f"intensity must be a number in [0, {high}] for cluster {name!r}", param="intensity")
        if float(body.intensity) == cluster.cluster.intensity:
            updated = cluster
            return None  # the dial it already has: nothing is written, the epoch stays
        updated = with_intensity(cluster, float(body.intensity))
        return replace(live, profiles={**live.profiles, name: updated})

    live = await state.commit(change)
    assert updated is not None
    return json_response(_info(live, updated))


async def activate_cluster(request: Request) -> Response:
    return await _activate(request, _cluster(request.path_params["name"]))


async def deactivate_cluster(request: Request) -> Response:
    name = request.path_params["name"]
    cluster_named((await _current(request)).profiles, name)  # 404 for a name that is no cluster
    return await _deactivate(request, only=name)


async def delete_cluster(request: Request) -> Response:
    return await _delete(request, _cluster(request.path_params["name"]))


# Fixed paths before the {name} ones: "active", "deactivate", "export" and "import" are
# reserved profile names for that reason.
E404 = ("404",)
PROFILE = RouteDoc("One profile", response=ProfileInfo, errors=E404)
ROUTES: tuple[Route, ...] = (
    ("/api/profiles", create_profile, ["POST"], RouteDoc("Save a profile", Profile, ProfileInfo, 201, ("400", "404", "409", "503"))),
    ("/api/profiles", list_profiles, ["GET"], RouteDoc("Saved profiles (clusters included)", response=ProfileList, errors=())),
    ("/api/profiles/active", active_profile, ["GET"], RouteDoc("The active profile", response=ActiveInfo, errors=())),
    (
        "/api/profiles/deactivate",
        deactivate_profile,
        ["POST"],
        RouteDoc("Deactivate the active profile", response=LiveState, errors=("400", "503")),
    ),
    ("/api/profiles/export", export_all, ["GET"], RouteDoc("Export every profile", response=ProfileExport, errors=())),
    (
        "/api/profiles/import",
        import_profiles,
        ["POST"],
        RouteDoc("Import an export document", ProfileExport, Imported, 201, ("400", "404", "409", "503")),
    ),
    ("/api/profiles/{name}", get_profile, ["GET"], PROFILE),
    ("/api/profiles/{name}", delete_profile, ["DELETE"], RouteDoc("Delete a profile", response=ProfileDeleted, errors=("404", "503"))),
    (
        "/api/profiles/{name}/activate",
        activate_profile,
        ["POST"],
        RouteDoc("Activate a profile for every request", response=LiveState, errors=(*WRITE, "409")),
    ),
    ("/api/profiles/{name}/export", export_one, ["GET"], RouteDoc("Export one profile", response=ProfileExport, errors=E404)),
    (
        "/api/clusters/import",
        import_cluster,
        ["POST"],
        RouteDoc("Import a cluster-definition document", ClusterDocument, ClusterImported, 201, ("400", "409", "503")),
    ),
    ("/api/clusters", list_clusters, ["GET"], RouteDoc("Imported clusters", response=ProfileList, errors=())),
    ("/api/clusters/{name}", get_cluster, ["GET"], RouteDoc("One cluster", response=ProfileInfo, errors=E404)),
    ("/api/clusters/{name}", delete_cluster, ["DELETE"], RouteDoc("Delete a cluster", response=ProfileDeleted, errors=("404", "503"))),
    (
        "/api/clusters/{name}/intensity",
        set_intensity,
        ["PUT"],
        RouteDoc("Set the cluster's persistent dial", Intensity, ProfileInfo, errors=WRITE),
    ),
    (
        "/api/clusters/{name}/activate",
        activate_cluster,
        ["POST"],
        RouteDoc("Activate a cluster", response=LiveState, errors=(*WRITE, "409")),
    ),
    (
        "/api/clusters/{name}/deactivate",
        deactivate_cluster,
        ["POST"],
        RouteDoc("Deactivate the cluster if it is active", response=LiveState, errors=("400", "404", "503")),
    ),
)
