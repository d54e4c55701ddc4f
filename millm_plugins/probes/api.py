"""The probes management API: import, list, get, export, delete, arm and disarm
(``/api/probes``). Errors take the ``/v1`` error shape; a gate's refusal is a 409 naming
the gate (:mod:`.gates`). SQLite and model work run off the event loop."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import InvalidRequest, RouteDoc, app_context, json_response, read_json, until_disconnect

from .book import Arming, Stored
from .document import WINDOWS, ModelIdentity, ProbeDocument, Window, check
from .gates import run_gates
from .settings import MAX_ARMED, PARITY_TOLERANCE
from .state import ProbesState, state_of


class ProbeInfo(msgspec.Struct, kw_only=True):
    """A probe as the API lists it; ``armed`` is null while it is not armed."""

    id: str
    name: str
    description: str
    layer: int
    read_point: str
    basis: str
    sae_id: str | None
    aggregation: str
    threshold: float
    window_thresholds: dict[str, float]
    evidence_rung: int
    model: ModelIdentity
    test_vectors: int
    detector_digest: str
    decision_digest: str
    created: float
    armed: Arming | None


class ProbeList(msgspec.Struct, kw_only=True):
    """``GET /api/probes``: the probes, sorted by name, then id (``?armed=true`` or ``false``: only those armed, or not)."""

    object: str = "list"
    data: list[ProbeInfo]


class ProbeDeleted(msgspec.Struct, kw_only=True):
    """``DELETE /api/probes/{id}``: the id of the probe deleted (disarmed as well)."""

    id: str
    deleted: bool


class ArmRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/probes/{id}/arm``: the windows to report (default ``["all"]``), and the
    acknowledgement a probe below evidence rung 2 needs."""

    windows: list[Window] | None = None
    acknowledge_below_rung2: bool = False


def info(state: ProbesState, stored: Stored) -> ProbeInfo:
    doc, det = stored.doc, stored.detector
    return ProbeInfo(
        id=det.probe_id, name=doc.name, description=doc.description, layer=doc.layer, read_point=doc.read_point,
        basis=doc.basis.kind, sae_id=doc.basis.sae_id, aggregation=doc.aggregation, threshold=doc.decision.threshold,
        window_thresholds={str(k): v for k, v in doc.decision.windows.items()}, evidence_rung=doc.evidence.rung, model=doc.model,
        test_vectors=len(doc.test_vectors), detector_digest=det.detector_digest, decision_digest=det.decision_digest,
        created=stored.created, armed=state.book.arms.get(det.probe_id),
    )  # fmt: skip


def _state(request: Request) -> ProbesState:
    return state_of(app_context(request))


async def import_probe(request: Request) -> Response:
    doc = check(await read_json(request, ProbeDocument))
    state = _state(request)
    stored = await state.book.add(doc)
    return json_response(info(state, stored), status=201)


def _flag(request: Request, name: str) -> bool | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if raw.lower() in ("true", "1"):
        return True
    if raw.lower() in ("false", "0"):
        return False
    raise InvalidRequest(f"{name} must be true or false", param=name)


async def list_probes(request: Request) -> Response:
    state = _state(request)
    armed = _flag(request, "armed")
    probes = sorted(state.book.probes.values(), key=lambda s: (s.doc.name, s.detector.probe_id))
    listed = [info(state, s) for s in probes if armed is None or (s.detector.probe_id in state.book.arms) == armed]
    return json_response(ProbeList(data=listed))


async def get_probe(request: Request) -> Response:
    state = _state(request)
    return json_response(info(state, state.book.get(request.path_params["probe_id"])))


async def export_probe(request: Request) -> Response:
    """The document as imported (with its id), ready to import elsewhere."""
    return json_response(_state(request).book.get(request.path_params["probe_id"]).doc)


async def delete_probe(request: Request) -> Response:
    probe_id = request.path_params["probe_id"]
    await _state(request).book.delete(probe_id)
    return json_response(ProbeDeleted(id=probe_id, deleted=True))


async def arm_probe(request: Request) -> Response:
    body = await read_json(request, ArmRequest)
    windows = list(body.windows) if body.windows is not None else ["all"]
    if not windows:
        raise InvalidRequest("windows must name at least one of " + ", ".join(WINDOWS), param="windows")
    for index, window in enumerate(windows):
        if window in windows[:index]:
            raise InvalidRequest(f"window {window!r} is listed twice", param=f"windows[{index}]")
    return await until_disconnect(request, _arm(request, windows, body.acknowledge_below_rung2))


async def _arm(request: Request, windows: list[Any], acknowledged: bool) -> Response:
    app = app_context(request)
    state = state_of(app)
    probe_id = request.path_params["probe_id"]
    await state.book.refresh()  # another server's import counts (it may be under 100 ms old)
    state.book.get(probe_id)  # 404 at once; the gates read the document again under the lock
    limit, tolerance = int(MAX_ARMED.get(app.settings)), float(PARITY_TOLERANCE.get(app.settings))

    async def gates(stored: Stored) -> Arming:
        return await run_gates(app, stored, set(state.book.arms), windows, acknowledged, limit, tolerance)

    await state.book.arm(probe_id, gates)
    return json_response(info(state, state.book.get(probe_id)))


async def disarm_probe(request: Request) -> Response:
    state = _state(request)
    probe_id = request.path_params["probe_id"]
    await state.book.disarm(probe_id)
    return json_response(info(state, state.book.get(probe_id)))


Route = tuple[str, Any, list[str], RouteDoc]
PROBE = "/api/probes/{probe_id}"
ROUTES: tuple[Route, ...] = (
    (
        "/api/probes/import",
        import_probe,
        ["POST"],
        RouteDoc("Import a probe document (mi.probe/v1)", ProbeDocument, ProbeInfo, 201, ("400", "409", "503")),
    ),
    ("/api/probes", list_probes, ["GET"], RouteDoc("The probes (?armed=true: the armed ones)", response=ProbeList, errors=("400",))),
    (PROBE, get_probe, ["GET"], RouteDoc("One probe", response=ProbeInfo, errors=("404",))),
    (PROBE, delete_probe, ["DELETE"], RouteDoc("Delete a probe (disarming it)", response=ProbeDeleted, errors=("404", "503"))),
    (f"{PROBE}/export", export_probe, ["GET"], RouteDoc("The probe's document, as imported", response=ProbeDocument, errors=("404",))),
    (
        f"{PROBE}/arm",
        arm_probe,
        ["POST"],
        RouteDoc(
            "Arm a probe: gates limit, model_identity, evidence, basis, parity (409 naming the gate)",
            ArmRequest,
            ProbeInfo,
            errors=("400", "404", "409", "503"),
        ),
    ),  # fmt: skip
    (f"{PROBE}/disarm", disarm_probe, ["POST"], RouteDoc("Disarm a probe", response=ProbeInfo, errors=("404", "503"))),
)
