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
    ChatRender,
    Execution,
    FieldRule,
    ForwardPlan,
    Generate,
    PluginSetting,
    Problem,
    RequestContext,
    RequestField,
    RowInfo,
    ServedModel,
    batch_invariant,
    hookimpl,
)

from .defaults import NO_THINKING, THINKING, defaults, mode_of
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
    for name in ("stream", "max_tokens", "max_completion_tokens"):
        register(FieldRule(name, GENERATION_ENDPOINTS, by=NAME, requires=Capability.GENERATE))
    register(FieldRule("stream_options", GENERATION_ENDPOINTS, by=NAME, requires=Capability.GENERATE, condition="with stream: true"))
    register(FieldRule("seed", GENERATION_ENDPOINTS, by=NAME, requires=Capability.SEED))
    register(FieldRule("n", GENERATION_ENDPOINTS, by=NAME, requires=Capability.MULTIPLE_CHOICES, condition="not streaming"))


@hookimpl(trylast=True)
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
    """Generation serves every chat or text completion no other plugin took."""
    if ctx.endpoint == "embeddings" or Capability.GENERATE not in model.capabilities:
        return None
    return Generate()


def seed_header(seed: int, request: Any = None, invariant: bool = True) -> str:
    """``X-miLLM-Seed`` value: the seed and the scope of the reproducibility promise. A
    chat with ``extra_messages`` promises ``batch-shape``: a conversation's sampled rows
    draw on their place in the request (its choice index), so the same conversation sent
    in another composition draws differently. On an engine whose rows may depend on what
    shares their batch (``invariant`` False) the promise is ``best-effort``: the same
    draws, on logits that can differ with the load."""
    extra = getattr(request, "extra_messages", None)
    scope = "best-effort" if not invariant else "batch-shape" if isinstance(extra, list) and extra else "request"
    return f'{seed};scope="{scope}"'


def _sent(request: Any) -> dict[str, float]:
    """The sampling fields the request sent (a null is not sent)."""
    values: dict[str, Any] = {name: getattr(request, name, None) for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty")}
    values["top_k"] = TOP_K.get(request)
    return {name: float(value) for name, value in values.items() if _set(value)}


def _effective(ctx: RequestContext, request: Any, mode: str | None = None) -> dict[str, float]:
    """Each sampling field: as sent, else its default for this model and ``mode`` (the
    request's own by default). A greedy request (sent temperature 0) gets no defaults:
    what it does not send is neutral."""
    sent = _sent(request)
    if sent.get("temperature") == 0.0:
        return sent
    engine = ctx.model.engine if ctx.model is not None else None
    values = {**defaults(ctx.settings, engine, mode or mode_of(request)), **sent}
    if values.get("temperature") == 0.0:  # greedy by default: the other defaults are moot
        return {k: v for k, v in values.items() if k in sent or k == "temperature"}
    return values


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(THINKING)
    register(NO_THINKING)


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    """A greedy draw takes the likeliest token whatever ``top_p`` or ``top_k`` say, so a
    greedy request that sends either is refused rather than ignored (penalties change
    the logits a greedy draw reads, so they stay honoured). A field another plugin has
    already reported unused (a scoring request's ``top_p``) is left reported."""
    if ctx.endpoint == "embeddings":
        return []
    sent = _sent(request)
    if _effective(ctx, request).get("temperature", 1.0) != 0.0:
        return []
    pointless = [
        name for name in ("top_p", "top_k") if name in sent and name not in ctx.ignored_fields and not (name == "top_p" and sent[name] == 1.0)
    ]
    return [
        Problem(f"{name} cannot change a greedy (temperature 0) draw; leave it out or sample with temperature > 0", param=name, code="invalid_sampling_parameter")
        for name in pointless
    ]


@hookimpl
def millm_render_chat(ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
    """``chat_template_kwargs.enable_thinking`` picks which defaults the fields a request
    leaves out take: read here whenever the two modes would sample this request differently."""
    if _effective(ctx, request, "thinking") != _effective(ctx, request, "no-thinking"):
        chat.read_kwargs.add("enable_thinking")


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    values = _effective(ctx, request)
    changes: dict[str, Any] = {}
    if "temperature" in values:
        changes["temperature"] = values["temperature"]
    if "top_p" in values and values.get("temperature", 1.0) != 0.0:
        changes["top_p"] = values["top_p"]
    if "top_k" in values and values.get("temperature", 1.0) != 0.0:
        changes["top_k"] = int(values["top_k"]) or TOP_K_ZERO_MEANS
    if _set(request.seed):
        changes["seed"] = int(request.seed)
        engine = ctx.model.engine if ctx.model is not None else None
        ctx.set_header(SEED_HEADER, seed_header(int(request.seed), request, batch_invariant(engine)))
    if changes:
        plan.sampling = msgspec.structs.replace(plan.sampling, **changes)

    if _set(request.stop):
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if stops:
            frozen = tuple(stops)

            def _stops(_row: RowInfo) -> StopSequences:
                return StopSequences(frozen)

            plan.add_processor(_stops)
    frequency = values.get("frequency_penalty", 0.0)
    presence = values.get("presence_penalty", 0.0)
    if frequency or presence:
        def _penalties(_row: RowInfo) -> Penalties:
            return Penalties(frequency, presence)

        plan.add_processor(_penalties)
