"""SAE steering: the management API (SAEs, manual values, profiles, clusters) and the
request fields ``steering``, ``profile`` and ``steering_intensity`` on chat and text
completions, reported in ``X-miLLM-Steering`` (and ``X-miLLM-Steering-Intensity``).

Steering is per request: pre-forward decides the request's steering once (:mod:`.apply`)
and its rows carry their own delta; no global state is written for a request. Scoring and
embeddings never reach pre-forward, so they are never steered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from millm_core.commands import Command
from millm_core.config import PluginSetting
from millm_core.context import RequestContext, StashKey
from millm_core.engine import Capability
from millm_core.fields import ALL_ENDPOINTS, FieldRule
from millm_core.hookspecs import hookimpl
from millm_core.pipeline_types import Finalization, ForwardPlan, Outcome, Problem

from . import api, api_profiles
from .api import CEILING, FLOOR, dials_of, state_of
from .apply import Plan, deltas, plan_for, report
from .inline import conflicts, parse
from .intensity import parse as parse_intensity
from .train import COMMAND

NAME = "steering"
HEADER = "X-miLLM-Steering"
INTENSITY_HEADER = "X-miLLM-Steering-Intensity"
STREAM_KEY = "millm_steering"
PLAN = StashKey[Plan]("steering.plan")


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 2.0:
        raise ValueError("must be in [0, 2]")
    return number


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting], None]) -> None:
    register(PluginSetting(FLOOR, 0.5, 'the dial\'s "min" for clusters and profiles that declare no intensity_range', _fraction))
    register(PluginSetting(CEILING, 2.0, 'the dial\'s "max" (and cap) for clusters and profiles that declare no intensity_range', _fraction))


@hookimpl
def millm_register_commands(register: Callable[[Command], None]) -> None:
    register(COMMAND)


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    for path, handler, methods, doc in (*api.ROUTES, *api_profiles.ROUTES):
        register(path, handler, methods, doc=doc)


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    for name in ("steering", "profile", "steering_intensity"):
        register(FieldRule(name, ALL_ENDPOINTS, by=NAME, requires=Capability.STEERING))


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    problems: list[Problem] = []
    if _sent(request.steering):
        problems += parse(request.steering)[1] + conflicts(request)
    if _sent(request.steering_intensity):
        problems += parse_intensity(request.steering_intensity)[1]
    return problems


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    state = state_of(ctx.services)
    steering = plan_for(request, state, state.book, dials_of(ctx.services))
    for layer, vector in deltas(steering, state).items():
        plan.deltas[layer] = vector
    if steering.echo is not None:
        ctx.set_header(INTENSITY_HEADER, repr(float(steering.echo)))
    ctx.stash[PLAN] = steering


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    steering = ctx.stash.get(PLAN, Plan(unknown="read_failed"))
    value = report(steering, changed=state_of(ctx.services).epoch != steering.epoch)
    if ctx.stream:
        out.extensions[STREAM_KEY] = value
    else:
        out.headers[HEADER] = value
