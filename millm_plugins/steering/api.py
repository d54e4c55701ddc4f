"""The steering management API, part 1: SAEs (``/api/saes``) and the live manual values
(``/api/steering``). Errors use the ``/v1`` error shape and statuses.

Every write to the live state (attach, detach, manual values) that changes it moves the
steering epoch, and is persisted before it takes effect (see :mod:`.registry`). Reads
answer from the snapshot after checking the database for other servers' writes. Blocking
work (SAE files, SQLite, ``sae.encode``) runs off the event loop; model code runs on the
model thread.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import (
    AppContext,
    Capability,
    FieldNotHonoured,
    InvalidRequest,
    ModelNotLoaded,
    PluginSetting,
    ResidualReader,
    RouteDoc,
    StashKey,
    app_context,
    guarded_csv,
    json_response,
    read_json,
    until_disconnect,
)

from .apply import Dials, Plan, plan_for, report
from .contrib import Contributor, contributors
from .inline import Feature
from .live import Live
from .profiles import check_features
from .registry import SteeringState, entry_of, require_usable
from .sae import SAE, SAEFormatError

STATE = StashKey[SteeringState]("steering.state")


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 2.0:
        raise ValueError("must be in [0, 2]")
    return number


FLOOR = PluginSetting(
    "cluster_intensity_min", 0.5, 'the dial\'s "min" for clusters and profiles that declare no intensity_range', _fraction
)
CEILING = PluginSetting(
    "cluster_intensity_max", 2.0, 'the dial\'s "max" (and cap) for clusters and profiles that declare no intensity_range', _fraction
)



def _roots(value: str) -> tuple[str, ...]:
    """Directories, comma-separated; a value of nothing but blanks and commas is refused
    (it would read as "any path")."""
    return guarded_csv(value, "directory")


SAE_ROOTS: PluginSetting[tuple[str, ...]] = PluginSetting(
    "sae_roots",
    (),
    "comma-separated directories POST /api/saes may load SAEs from (a path elsewhere, symlinks resolved, is refused); "
    "none: any path the server can read",
    _roots,
)


def allowed_sae_path(app: AppContext, path: str) -> None:
    """Refuse a path outside ``--sae-roots`` (when set), symlinks resolved, before anything
    on disk is opened."""
    roots = SAE_ROOTS.get(app.settings)
    if not roots:
        return
    refusal = InvalidRequest("SAEs load only from under the directories --sae-roots names; this path is elsewhere", param="path", code="sae_path_not_allowed")
    try:
        real = os.path.realpath(path)
    except ValueError as exc:  # a NUL byte: no file has such a name
        raise refusal from exc
    for root in roots:
        base = os.path.realpath(os.path.expanduser(root))
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return
    raise refusal


class RegisterSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/saes``: a SAELens directory or a Gemma Scope ``params.npz``."""

    path: str
    id: str | None = None


class AttachSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/saes/{id}/attach`` and ``…/detach`` (detach without a layer: all)."""

    layer: int | None = None


class SAEInfo(msgspec.Struct, kw_only=True):
    """An SAE as the API reports it. ``status`` is ``"unreadable"`` (with the ``reason``,
    and no shape) when its files can no longer be read; it can still be detached and
    deleted."""

    id: str
    path: str
    status: str = "ok"
    reason: str | None = None
    architecture: str | None
    d_in: int | None
    d_sae: int | None
    attached_layers: list[int]
    # The hook point the SAE was trained on (SAELens ``hook_name``), and the attachment
    # layer it means (``blocks.N.hook_resid_pre`` is block N-1's output).
    hook_name: str | None = None
    hook_layer: int | None = None


class SAEList(msgspec.Struct, kw_only=True):
    """``GET /api/saes``: the registered SAEs (one whose files cannot be read is listed with ``status: "unreadable"``)."""

    object: str = "list"
    data: list[SAEInfo]


class SAEDeleted(msgspec.Struct, kw_only=True):
    """``DELETE /api/saes/{id}``: the id of the SAE forgotten (it is detached everywhere
    too, with what detaching removes: ``deactivated_profile`` names the active profile
    deactivated because it was bound to the SAE, ``manual_values_removed`` counts the
    manual feature values erased)."""

    id: str
    deleted: bool
    deactivated_profile: str | None = None
    manual_values_removed: int = 0


class SAEDetached(SAEInfo, kw_only=True):
    """The SAE after ``detach``: ``detached`` counts the attachments removed,
    ``deactivated_profile`` names the active profile deactivated because it was bound to
    one of them (null: none), and ``manual_values_removed`` counts the manual feature
    values erased there."""

    detached: int
    deactivated_profile: str | None = None
    manual_values_removed: int = 0


class FeatureQuery(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/saes/{id}/features``: which features fire on ``text`` (no chat template,
    no special tokens), at the attachment ``layer`` (omit when attached once)."""

    text: str
    layer: int | None = None
    top_k: int = 10


class FeatureHit(msgspec.Struct, kw_only=True):
    """One feature of a ``FeatureReport``: its index, its peak and mean activation over the text's tokens, and the token
    where it peaks."""

    index: int
    max: float
    mean: float
    token: str  # the token where the feature fires most


class FeatureReport(msgspec.Struct, kw_only=True):
    """``POST /api/saes/{id}/features``: the SAE and layer read, the text's token count, and the features that fire on it
    (at most ``top_k``, highest peak first)."""

    sae_id: str
    layer: int
    tokens: int
    features: list[FeatureHit]


class ManualValues(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``PUT /api/steering``: the live values for one attached SAE (``sae_id`` may be
    omitted when exactly one SAE is attached; ``layer`` when it is attached once).
    ``features: []`` clears that SAE's values."""

    sae_id: str | None = None
    layer: int | None = None
    features: list[Feature]


class ManualEntry(msgspec.Struct, kw_only=True):
    """The manual values of one attachment (``sae_id`` at ``layer``) in ``GET /api/steering``, its features sorted by index."""

    sae_id: str
    layer: int
    features: list[Feature]


class ActiveProfile(msgspec.Struct, kw_only=True):
    """The active profile in ``GET /api/steering``: its name and the attachment (``sae_id`` at ``layer``) it applies to."""

    name: str
    sae_id: str
    layer: int


class UnusableAttachment(msgspec.Struct, kw_only=True):
    """An attachment that is kept but not applied: ``reason`` is ``sae_unreadable``,
    ``width_mismatch``, ``layer_out_of_range`` or ``not_steerable``."""

    sae_id: str
    layer: int
    reason: str
    message: str


class LiveState(msgspec.Struct, kw_only=True):
    """``GET /api/steering``: what a request with no steering fields runs with now.
    ``unusable`` lists the attachments that cannot be applied (a request that would need
    one reports ``unknown;reason=claims_unreadable``)."""

    epoch: int
    attached: list[tuple[str, int]]
    manual: list[ManualEntry]
    active_profile: ActiveProfile | None
    steering: str  # the X-miLLM-Steering value such a request would report
    unusable: list[UnusableAttachment]


def state_of(app: AppContext) -> SteeringState:
    """The app's steering state, created by the plugin's ``millm_startup``."""
    return app.stash[STATE]


def dials_of(app: AppContext) -> Dials:
    return Dials(floor=float(FLOOR.get(app.settings)), ceiling=float(CEILING.get(app.settings)))


def steering_state(request: Request) -> SteeringState:
    return state_of(app_context(request))


async def body_of(request: Request, type_: type[Any]) -> Any:
    return await read_json(request, type_)


class NoBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of a write that takes no fields (activate, deactivate): nothing, or ``{}``.
    A field, or a body that is not JSON, is refused with a 400 naming it, as on every
    other route."""


def _info(state: SteeringState, sae_id: str, path: str, sae: SAE) -> SAEInfo:
    return SAEInfo(
        id=sae_id, path=path, architecture=sae.architecture, d_in=sae.d_in, d_sae=sae.d_sae, attached_layers=state.layers_of(sae_id),
        hook_name=sae.hook_name, hook_layer=sae.hook_layer,
    )  # fmt: skip


def describe(state: SteeringState, sae_id: str, path: str) -> SAEInfo:
    """The SAE as listed, or ``unreadable`` with the reason (blocking: loads its files)."""
    try:
        return _info(state, sae_id, path, state.get(sae_id))
    except SAEFormatError as exc:
        return SAEInfo(
            id=sae_id,
            path=path,
            status="unreadable",
            reason=exc.message,
            architecture=None,
            d_in=None,
            d_sae=None,
            attached_layers=state.layers_of(sae_id),
        )


async def register_sae(request: Request) -> Response:
    body = await body_of(request, RegisterSAE)
    allowed_sae_path(app_context(request), body.path)
    state = steering_state(request)
    sae_id, sae = await state.register(body.path, body.id)
    return json_response(_info(state, sae_id, body.path, sae), status=201)


async def list_saes(request: Request) -> Response:
    state = steering_state(request)
    await state.refresh()

    def listing() -> SAEList:
        return SAEList(data=[describe(state, i, p) for i, p in state.registered()])

    return json_response(await asyncio.to_thread(listing))


async def _described(state: SteeringState, sae_id: str) -> SAEInfo:
    return await asyncio.to_thread(lambda: describe(state, sae_id, state.path_of(sae_id)))


async def get_sae(request: Request) -> Response:
    state = steering_state(request)
    await state.refresh()
    return json_response(await _described(state, request.path_params["sae_id"]))


async def delete_sae(request: Request) -> Response:
    state = steering_state(request)
    done = await state.delete(request.path_params["sae_id"])
    return json_response(
        SAEDeleted(
            id=request.path_params["sae_id"], deleted=True, deactivated_profile=done.deactivated_profile,
            manual_values_removed=done.manual_values_removed,
        )  # fmt: skip
    )


def attachment_layer(sae: SAE, asked: int | None) -> int:
    """Where an SAE attaches: the block output its recorded hook point is (a
    ``hook_resid_pre`` of block N is block N-1's output), else the layer asked for. An SAE
    whose recorded hook point is not the residual stream is refused."""
    native = sae.hook_layer
    if native is None and sae.hook_name:  # recorded, and not the residual stream (attention or MLP outputs, z, …)
        raise InvalidRequest(
            f"this SAE was trained on {sae.hook_name}, not on the residual stream between blocks, which is where millm reads "
            "and steers: its features would mean nothing there",
            param="layer",
        )
    if native is not None and native < 0:
        raise InvalidRequest(
            f"this SAE reads {sae.hook_name} (the embeddings, before any block): there is no block output to steer there", param="layer"
        )
    if native is not None and asked is not None and asked != native:
        raise InvalidRequest(
            f"this SAE was trained on {sae.hook_name}, which is the output of block {native}; attach it at layer {native} (or omit layer)",
            param="layer",
        )
    if native is not None:
        return native
    if asked is None:
        raise InvalidRequest("attach needs a layer (this SAE records no residual-stream hook point)", param="layer")
    return asked


async def attach_sae(request: Request) -> Response:
    body = await body_of(request, AttachSAE)
    state, app = steering_state(request), app_context(request)
    model = next(iter(app.models), None)
    if model is None:
        raise ModelNotLoaded("an SAE attaches to the resident model, and none is loaded yet")
    if Capability.STEERING not in model.capabilities:
        raise FieldNotHonoured(f"the {model.info.engine} engine serving {model.info.served_name!r} cannot be steered", param="layer")
    sae_id = request.path_params["sae_id"]
    layer = attachment_layer(await state.sae(sae_id), body.layer)
    await state.attach(sae_id, layer, model.info)
    sae = await state.sae(sae_id)
    return json_response(_info(state, sae_id, sae.path, sae))


async def detach_sae(request: Request) -> Response:
    body = await body_of(request, AttachSAE)
    state = steering_state(request)
    sae_id = request.path_params["sae_id"]
    await asyncio.to_thread(state.path_of, sae_id)  # 404 for an unknown SAE; an unreadable one detaches
    done = await state.detach(sae_id, body.layer)
    info = await _described(state, sae_id)
    return json_response(
        SAEDetached(
            **msgspec.structs.asdict(info), detached=done.attachments, deactivated_profile=done.deactivated_profile,
            manual_values_removed=done.manual_values_removed,
        )  # fmt: skip
    )


async def usable_attachment(state: SteeringState, sae_id: str, layer: int | None) -> tuple[SAE, tuple[str, int]]:
    """The SAE and the attachment ``(sae_id, layer)`` a write or read of its features names,
    refused in this order: an unregistered SAE (404), one not attached there (400
    ``sae_not_attached``), an attachment that cannot be applied (409
    ``attachment_unusable``). The SAE's files are read only after that, so an SAE whose
    files are gone is the 409 its attachment is listed with, never a file error."""
    live = await state.refresh()
    await asyncio.to_thread(state.path_of, sae_id)
    entry = entry_of(live, sae_id, layer)
    require_usable(live, entry)
    return await state.sae(sae_id), entry


def _top_features(sae: SAE, residual: Any, top_k: int) -> tuple[Any, list[int]]:
    acts = sae.encode(residual)
    peak = acts.max(0)
    return acts, [int(i) for i in np.argsort(-peak, kind="stable")[:top_k] if peak[i] > 0]


async def features(request: Request) -> Response:
    """The SAE's strongest features on a text, read from the resident model, unsteered.
    A client that disconnects cancels the work, queued model calls included."""
    body = await body_of(request, FeatureQuery)
    return await until_disconnect(request, _features(request, body))


async def _features(request: Request, body: FeatureQuery) -> Response:
    state, app = steering_state(request), app_context(request)
    sae_id = request.path_params["sae_id"]
    sae, (_, layer) = await usable_attachment(state, sae_id, body.layer)
    if sae.encode_refusal is not None:  # as return_sae_activations and the probes: no unfaithful reading
        raise InvalidRequest(f"SAE {sae_id!r} cannot be read faithfully: {sae.encode_refusal}", code="sae_encoding_unsupported")
    if not 1 <= body.top_k <= 100:
        raise InvalidRequest("top_k must be 1–100", param="top_k")
    model = next(iter(app.models), None)
    if model is None:
        raise ModelNotLoaded("no model is loaded yet")
    engine = model.engine
    if not isinstance(engine, ResidualReader):
        raise FieldNotHonoured(f"the {model.info.engine} engine cannot read residuals", param="text")
    ids = await app.run_model(lambda: engine.encode(body.text, add_special_tokens=False))
    if not ids:
        raise InvalidRequest("text has no tokens", param="text")
    if len(ids) > model.info.context_length:
        raise InvalidRequest(
            f"text is {len(ids)} tokens; the model reads at most {model.info.context_length}", code="context_length_exceeded", param="text"
        )
    residual = await app.run_model(lambda: engine.residuals([ids], layer)[0])
    acts, order = await asyncio.to_thread(_top_features, sae, residual, body.top_k)
    hits = [
        FeatureHit(
            index=i, max=float(acts[:, i].max()), mean=float(acts[:, i].mean()), token=engine.decode([ids[int(acts[:, i].argmax())]])
        )
        for i in order
    ]
    return json_response(FeatureReport(sae_id=sae_id, layer=layer, tokens=len(ids), features=hits))


class _NoFields:
    """A request that sends no steering fields: it runs with the global state."""

    steering = profile = steering_intensity = None


def plain_plan(app: AppContext) -> Plan:
    """What a request with no steering fields runs with now (the contributors' global
    steering included), from the current snapshot; ``report(plan, changed=False)`` is the
    ``X-miLLM-Steering`` value it would carry."""
    return plan_for(_NoFields(), state_of(app).live, dials_of(app), contributors(app))


def live_state(dials: Dials, live: Live, joined: list[Contributor] | None = None) -> LiveState:
    """The live state ``live`` as reported (``joined``: the app's contributors, whose
    global steering a plain request also runs with)."""
    manual = [
        ManualEntry(sae_id=s, layer=layer, features=[Feature(index=i, strength=v) for i, v in sorted(values.items())])
        for (s, layer), values in live.manual.items()
    ]
    active = ActiveProfile(name=live.active[0], sae_id=live.active[1][0], layer=live.active[1][1]) if live.active else None
    value = report(plan_for(_NoFields(), live, dials, joined or []), changed=False)
    unusable = [UnusableAttachment(sae_id=s, layer=layer, reason=u.reason, message=u.message) for (s, layer), u in live.unusable.items()]
    return LiveState(
        epoch=live.epoch, attached=list(live.attachments), manual=manual, active_profile=active, steering=value, unusable=unusable
    )


def live_response(request: Request) -> Response:
    """``GET /api/steering``'s body for the current snapshot (after a write: the state it
    made current)."""
    app = app_context(request)
    return json_response(live_state(dials_of(app), steering_state(request).live, contributors(app)))


async def get_steering(request: Request) -> Response:
    await steering_state(request).refresh()
    return live_response(request)


async def put_steering(request: Request) -> Response:
    body = await body_of(request, ManualValues)
    state = steering_state(request)
    sae_id = body.sae_id
    if sae_id is None:
        saes = sorted({s for s, _ in (await state.refresh()).attachments})
        if len(saes) != 1:
            raise InvalidRequest(f"name the SAE with sae_id: {len(saes)} SAEs are attached {saes}", param="sae_id")
        sae_id = saes[0]
    sae, _ = await usable_attachment(state, sae_id, body.layer)

    def change(live: Live) -> Live:
        entry = entry_of(live, sae_id, body.layer)
        require_usable(live, entry)
        check_features(body.features, sae.d_sae)
        manual = {e: v for e, v in live.manual.items() if e != entry}
        if body.features:
            manual = {**live.manual, entry: {f.index: f.strength for f in body.features}}
        # The operator's latest write wins the entry the active profile held.
        active = None if live.active is not None and live.active[1] == entry else live.active
        return replace(live, manual=manual, active=active)

    await state.commit(change)
    return live_response(request)


async def delete_steering(request: Request) -> Response:
    await steering_state(request).commit(lambda live: replace(live, manual={}, active=None))
    return live_response(request)


Route = tuple[str, Any, list[str], RouteDoc]

# A write may also be refused with 503 database_busy (another connection holds the lock).
WRITE = ("400", "404", "503")
ROUTES: tuple[Route, ...] = (
    ("/api/saes", register_sae, ["POST"], RouteDoc("Register an SAE from local files", RegisterSAE, SAEInfo, 201, ("400", "409", "503"))),
    ("/api/saes", list_saes, ["GET"], RouteDoc("Registered SAEs", response=SAEList, errors=())),
    ("/api/saes/{sae_id}", get_sae, ["GET"], RouteDoc("One SAE", response=SAEInfo, errors=("404",))),
    (
        "/api/saes/{sae_id}",
        delete_sae,
        ["DELETE"],
        RouteDoc("Forget an SAE (detaching it everywhere)", response=SAEDeleted, errors=("404", "503")),
    ),
    (
        "/api/saes/{sae_id}/attach",
        attach_sae,
        ["POST"],
        RouteDoc("Attach at a decoder block's output", AttachSAE, SAEInfo, errors=("400", "404", "503")),
    ),
    ("/api/saes/{sae_id}/detach", detach_sae, ["POST"], RouteDoc("Detach (at one layer, or all)", AttachSAE, SAEDetached, errors=WRITE)),
    (
        "/api/saes/{sae_id}/features",
        features,
        ["POST"],
        RouteDoc("The SAE's strongest features on a text", FeatureQuery, FeatureReport, errors=("400", "404", "409", "503")),
    ),
    ("/api/steering", get_steering, ["GET"], RouteDoc("The live steering state", response=LiveState, errors=())),
    (
        "/api/steering",
        put_steering,
        ["PUT"],
        RouteDoc("Set the manual values of one attached SAE", ManualValues, LiveState, errors=(*WRITE, "409")),
    ),
    (
        "/api/steering",
        delete_steering,
        ["DELETE"],
        RouteDoc("Clear manual values and deactivate the active profile", response=LiveState, errors=("503",)),
    ),
)
