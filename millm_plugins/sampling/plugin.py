"""Generation and its sampling fields: temperature, top_p, top_k, seed, stop, penalties,
``n``, ``max_tokens`` and streaming. Without this plugin a server does not generate."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import Response

from millm_core.context import RequestContext
from millm_core.engine import Capability
from millm_core.fields import ALL_ENDPOINTS, FieldRule
from millm_core.hookspecs import hookimpl
from millm_core.pipeline_types import ForwardPlan, RowInfo
from millm_core.registry import ServedModel
from millm_core.server.routes.chat import SHAPES as CHAT_SHAPES
from millm_core.server.routes.common import generate
from millm_core.server.routes.completions import SHAPES as COMPLETION_SHAPES

from .processors import Penalties, StopSequences

NAME = "sampling"
# top_k 0 selects the 20-candidate cap (the Ignis convention); absent means no top-k filter.
TOP_K_ZERO_MEANS = 20


def _set(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    for name in ("temperature", "top_p", "top_k", "stop", "frequency_penalty", "presence_penalty"):
        register(FieldRule(name, ALL_ENDPOINTS, by=NAME))
    for name in ("stream", "stream_options", "max_tokens", "max_completion_tokens"):
        register(FieldRule(name, ALL_ENDPOINTS, by=NAME, requires=Capability.GENERATE))
    register(FieldRule("seed", ALL_ENDPOINTS, by=NAME, requires=Capability.SEED))
    register(FieldRule("n", ALL_ENDPOINTS, by=NAME, requires=Capability.MULTIPLE_CHOICES, condition="not streaming"))


@hookimpl(trylast=True)
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel, state: Any) -> Awaitable[Response] | None:
    """Generation serves every request no other plugin took."""
    if Capability.GENERATE not in model.capabilities:
        return None
    shapes = CHAT_SHAPES if ctx.endpoint == "chat.completions" else COMPLETION_SHAPES
    return generate(state, ctx, request, model, shapes)


def seed_header(seed: int) -> str:
    """``X-miLLM-Seed`` value: the seed and the scope of the reproducibility promise."""
    return f'{seed};scope="request"'


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    changes: dict[str, Any] = {}
    if _set(request.temperature):
        changes["temperature"] = float(request.temperature)
    if _set(request.top_p):
        changes["top_p"] = float(request.top_p)
    if _set(request.top_k):
        changes["top_k"] = int(request.top_k) or TOP_K_ZERO_MEANS
    if _set(request.seed):
        changes["seed"] = int(request.seed)
        ctx.set_header("X-miLLM-Seed", seed_header(int(request.seed)))
    if changes:
        plan.sampling = msgspec.structs.replace(plan.sampling, **changes)

    if _set(request.stop):
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if stops:
            frozen = tuple(stops)

            def _stops(_row: RowInfo) -> StopSequences:
                return StopSequences(frozen)

            plan.add_processor(_stops)
    frequency = float(request.frequency_penalty) if _set(request.frequency_penalty) else 0.0
    presence = float(request.presence_penalty) if _set(request.presence_penalty) else 0.0
    if frequency or presence:
        def _penalties(_row: RowInfo) -> Penalties:
            return Penalties(frequency, presence)

        plan.add_processor(_penalties)
