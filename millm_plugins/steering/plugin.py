"""SAE steering: the management API (SAEs, manual values, profiles, clusters) and the
request fields ``steering``, ``profile`` and ``steering_intensity`` on chat and text
completions, reported in ``X-miLLM-Steering`` (and ``X-miLLM-Steering-Intensity``).

Steering is per request: pre-forward decides the request's steering once (:mod:`.apply`)
and its rows carry their own delta; no global state is written for a request. Scoring and
embeddings never reach pre-forward, so they are never steered (finalize says ``none`` for a
scored request). The plugin's state and tables are created at start-up (``millm_startup``).

Other plugins' global steering (the circuits plugin) joins each request's decision through
the public extension point in :mod:`.contrib`: the steering plugin alone writes the deltas
and ``X-miLLM-Steering``, and sets the headers a contribution brings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from msgspec import Meta
from prometheus_client import Counter

from millm_core.api import (
    GENERATION_ENDPOINTS,
    AppContext,
    Capability,
    Command,
    ConfigError,
    Finalization,
    ForwardPlan,
    Outcome,
    PluginSetting,
    Problem,
    RequestContext,
    RequestField,
    ServedModel,
    StashKey,
    SwitchTarget,
    hookimpl,
)

from . import api, api_profiles
from .api import CEILING, FLOOR, SAE_ROOTS, STATE, dials_of, state_of
from .apply import Plan, deltas, plan_for, report
from .contrib import contributors
from .inline import InlineSteering, check, conflicts
from .intensity import parse as parse_intensity
from .registry import SteeringState
from .train import COMMAND

NAME = "steering"
HEADER = "X-miLLM-Steering"
INTENSITY_HEADER = "X-miLLM-Steering-Intensity"
STREAM_KEY = "millm_steering"
PLAN = StashKey[Plan]("steering.plan")
USAGE = StashKey[Counter]("steering.usage")

ProfileName = Annotated[str, Meta(min_length=1)]
STEERING: RequestField[InlineSteering] = RequestField(
    "steering", InlineSteering, GENERATION_ENDPOINTS, owner=NAME, requires=Capability.STEERING,
    description="this request's own SAE feature set; features: [] runs unsteered",
)  # fmt: skip
PROFILE: RequestField[str] = RequestField(
    "profile", ProfileName, GENERATION_ENDPOINTS, owner=NAME, requires=Capability.STEERING,
    description="a saved profile (or imported cluster) to steer with instead of the live state",
)  # fmt: skip
INTENSITY: RequestField[float | str] = RequestField(
    "steering_intensity", float | str, GENERATION_ENDPOINTS, owner=NAME, requires=Capability.STEERING,
    description='the intensity dial λ: a number in [0, 2], or "off", "min", "max"',
)  # fmt: skip


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(FLOOR)
    register(CEILING)
    register(SAE_ROOTS)


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    for field in (STEERING, PROFILE, INTENSITY):
        register(field)


@hookimpl
def millm_startup(app: AppContext) -> None:
    """Migrate the plugin's tables and restore the persisted state (attachments, manual
    values, the active profile, the epoch, the profiles) before the server is ready, then
    keep watching the database for other servers' writes. The attached SAEs are loaded
    now; one that cannot be read is kept and reported as unusable. Settings that cannot
    work together stop start-up."""
    floor, ceiling = float(FLOOR.get(app.settings)), float(CEILING.get(app.settings))
    if floor > ceiling:
        raise ConfigError(f"--cluster-intensity-min {floor:g} is above --cluster-intensity-max {ceiling:g}")
    state = app.stash[STATE] = SteeringState(store=app.store)
    state.start_watching()
    app.stash[USAGE] = Counter(
        "millm_steered_requests", "Generation requests by the kind of steering they ran with (none, inline, profile, manual, circuit, unknown)",
        ["kind"], registry=app.metrics,
    )  # fmt: skip


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    """Stop watching the database for other servers' writes."""
    if STATE in app.stash:
        state_of(app).stop_watching()


@hookimpl
def millm_model_loaded(app: AppContext, model: ServedModel) -> None:
    """Check the restored attachments against the resident model (the first one served):
    one it cannot take is kept, reported as unusable and never applied."""
    if next(iter(app.models), model) is model:
        state_of(app).check_model(model)


@hookimpl
def millm_model_unloaded(app: AppContext, model: ServedModel) -> None:
    """The model the attachments were checked against left: check them against the model
    served now, if any (with none, nothing is marked unusable for a model)."""
    state = state_of(app)
    if state.model is model:
        state.check_model(next(iter(app.models), None))


@hookimpl
def millm_register_commands(register: Callable[[Command], None]) -> None:
    register(COMMAND)


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    for path, handler, methods, doc in (*api.ROUTES, *api_profiles.ROUTES):
        register(path, handler, methods, doc=doc)


@hookimpl
def millm_validate_switch(ctx: RequestContext, request: Any, target: SwitchTarget) -> list[Problem]:
    """An SAE attaches to the resident model only: steering (a non-empty feature set, or a
    profile) for a model that is not loaded is refused before the switch would load it."""
    if ctx.endpoint == "embeddings":
        return []
    steering = STEERING.get(request)
    profile = PROFILE.get(request)
    asked = "steering" if steering is not None and steering.features else "profile" if profile is not None else None
    if asked is None:
        return []
    return [
        Problem(
            f"{asked} needs an SAE attached to '{target.name}', which is not loaded: an SAE attaches to the resident model "
            f"only. Load it first (POST /api/models/{target.name}/load), attach the SAE, then steer; nothing was unloaded",
            param=asked,
            code="sae_not_attached",
        )
    ]


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    problems: list[Problem] = []
    if ctx.endpoint == "embeddings":
        return problems
    steering = STEERING.get(request)
    if steering is not None:
        problems += check(steering) + conflicts(request)
    intensity = INTENSITY.get(request)
    if intensity is not None:
        problems += parse_intensity(intensity)[1]
    return problems


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    live = state_of(ctx.app).live  # one snapshot, in memory: no database read per request
    steering = plan_for(request, live, dials_of(ctx.app), contributors(ctx.app))
    for layer, vector in deltas(steering, live).items():
        plan.deltas[layer] = vector
    if steering.echo is not None:
        ctx.set_header(INTENSITY_HEADER, repr(float(steering.echo)))
    for name, value in steering.headers.items():  # a contribution's own (X-miLLM-Circuit-Rung)
        ctx.set_header(name, value)
    ctx.stash[PLAN] = steering


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    if outcome.kind == "embeddings":
        return  # embeddings are never steered, and say nothing about it
    if outcome.kind == "scoring":
        out.headers[HEADER] = "none"  # a scoring pass carries no steering delta
        return
    steering = ctx.stash.get(PLAN, Plan(unknown="read_failed"))
    value = report(steering, changed=steering.moved(state_of(ctx.app).epoch))
    kinds = (
        {"unknown"}
        if steering.unknown
        else ({entry.kind for entry in steering.entries} | ({"circuit"} if steering.circuits else set()) or {"none"})
    )
    for kind in sorted(kinds):
        ctx.app.stash[USAGE].labels(kind).inc()
    if ctx.stream:
        out.extend(STREAM_KEY, value, order=90)  # the steering report closes every stream
    else:
        out.headers[HEADER] = value
