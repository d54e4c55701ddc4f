"""Per-request SAE activations: ``return_sae_activations`` on chat and text completions.

The request names an SAE attached by the steering plugin; pre-forward adds a tap at the
SAE's layer (before or after this request's delta there) and a per-row reader that encodes
the vectors the engine reads as the row runs, in the shared batch like any other request.
Finalize puts the result under ``millm.sae_activations`` (on a stream: a closing chunk
after the probe verdicts and before the steering report). Needs an engine with the
``taps`` capability (the GGUF engine has none: the field is refused there before loading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from millm_core.api import (
    AppContext,
    Finalization,
    ForwardPlan,
    MillmError,
    Outcome,
    PluginSetting,
    Problem,
    RequestContext,
    RequestField,
    RowInfo,
    StashKey,
    Tap,
    hookimpl,
)
from millm_plugins.scoring.contrib import readers
from millm_plugins.steering.public import STATE, SAENotAttached

from .collect import Collector
from .fields import FIELD, MAX_ENTRIES, MAX_TOP_K, ReturnSAEActivations
from .scoring import SCORED, ScoringActivations
from .select import PARAM, Selected, check_model, check_size, select, shape_problems

KEY = "millm"  # the response's top-level object
CLOSING_ORDER = 20  # after probe verdicts (10), before the steering report (90)
COLLECTORS = StashKey[list[Collector]]("activations.collectors")


def _select(app: AppContext, asked: ReturnSAEActivations) -> Selected:
    if STATE not in app.stash:  # the steering plugin (which attaches SAEs) is not enabled
        raise SAENotAttached("return_sae_activations needs an attached SAE, and this server does not run the steering plugin, which attaches them", param=PARAM)
    live = app.stash[STATE].live
    return select(asked, live.attachments, live.saes, live.unusable)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(MAX_TOP_K)
    register(MAX_ENTRIES)


@hookimpl
def millm_startup(app: AppContext) -> None:
    """Read scoring requests' prompts too (the scoring plugin's reader extension)."""
    readers(app).append(ScoringActivations(_select))


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(FIELD)


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    asked = FIELD.get(request) if ctx.endpoint != "embeddings" else None
    if asked is None:
        return []
    problems = shape_problems(ctx, request, asked, int(MAX_TOP_K.get(ctx.settings)))
    try:
        _select(ctx.app, asked)
    except MillmError as exc:
        problems.append(Problem(exc.message, param=exc.param, code=exc.code, status=exc.status))
    return problems


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    asked = FIELD.get(request)
    if asked is None:
        return
    selected = _select(ctx.app, asked)  # the snapshot now: an SAE detached since validation is a 400 here
    assert ctx.model is not None
    check_model(selected, ctx.model.info.d_model, ctx.model.info.n_layers)
    check_size(asked, selected, plan.prompt_lengths[0], plan.max_new_tokens, int(MAX_ENTRIES.get(ctx.settings)))
    plan.taps.add(Tap(selected.layer, asked.read_point))
    collectors = ctx.stash[COLLECTORS] = []

    def reader(info: RowInfo) -> Collector:
        collector = Collector(asked, selected, info.prompt_ids)
        collectors.append(collector)
        return collector

    plan.add_processor(reader)


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    if outcome.cancelled:
        return
    read: dict[str, Any] | None
    if outcome.kind == "scoring":
        read = ctx.stash[SCORED] if SCORED in ctx.stash else None
    else:
        collectors = ctx.stash.get(COLLECTORS, [])
        read = collectors[0].result() if collectors and outcome.kind == "generation" else None
    if read is None:
        return
    existing = out.extensions.get(KEY)
    out.extend(KEY, {**(existing if isinstance(existing, dict) else {}), "sae_activations": read}, order=CLOSING_ORDER)
