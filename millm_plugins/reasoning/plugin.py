"""The reasoning plugin: models whose chat template writes a reasoning block.

On such a model (the block's markers are read off the template when it loads) a chat
request's rows get a :class:`~.processor.Reasoning` processor, first of all: the reasoning
comes back as ``message.reasoning_content`` (``delta.reasoning_content`` when streaming)
and the answer as ``content``, so ``stop``, tool calls and JSON constraints see the answer
alone. ``thinking_budget`` forces the close; an end of turn inside the block becomes its
close; the loop guard takes repeated spans back (engines that can rewind a row); a forced
tool call's opening is forced right after the close, so the model still thinks first.

``X-miLLM-Reasoning`` says what ran: ``off`` (the prompt closed the block: thinking off),
or ``on`` with ``budget`` (tokens, absent for none), ``loop-guard`` and ``redirect``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from millm_core.api import (
    AppContext,
    Capability,
    ChatRender,
    Finalization,
    ForwardPlan,
    InvalidRequest,
    Outcome,
    PluginSetting,
    RequestContext,
    RequestField,
    RowInfo,
    ServedModel,
    StashKey,
    hookimpl,
    template_variables,
)

from .fields import ANSWER_RESERVE, BUDGET, DEFAULT_GUARD, EFFORT, LOOP_GUARD, MARKERS, THINKING_BUDGET
from .markers import ReasoningFormat, markers_of, reasoning_format
from .processor import Reasoning, RowPolicy

HEADER = "X-miLLM-Reasoning"
FORMATS = StashKey[dict[str, ReasoningFormat | None]]("reasoning.formats")
DEFERRED = StashKey[str]("reasoning.deferred_opening")
THINKING = StashKey[bool]("reasoning.thinking")
OPENING = StashKey[str]("reasoning.prompt_opening")
ROWS = StashKey[list[Reasoning]]("reasoning.rows")


def _template(model: ServedModel) -> str | None:
    template = getattr(model.engine, "chat_template", None)
    return template if isinstance(template, str) and template else None


def format_of(app: AppContext, model: ServedModel | None) -> ReasoningFormat | None:
    """The model's reasoning block (None: it writes none)."""
    if model is None:
        return None
    return app.stash.setdefault(FORMATS, dict).get(model.info.served_name)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    for setting in (THINKING_BUDGET, ANSWER_RESERVE, LOOP_GUARD, MARKERS):
        register(setting)


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(BUDGET)
    register(EFFORT)


@hookimpl
def millm_model_loaded(app: AppContext, model: ServedModel) -> None:
    """Read the reasoning block off the template, and tokenise its forced close, once."""
    pair = markers_of(_template(model), MARKERS.get(app.settings))
    app.stash.setdefault(FORMATS, dict)[model.info.served_name] = reasoning_format(model.engine, pair) if pair else None


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> None:
    """On a model without a reasoning block the fields ask for nothing: reported."""
    if ctx.endpoint != "chat.completions" or format_of(ctx.app, ctx.model) is not None:
        return
    for field in (BUDGET, EFFORT):
        if field.get(request) is not None:
            ctx.ignored_fields.append(field.name)


def _reads(template: str, variable: str) -> bool:
    """Whether the chat template reads ``variable`` (a word search where it does not parse)."""
    found = template_variables(template) if template else frozenset()
    return variable in template if found is None else variable in found


def _thinking(request: Any, chat: ChatRender | None = None) -> bool:
    kwargs = chat.template_kwargs if chat is not None else (getattr(request, "chat_template_kwargs", None) or {})
    return not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)


@hookimpl
def millm_render_chat(ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
    """Past turns' reasoning into the template, ``reasoning_effort: "none"`` as
    ``enable_thinking: false``, and a forced call's opening deferred past the close."""
    fmt = format_of(ctx.app, model)
    template = _template(model) or ""
    if fmt is None:
        return
    chat.read_kwargs.add("enable_thinking")  # thinking on or off, whatever the template reads
    if "reasoning_content" in template:
        for message, target in zip(chat.source, chat.messages, strict=True):
            reasoning = getattr(message, "reasoning_content", None)
            if isinstance(reasoning, str) and reasoning:
                target["reasoning_content"] = reasoning
                chat.rendered_fields.add("reasoning_content")
    effort = EFFORT.get(request)
    if effort == "none":
        if chat.template_kwargs.get("enable_thinking") is True:
            raise InvalidRequest('reasoning_effort "none" and chat_template_kwargs.enable_thinking true disagree; send one', param="reasoning_effort")
        if not _reads(template, "enable_thinking"):
            raise InvalidRequest("this model's chat template has no enable_thinking switch, so its reasoning cannot be turned off", param="reasoning_effort")
        chat.template_kwargs["enable_thinking"] = False
    elif effort in ("minimal", "low", "medium", "high"):
        ctx.ignored_fields.append("reasoning_effort")  # only "none" and "max" change what runs
    if chat.template_kwargs.get("enable_thinking") is False and not _reads(template, "enable_thinking"):
        raise InvalidRequest(
            "this model's chat template has no enable_thinking switch, so its reasoning cannot be turned off",
            param="chat_template_kwargs.enable_thinking",
        )
    ctx.stash[THINKING] = _thinking(request, chat)
    if chat.opening and ctx.stash[THINKING]:
        ctx.stash[DEFERRED] = chat.opening
        chat.opening = ""
    elif chat.opening:
        ctx.stash[OPENING] = chat.opening  # stays in the prompt: set aside when reading its end


def _budget(ctx: RequestContext, request: Any, max_tokens: int) -> tuple[int | None, int | None]:
    """The request's thinking budget in reasoning tokens (None: none), its own or the
    server's, and the most tokens its rows may draw before the close is forced: both
    leave the answer reserve (at most half of max_tokens)."""
    if EFFORT.get(request) == "max":
        if BUDGET.get(request) is not None:
            ctx.ignored_fields.append("thinking_budget")  # "max" thinks without a budget
        return None, None
    asked = BUDGET.get(request)
    budget = asked if asked is not None else int(THINKING_BUDGET.get(ctx.settings))
    if not budget:
        return None, None
    spend = max(0, max_tokens - min(int(ANSWER_RESERVE.get(ctx.settings)), max_tokens // 2))
    return min(budget, spend), spend


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    model = ctx.model
    fmt = format_of(ctx.app, model)
    if ctx.endpoint != "chat.completions" or fmt is None or model is None:
        return
    rewinds = Capability.REWIND in model.capabilities
    thinking = ctx.stash[THINKING] if THINKING in ctx.stash else _thinking(request)
    guard = DEFAULT_GUARD if rewinds and LOOP_GUARD.get(ctx.settings) == "rewind" else None
    opening = ctx.stash[DEFERRED] if DEFERRED in ctx.stash else ""
    in_prompt = ctx.stash[OPENING] if OPENING in ctx.stash else ""
    budget, spend = _budget(ctx, request, plan.max_new_tokens)
    policy = RowPolicy(
        budget=budget,
        spend=spend,
        redirect=thinking and rewinds,
        guard=guard,
        opening_ids=tuple(model.engine.encode(opening, add_special_tokens=False)) if opening else (),
    )
    rows = ctx.stash.setdefault(ROWS, list)
    engine = model.engine

    def reasoning(row: RowInfo) -> Reasoning:
        proc = Reasoning(fmt, fmt.start(engine, row.prompt_ids, in_prompt), policy)
        rows.append(proc)
        return proc

    plan.add_processor(reasoning, first=True)
    if not thinking:
        # Thinking off: a budget asks for nothing (the block is closed in the prompt).
        ctx.ignored_fields.extend(f.name for f in (BUDGET, EFFORT) if f.get(request) not in (None, "none") and f.name not in ctx.ignored_fields)
        ctx.set_header(HEADER, "off")
        return
    parts = ["on"]
    if policy.budget is not None:
        parts.append(f"budget={policy.budget}")
    parts.append(f"loop-guard={'rewind' if guard else 'off'}")
    parts.append(f"redirect={'?1' if policy.redirect else '?0'}")
    ctx.set_header(HEADER, ";".join(parts))


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    """The request's log line marks a redirected turn (``reasoning_redirected_at``, the
    output index of the close that replaced an end of turn) and a forced close."""
    if ROWS not in ctx.stash:
        return
    rows = ctx.stash[ROWS]
    redirected = [r.redirected_at for r in rows if r.redirected_at is not None]
    if redirected:
        ctx.access_log["reasoning_redirected_at"] = redirected[0] if len(rows) == 1 else redirected
    forced = [r.forced_at for r in rows if r.forced_at is not None]
    if forced:
        ctx.access_log["thinking_budget_forced_at"] = forced[0] if len(rows) == 1 else forced
    rewound = sum(r.rewound for r in rows)
    if rewound:
        ctx.access_log["rewound_tokens"] = rewound
