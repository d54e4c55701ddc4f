"""Scheduling lanes. A generation request is ``interactive`` (the default) or ``agent``:
``"class": "agent"`` in the body, or the model named with an ``@agent`` suffix
(``"model": "SmolLM2-135M-Instruct@agent"``). The scheduler serves waiting interactive
work first — at admission and when rows join a running batch — and an agent request is
never starved: once interactive work has gone ahead of it ``Scheduler.lane_passes`` (8)
times, it is served in its arrival place. Agent rows that are already running keep
running; a lane orders admission only, it never pre-empts.

The response says which lane served it (``X-miLLM-Lane``) and so does the access log
(``lane``). An unknown class is a 400 naming ``class``; a suffix and a class that differ
are a 400 too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from millm_core.api import (
    GENERATION_ENDPOINTS,
    ForwardPlan,
    InvalidRequest,
    ModelRegistry,
    Problem,
    RequestContext,
    RequestField,
    ServedModel,
    StashKey,
    hookimpl,
)

NAME = "lanes"
HEADER = "X-miLLM-Lane"
LANES = ("interactive", "agent")
SUFFIXES = {f"@{lane}": lane for lane in LANES}
SUFFIXED = StashKey[str]("lanes.suffix")

CLASS: RequestField[str] = RequestField(
    "class", Literal["interactive", "agent"], GENERATION_ENDPOINTS, owner=NAME, neutral=lambda value: value == "interactive",
    description='the scheduling lane: "interactive" (default) or "agent" (served after interactive work, never starved)',
)  # fmt: skip


def _split(model: str) -> tuple[str, str | None]:
    for suffix, lane in SUFFIXES.items():
        if model.endswith(suffix) and len(model) > len(suffix):
            return model[: -len(suffix)], lane
    return model, None


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(CLASS)


@hookimpl(tryfirst=True)
def millm_resolve(ctx: RequestContext, request: Any, models: ModelRegistry) -> ServedModel | None:
    """``<model>@agent`` (or ``@interactive``) names ``<model>`` in that lane. A served
    model whose own name ends so is served by that name as usual."""
    name = getattr(request, "model", None)
    if ctx.endpoint == "embeddings" or not isinstance(name, str) or models.get(name) is not None:
        return None
    base, lane = _split(name)
    if lane is None:
        return None
    model = models.get(base)
    if model is not None:
        ctx.stash[SUFFIXED] = lane
    return model


@hookimpl
def millm_requested_model(ctx: RequestContext, request: Any) -> str | None:
    """``<model>@agent`` asks for ``<model>`` (loaded for it when it is not loaded)."""
    name = getattr(request, "model", None)
    if ctx.endpoint == "embeddings" or not isinstance(name, str):
        return None
    base, lane = _split(name)
    return base if lane is not None else None


def _lane(ctx: RequestContext, request: Any) -> str:
    asked = CLASS.get(request)
    suffixed = ctx.stash[SUFFIXED] if SUFFIXED in ctx.stash else None
    return asked or suffixed or "interactive"


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    if ctx.endpoint == "embeddings":
        return []
    asked = CLASS.get(request)
    suffixed = ctx.stash[SUFFIXED] if SUFFIXED in ctx.stash else None
    if asked is not None and suffixed is not None and asked != suffixed:
        return [Problem(f'"class": "{asked}" and the model\'s @{suffixed} suffix name different lanes; send one', param="class")]
    return []


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    lane = _lane(ctx, request)
    if lane not in LANES:  # the field's type admits no other value; a suffix only these
        raise InvalidRequest(f"unknown lane {lane!r}", param="class")
    plan.lane = lane
    ctx.set_header(HEADER, lane)
    ctx.access_log["lane"] = lane
