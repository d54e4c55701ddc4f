"""Generation and its sampling fields: temperature, top_p, top_k, seed, stop, penalties,
``n``, ``max_tokens`` and streaming. Without this plugin a server does not generate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from millm_core.api import (
    GENERATION_ENDPOINTS,
    Capability,
    Execution,
    FieldRule,
    Finalization,
    ForwardPlan,
    Generate,
    Outcome,
    RequestContext,
    RequestField,
    RowInfo,
    ServedModel,
    hookimpl,
)

from .processors import Penalties, StopSequences

NAME = "sampling"
# top_k 0 selects the 20-candidate cap (the Ignis convention); absent means no top-k filter.
TOP_K_ZERO_MEANS = 20
SEED_HEADER = "X-miLLM-Seed"

TopK = Annotated[int, Meta(ge=0, le=20, description="0 caps sampling at 20 candidates")]
TOP_K: RequestField[int] = RequestField(
    "top_k", TopK, GENERATION_ENDPOINTS, owner=NAME, description="keep the k likeliest tokens before sampling (0: the 20-candidate cap)"
)


def _set(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(TOP_K)


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    for name in ("temperature", "top_p", "stop", "frequency_penalty", "presence_penalty"):
        register(FieldRule(name, GENERATION_ENDPOINTS, by=NAME))
    for name in ("stream", "stream_options", "max_tokens", "max_completion_tokens"):
        register(FieldRule(name, GENERATION_ENDPOINTS, by=NAME, requires=Capability.GENERATE))
    register(FieldRule("seed", GENERATION_ENDPOINTS, by=NAME, requires=Capability.SEED))
    register(FieldRule("n", GENERATION_ENDPOINTS, by=NAME, requires=Capability.MULTIPLE_CHOICES, condition="not streaming"))


@hookimpl(trylast=True)
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
    """Generation serves every chat or text completion no other plugin took."""
    if ctx.endpoint == "embeddings" or Capability.GENERATE not in model.capabilities:
        return None
    return Generate()


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
    top_k = TOP_K.get(request)
    if top_k is not None:
        changes["top_k"] = int(top_k) or TOP_K_ZERO_MEANS
    if _set(request.seed):
        changes["seed"] = int(request.seed)
        ctx.set_header(SEED_HEADER, seed_header(int(request.seed)))
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


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    """A scored request's seed changes nothing it returns, but the promise is stated the
    same way as for generation (pre-forward already set it there)."""
    if outcome.kind == "scoring" and ctx.endpoint != "embeddings" and _set(request.seed):
        out.headers[SEED_HEADER] = seed_header(int(request.seed))
