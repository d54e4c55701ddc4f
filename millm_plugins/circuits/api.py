"""The circuits management API (``/api/circuits``). Errors use the ``/v1`` error shape.

Reads answer from the snapshots after picking up other servers' writes; writes go through
:meth:`~.book.CircuitState.commit` (one transaction, stored before it takes effect).
Activating, deactivating, deleting an active circuit and turning an active circuit's dial
move the circuits epoch, which a request that overlaps the write reports as ``changed``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import (
    AppContext,
    InvalidRequest,
    MillmError,
    NotFound,
    RouteDoc,
    StashKey,
    app_context,
    convert,
    json_response,
    parse_bool,
    read_json,
)
from millm_plugins.steering.public import STATE, Feature, SteeringState, clamped_bounds, dials_of, plain_plan, report

from .book import Book, CircuitState, Row, encode_body
from .document import CircuitDocument, compile_document, ignored_fields
from .ladder import HEADER, VALIDATED, language
from .serve import Serving, decide
from .settings import envelope_of, limits_of

CIRCUITS = StashKey[CircuitState]("circuits.state")


class CircuitNotFound(NotFound):
    code = "circuit_not_found"


class CircuitConflict(MillmError):
    """409: the write conflicts with the circuits' state (``code`` says how)."""

    status = 409
    type = "invalid_request_error"
    code = "circuit_conflict"


# ------------------------------------------------------------------ response shapes


class CircuitSlice(msgspec.Struct, kw_only=True):
    """The circuit at one layer: its SAE and the authored strengths (clusters expanded)."""

    layer: int
    sae_id: str
    features: list[Feature]


class CircuitInfo(msgspec.Struct, kw_only=True):
    """A stored circuit. ``status`` is ``"unreadable"`` (with the ``reason``, and no
    slices) when its stored definition cannot be parsed; it can still be deactivated and
    deleted. ``intensity`` is the persistent dial."""

    id: str
    name: str
    status: str = "ok"
    reason: str | None = None
    active: bool
    rung: int | None
    language: str | None
    intensity: float
    intensity_range: tuple[float, float] | None
    backing_cluster: str | None
    slices: list[CircuitSlice]
    edges: int


class CircuitImported(CircuitInfo, kw_only=True):
    """The imported circuit, and the document's top-level fields it does not use (kept
    in the stored document)."""

    ignored_fields: list[str]


class CircuitList(msgspec.Struct, kw_only=True):
    """``GET /api/circuits``: the imported circuits, sorted by name, then id."""

    object: str = "list"
    data: list[CircuitInfo]


class CircuitDeleted(msgspec.Struct, kw_only=True):
    """``DELETE /api/circuits/{id}``: the id of the circuit deleted."""

    id: str
    deleted: bool


class CircuitSteering(msgspec.Struct, kw_only=True):
    """Whether and how an active circuit steers a request with no steering fields, now.

    ``steers``: it applies as a circuit (such a request's ``X-miLLM-Steering`` names it
    and ``X-miLLM-Circuit-Rung`` is sent); ``mode``: ``full`` or ``slice_fallback``
    (None: unreadable); ``applied_as``: ``circuit``, ``profile`` (the backing cluster) or
    None; ``intensity``: the λ it applies; ``layers``: the layers it steers; ``reason``:
    why it does not steer as a circuit."""

    steers: bool
    mode: str | None
    applied_as: str | None
    intensity: float | None
    composed: bool
    layers: list[int]
    reason: str | None


class ActiveCircuit(msgspec.Struct, kw_only=True):
    """One active circuit in ``ActiveCircuits``: its id, name, rung and the ladder's phrase for it, its persistent dial and
    declared range, and how it steers now (``rung``, ``language`` and ``intensity_range`` are null when it is unreadable)."""

    id: str
    name: str
    rung: int | None
    language: str | None
    intensity: float
    intensity_range: tuple[float, float] | None
    steering: CircuitSteering


class ActiveCircuits(msgspec.Struct, kw_only=True):
    """``GET /api/circuits/active``: the active circuits, each with how it steers, and the
    ``X-miLLM-Steering`` and ``X-miLLM-Circuit-Rung`` values (None: not sent) a request
    with no steering fields would carry now."""

    epoch: int
    active: list[ActiveCircuit]
    steering: str
    rung: str | None


class CircuitActivation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/circuits/{id}/activate``: a circuit below rung 2 needs
    ``acknowledge_unvalidated``; one sharing a layer with an active circuit needs
    ``allow_overlap`` (each may also be a query parameter)."""

    acknowledge_unvalidated: bool = False
    allow_overlap: bool = False


class CircuitDeactivation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/circuits/{id}/deactivate`` takes no fields: nothing, or ``{}`` (a field,
    or a body that is not JSON, is a 400 naming it, as for activate)."""


class CircuitIntensity(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``PUT /api/circuits/active/intensity``: the persistent dial of the active circuit
    (``id`` may be omitted when exactly one is active)."""

    intensity: float
    id: str | None = None


# ------------------------------------------------------------------ helpers


def circuits_of(app: AppContext) -> CircuitState:
    """The app's circuits state, created by the plugin's ``millm_startup``."""
    return app.stash[CIRCUITS]


def state_of(app: AppContext) -> SteeringState:
    """The steering plugin's state: circuits steer through it, so it must be enabled."""
    if STATE not in app.stash:
        raise CircuitConflict("circuits steer through the steering plugin, which this server does not enable", code="steering_disabled")
    return app.stash[STATE]


def _info(row: Row) -> CircuitInfo:
    circuit = row.circuit
    if circuit is None:
        return CircuitInfo(
            id=row.id, name=row.name, status="unreadable", reason=row.problem, active=row.active, rung=None, language=None,
            intensity=row.intensity, intensity_range=None, backing_cluster=None, slices=[], edges=0,
        )  # fmt: skip
    slices = [
        CircuitSlice(layer=s.layer, sae_id=s.sae_id, features=[Feature(index=i, strength=v) for i, v in s.features]) for s in circuit.slices
    ]
    return CircuitInfo(
        id=row.id, name=row.name, active=row.active, rung=circuit.rung, language=language(circuit.rung), intensity=row.intensity,
        intensity_range=circuit.intensity_range, backing_cluster=circuit.backing_cluster, slices=slices, edges=len(circuit.edges),
    )  # fmt: skip


def _row(book: Book, circuit_id: str) -> Row:
    row = book.rows.get(circuit_id)
    if row is None:
        raise CircuitNotFound(f"no circuit with id {circuit_id!r}", param="id")
    return row


def _serving_info(serving: Serving, named: bool, unknown: str | None) -> CircuitSteering:
    steers = serving.steers and named
    reason = serving.reason if serving.reason or steers else f"steering_{unknown}" if unknown else None
    return CircuitSteering(
        steers=steers, mode=serving.mode, applied_as=serving.applied_as if unknown is None else None, intensity=serving.intensity,
        composed=serving.composed and steers, layers=list(serving.served_layers) if unknown is None else [], reason=reason,
    )  # fmt: skip


def active_view(app: AppContext) -> ActiveCircuits:
    """The active circuits and how a plain request runs with them, from the current
    snapshots (the steering plugin's decision, so that the two never disagree)."""
    book, live = circuits_of(app).book, state_of(app).live
    servings = {s.id: s for s in decide(book, live, None, envelope_of(app.settings), dials_of(app))}
    plan = plain_plan(app)
    named = {m.id for m in plan.circuits}
    active = []
    for row in book.active():
        circuit = row.circuit
        active.append(
            ActiveCircuit(
                id=row.id,
                name=row.name,
                rung=circuit.rung if circuit else None,
                language=language(circuit.rung) if circuit else None,
                intensity=row.intensity,
                intensity_range=circuit.intensity_range if circuit else None,
                steering=_serving_info(servings[row.id], row.id in named, plan.unknown),
            )  # fmt: skip
        )
    return ActiveCircuits(epoch=book.epoch, active=active, steering=report(plan, changed=False), rung=plan.headers.get(HEADER))


async def _fresh(request: Request) -> tuple[AppContext, Book]:
    """The app and the current circuits, with other servers' writes picked up (the
    steering state's too, when the steering plugin runs)."""
    app = app_context(request)
    if STATE in app.stash:
        await state_of(app).refresh()
    return app, await circuits_of(app).refresh()


def _flag(request: Request, name: str, sent: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return sent
    try:
        return parse_bool(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be true or false", param=name) from None


# ------------------------------------------------------------------ routes


async def import_circuit(request: Request) -> Response:
    """Compile a circuit-definition document against the registered SAEs and imported
    clusters, and store it (inactive) with the document as sent."""
    raw = await read_json(request, dict[str, Any])
    doc = convert(raw, CircuitDocument)
    app = app_context(request)
    steering = state_of(app)
    live = await steering.refresh()

    def width(sae_id: str, param: str) -> int:
        try:
            return steering.get(sae_id).d_sae
        except MillmError as exc:  # unregistered (404) or unreadable (400): name the document's path
            exc.param = param
            raise

    circuit, intensity = await asyncio.to_thread(compile_document, doc, width, live.profiles, limits_of(app.settings))
    row = Row(
        id="crc_" + secrets.token_hex(6), name=doc.name, document=msgspec.json.encode(raw), body=encode_body(circuit), circuit=circuit,
        problem=None, intensity=intensity, active=False, created=time.time(),
    )  # fmt: skip

    def change(book: Book) -> Book:
        if book.named(doc.name) is not None:
            raise CircuitConflict(f"a circuit named {doc.name!r} exists (delete it first)", code="circuit_exists", param="name")
        return book.with_row(row)

    await circuits_of(app).commit(change)
    imported = CircuitImported(**msgspec.structs.asdict(_info(row)), ignored_fields=ignored_fields(raw))
    return json_response(imported, status=201)


async def list_circuits(request: Request) -> Response:
    _, book = await _fresh(request)
    return json_response(CircuitList(data=[_info(row) for row in sorted(book.rows.values(), key=lambda r: (r.name, r.id))]))


async def get_circuit(request: Request) -> Response:
    _, book = await _fresh(request)
    return json_response(_info(_row(book, request.path_params["circuit_id"])))


async def export_circuit(request: Request) -> Response:
    """The document the circuit was imported from, as it was sent (every field kept)."""
    _, book = await _fresh(request)
    return Response(_row(book, request.path_params["circuit_id"]).document, media_type="application/json")


async def delete_circuit(request: Request) -> Response:
    circuit_id = request.path_params["circuit_id"]

    def change(book: Book) -> Book:
        _row(book, circuit_id)
        return book.without(circuit_id)

    await circuits_of(app_context(request)).commit(change)
    return json_response(CircuitDeleted(id=circuit_id, deleted=True))


def _activation(circuit_id: str, acknowledged: bool, overlap: bool) -> Callable[[Book], Book | None]:
    def change(book: Book) -> Book | None:
        row = _row(book, circuit_id)
        circuit = row.circuit
        if circuit is None:
            raise CircuitConflict(f"circuit {circuit_id!r} cannot be activated: {row.problem}", code="circuit_unreadable", param="id")
        if row.active:
            return None
        if circuit.rung < VALIDATED and not acknowledged:
            raise CircuitConflict(
                f"circuit {circuit_id!r} is at rung {circuit.rung} ({language(circuit.rung)}): below rung {VALIDATED} it is not causally "
                "validated; activate it with acknowledge_unvalidated=true",
                code="circuit_unvalidated",
                param="acknowledge_unvalidated",
            )
        for other in book.active():
            if other.circuit is None:
                continue
            same = sorted(circuit.features() & other.circuit.features())
            if same:
                layer, index = same[0]
                raise CircuitConflict(
                    f"feature {index} at layer {layer} is also in the active circuit {other.id!r}; two circuits never share a feature",
                    code="circuit_feature_conflict",
                    param="id",
                )
            shared = sorted(set(circuit.layers) & set(other.circuit.layers))
            if shared and not overlap:
                raise CircuitConflict(
                    f"the active circuit {other.id!r} also steers layer(s) {shared}; activate with allow_overlap=true to compose them",
                    code="circuit_overlap",
                    param="allow_overlap",
                )
        return book.with_row(replace(row, active=True))

    return change


async def activate_circuit(request: Request) -> Response:
    body = await read_json(request, CircuitActivation)
    acknowledged = _flag(request, "acknowledge_unvalidated", body.acknowledge_unvalidated)
    overlap = _flag(request, "allow_overlap", body.allow_overlap)
    app = app_context(request)
    await state_of(app).refresh()
    await circuits_of(app).commit(_activation(request.path_params["circuit_id"], acknowledged, overlap))
    return json_response(active_view(app))


async def deactivate_circuit(request: Request) -> Response:
    await read_json(request, CircuitDeactivation)
    circuit_id = request.path_params["circuit_id"]

    def change(book: Book) -> Book | None:
        row = _row(book, circuit_id)
        return book.with_row(replace(row, active=False)) if row.active else None

    app = app_context(request)
    await state_of(app).refresh()  # 409 steering_disabled before anything is written
    await circuits_of(app).commit(change)
    return json_response(active_view(app))


async def active_circuits(request: Request) -> Response:
    app, _ = await _fresh(request)
    return json_response(active_view(app))  # 409 steering_disabled without the steering plugin


async def set_intensity(request: Request) -> Response:
    """Set the persistent dial of an active circuit: exactly 0, or a number within its
    declared range ∩ the configured envelope."""
    body = await read_json(request, CircuitIntensity)
    app = app_context(request)
    state_of(app)  # 409 steering_disabled before anything is written (the answer needs it)
    envelope = envelope_of(app.settings)

    def change(book: Book) -> Book:
        if body.id is None:
            active = book.active()
            if len(active) != 1:
                raise CircuitConflict(
                    f"{len(active)} circuits are active" + (f" {[r.id for r in active]}: name one with id" if active else ""),
                    code="circuit_not_active",
                    param="id",
                )
            row = active[0]
        else:
            row = _row(book, body.id)
            if not row.active:
                raise CircuitConflict(f"circuit {body.id!r} is not active", code="circuit_not_active", param="id")
        if row.circuit is None:
            raise CircuitConflict(f"circuit {row.id!r} is unreadable: {row.problem}", code="circuit_unreadable", param="id")
        low, high = clamped_bounds(row.circuit.intensity_range, envelope.floor, envelope.ceiling)
        value = body.intensity
        if isinstance(value, bool) or not (value == 0.0 or low <= value <= high):
            raise InvalidRequest(f"intensity must be 0 or a number in [{low}, {high}] for circuit {row.id!r}", param="intensity")
        return book.with_row(replace(row, intensity=float(value)))

    await circuits_of(app).commit(change)
    return json_response(active_view(app))


Route = tuple[str, Any, list[str], RouteDoc]
WRITE = ("400", "404", "409", "503")
# Fixed paths before the {circuit_id} ones (ids are crc_…, so none is "active" or "import").
ROUTES: tuple[Route, ...] = (
    (
        "/api/circuits/import",
        import_circuit,
        ["POST"],
        RouteDoc("Import a circuit-definition document", CircuitDocument, CircuitImported, 201, ("400", "404", "409", "503")),
    ),
    ("/api/circuits", list_circuits, ["GET"], RouteDoc("Imported circuits", response=CircuitList, errors=())),
    (
        "/api/circuits/active",
        active_circuits,
        ["GET"],
        RouteDoc("The active circuits and how they steer", response=ActiveCircuits, errors=("409",)),
    ),
    (
        "/api/circuits/active/intensity",
        set_intensity,
        ["PUT"],
        RouteDoc("Set the active circuit's persistent dial", CircuitIntensity, ActiveCircuits, errors=WRITE),
    ),
    ("/api/circuits/{circuit_id}", get_circuit, ["GET"], RouteDoc("One circuit", response=CircuitInfo, errors=("404",))),
    (
        "/api/circuits/{circuit_id}",
        delete_circuit,
        ["DELETE"],
        RouteDoc("Delete a circuit", response=CircuitDeleted, errors=("404", "503")),
    ),
    (
        "/api/circuits/{circuit_id}/export",
        export_circuit,
        ["GET"],
        RouteDoc("The document the circuit was imported from", response=CircuitDocument, errors=("404",)),
    ),
    (
        "/api/circuits/{circuit_id}/activate",
        activate_circuit,
        ["POST"],
        RouteDoc("Activate a circuit for every request", CircuitActivation, ActiveCircuits, errors=WRITE),
    ),
    (
        "/api/circuits/{circuit_id}/deactivate",
        deactivate_circuit,
        ["POST"],
        RouteDoc("Deactivate a circuit", response=ActiveCircuits, errors=WRITE),
    ),
)
