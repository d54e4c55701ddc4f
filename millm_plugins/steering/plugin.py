"""SAE steering: the management API (register, list, delete, attach, detach SAEs) and
inline ``steering`` on chat and text completions, reported in ``X-miLLM-Steering``.

Registrations persist in the server's database; attachments are the running server's
state. ``profile`` and ``steering_intensity`` stay refused with ``field_not_honoured`` until
profiles exist. Steering is per request: the request's rows carry their own delta, and no
global state is written for a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from millm_core.codec import convert, decode_json, encode
from millm_core.context import RequestContext, StashKey
from millm_core.engine import Capability
from millm_core.errors import InvalidRequest, ModelNotLoaded
from millm_core.fields import ALL_ENDPOINTS, FieldRule
from millm_core.hookspecs import hookimpl
from millm_core.pipeline_types import Finalization, ForwardPlan, Outcome, Problem
from millm_core.server.routes.common import app_state, read_body

from .inline import Resolved, conflicts, parse, report, resolve
from .registry import SteeringState
from .sae import SAE

NAME = "steering"
HEADER = "X-miLLM-Steering"
STREAM_KEY = "millm_steering"
APPLIED = StashKey[Resolved | None]("steering.applied")

STATE_KEY = "steering"


class RegisterSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/saes``: a SAELens directory or a Gemma Scope ``params.npz``."""

    path: str
    id: str | None = None


class AttachSAE(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/saes/{id}/attach`` and ``…/detach`` (detach without a layer: all)."""

    layer: int | None = None


class SAEInfo(msgspec.Struct, kw_only=True):
    """An SAE as the API reports it."""

    id: str
    path: str
    architecture: str
    d_in: int
    d_sae: int
    attached_layers: list[int]


def _state(request: Request) -> SteeringState:
    return state_of(app_state(request))


def state_of(app: Any) -> SteeringState:
    state = app.extra.get(STATE_KEY)
    if state is None:
        state = app.extra[STATE_KEY] = SteeringState(store=app.store)
    assert isinstance(state, SteeringState)
    return state


def _info(state: SteeringState, sae_id: str, path: str, sae: SAE) -> SAEInfo:
    return SAEInfo(id=sae_id, path=path, architecture=sae.architecture, d_in=sae.d_in, d_sae=sae.d_sae, attached_layers=state.layers_of(sae_id))


async def _body(request: Request, type_: type[Any]) -> Any:
    raw = await read_body(request, app_state(request).settings.max_body_bytes)
    return convert(decode_json(raw or b"{}"), type_)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type="application/json")


async def register_sae(request: Request) -> Response:
    body = await _body(request, RegisterSAE)
    state = _state(request)
    sae_id, sae = state.register(body.path, body.id)
    return _json(_info(state, sae_id, body.path, sae), status=201)


async def list_saes(request: Request) -> Response:
    state = _state(request)
    return _json({"object": "list", "data": [_info(state, i, p, state.get(i)) for i, p in state.registered()]})


async def get_sae(request: Request) -> Response:
    state = _state(request)
    sae_id = request.path_params["sae_id"]
    sae = state.get(sae_id)
    return _json(_info(state, sae_id, sae.path, sae))


async def delete_sae(request: Request) -> Response:
    state = _state(request)
    state.delete(request.path_params["sae_id"])
    return _json({"id": request.path_params["sae_id"], "deleted": True})


async def attach_sae(request: Request) -> Response:
    body = await _body(request, AttachSAE)
    state, app = _state(request), app_state(request)
    model = next(iter(app.models), None)
    if model is None:
        raise ModelNotLoaded("an SAE attaches to the resident model, and none is loaded yet")
    if body.layer is None:
        raise InvalidRequest("attach needs a layer", param="layer")
    sae_id = request.path_params["sae_id"]
    state.attach(sae_id, body.layer, model.info.d_model, model.info.n_layers)
    sae = state.get(sae_id)
    return _json(_info(state, sae_id, sae.path, sae))


async def detach_sae(request: Request) -> Response:
    body = await _body(request, AttachSAE)
    state = _state(request)
    sae_id = request.path_params["sae_id"]
    removed = state.detach(sae_id, body.layer)
    sae = state.get(sae_id)
    return _json({**msgspec.to_builtins(_info(state, sae_id, sae.path, sae)), "detached": removed})


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    register("/api/saes", register_sae, ["POST"])
    register("/api/saes", list_saes, ["GET"])
    register("/api/saes/{sae_id}", get_sae, ["GET"])
    register("/api/saes/{sae_id}", delete_sae, ["DELETE"])
    register("/api/saes/{sae_id}/attach", attach_sae, ["POST"])
    register("/api/saes/{sae_id}/detach", detach_sae, ["POST"])


# ------------------------------------------------------------------ inline steering


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    register(FieldRule("steering", ALL_ENDPOINTS, by=NAME, requires=Capability.STEERING))


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    raw = request.steering
    if raw is None or raw is msgspec.UNSET:
        return []
    _, problems = parse(raw)
    return problems + conflicts(request)


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    raw = request.steering
    resolved = None
    if raw is not None and raw is not msgspec.UNSET:
        steering, _ = parse(raw)
        assert steering is not None  # validated
        state = state_of(ctx.services)
        saes = {sae_id: state.get(sae_id) for sae_id, _ in state.attachments}
        resolved = resolve(steering, state.attachments, saes)
        if resolved is not None:
            direction = saes[resolved.sae_id].direction(resolved.applied.features)
            plan.deltas[resolved.layer] = tuple(float(v) for v in direction)
    ctx.stash[APPLIED] = resolved


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    value = report(ctx.stash.get(APPLIED, None))
    if ctx.stream:
        out.extensions[STREAM_KEY] = value
    else:
        out.headers[HEADER] = value
