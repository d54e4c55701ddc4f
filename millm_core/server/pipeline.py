"""The request path shared by chat and text completions, stage by stage.

decode → validate (plugins) → resolve (model) → field policy (engine capabilities) →
prompt ids and token budget → pre-forward (plugins build the plan) → run (scheduler) →
finalize (plugins). Everything that can be refused is refused before the first byte of a
response, so a stream's 200 is never followed by a refusal it could have known.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from ..builtin import STRUCTURAL_FIELDS
from ..context import RequestContext
from ..contracts.chat import ChatCompletionRequest
from ..contracts.completions import CompletionRequest
from ..engine import Capability, RowSpec, SamplingParams
from ..errors import ContextLengthExceeded, FieldNotHonoured, InvalidRequest, MillmError
from ..pipeline_types import (
    ChoiceResult,
    Finalization,
    ForwardPlan,
    Outcome,
    Problem,
    RowInfo,
)
from ..registry import ServedModel
from ..rng import fresh_seed
from ..rows import RowDriver
from ..scheduler import (
    Job,
    JobDone,
    JobEvent,
    JobFailed,
    StepEvents,
    threadsafe_emitter,
)
from .state import AppState

log = structlog.get_logger("millm.pipeline")

# Message fields the engines' renderers read; any other sent message field is reported.
RENDERED_MESSAGE_FIELDS = ("role", "content")
STRICT_HEADER = "x-millm-strict"


def strict_mode(ctx: RequestContext) -> bool:
    """``X-miLLM-Strict``: ``true``/``1`` refuses unused fields, ``false``/``0``/absent
    reports them; any other value is refused, naming the header."""
    raw = ctx.headers.get(STRICT_HEADER)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    raise InvalidRequest(f"X-miLLM-Strict must be true, 1, false or 0; got {raw!r}", param="X-miLLM-Strict", code="invalid_header")


def refuse_unused_if_strict(ctx: RequestContext) -> None:
    """In strict mode, any unused field location refuses the whole request."""
    if strict_mode(ctx) and ctx.ignored_fields:
        raise InvalidRequest(
            "X-miLLM-Strict is set and these fields would not be used: " + ", ".join(ctx.ignored_fields),
            param=ctx.ignored_fields[0],
            code="unused_fields_refused",
        )


def problems_error(problems: list[Problem]) -> MillmError:
    first = problems[0]
    message = first.message if len(problems) == 1 else "; ".join(p.message for p in problems)
    err = MillmError(message, code=first.code, param=first.param, status=first.status)
    err.type = "invalid_request_error" if first.status < 500 else "server_error"
    return err


@dataclass
class Prepared:
    """A request that passed every check and is ready to run."""

    ctx: RequestContext
    request: ChatCompletionRequest | CompletionRequest
    model: ServedModel
    plan: ForwardPlan
    prompts: list[list[int]]
    n: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def _int(value: Any) -> int:
    """A sent integer field (callers check ``_sent`` first)."""
    assert isinstance(value, int)
    return value


def _unread_message_fields(request: ChatCompletionRequest) -> list[str]:
    unread: list[str] = []
    for index, message in enumerate(request.messages):
        for name in message.__struct_fields__:
            if name not in RENDERED_MESSAGE_FIELDS and _sent(getattr(message, name)):
                unread.append(f"messages[{index}].{name}")
    return unread


def _prompt_ids(ctx: RequestContext, request: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> list[list[int]]:
    engine = model.engine
    if isinstance(request, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        kwargs: dict[str, Any] = request.chat_template_kwargs if isinstance(request.chat_template_kwargs, dict) else {}
        if kwargs and Capability.CHAT_TEMPLATE_KWARGS not in model.capabilities:
            ctx.ignored_fields.append("chat_template_kwargs")  # accepted, and said to be unused
            kwargs = {}
        return [engine.render_chat(messages, **kwargs)]
    add_special = request.add_special_tokens if _sent(request.add_special_tokens) else True
    prompts = [engine.encode(text, add_special_tokens=bool(add_special)) for text in request.prompts()]
    for index, ids in enumerate(prompts):
        if not ids:
            param = "prompt" if isinstance(request.prompt, str) else f"prompt[{index}]"
            raise InvalidRequest("The prompt tokenises to nothing; send at least one token", param=param)
    return prompts


def _budget(request: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], model: ServedModel, default: int) -> int:
    limit = model.info.context_length
    asked = request.max_tokens if _sent(request.max_tokens) else request.max_completion_tokens
    longest = max(len(p) for p in prompts)
    if _sent(asked):
        if longest + _int(asked) > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + _int(asked)} tokens ({longest} in the prompt, {asked} for the completion). "
                "Shorten the prompt or lower max_tokens.",
                param="max_tokens" if _sent(request.max_tokens) else "max_completion_tokens",
            )
        return _int(asked)
    if longest >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, the prompt has "
            f"{longest} tokens, leaving no room for a completion. Shorten the prompt.",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
    return min(default, limit - longest)


def check_field_policy(state: AppState, ctx: RequestContext, request: msgspec.Struct, model: ServedModel) -> None:
    """Refuse, naming them, the non-neutral fields nothing honours for this endpoint and engine."""
    refused = state.policy.refusals(request, ctx.endpoint, model.capabilities, STRUCTURAL_FIELDS)
    if refused:
        raise FieldNotHonoured(
            f"{', '.join(refused)}: not honoured by this server for {ctx.endpoint} on the "
            f"{model.info.engine} engine with the enabled plugins; the request was not run",
            param=refused[0],
        )


def admit(state: AppState, ctx: RequestContext, request: ChatCompletionRequest | CompletionRequest) -> ServedModel:
    """Strict mode, model resolution, the field policy and the plugins' validation: every
    refusal that needs no tokenisation. Runs nothing."""
    if isinstance(request, ChatCompletionRequest):
        ctx.ignored_fields.extend(_unread_message_fields(request))
    refuse_unused_if_strict(ctx)
    model = state.host.resolve(ctx, request, state.models)
    if model is None:  # pragma: no cover - the core's resolve always answers or raises
        raise InvalidRequest("no plugin resolved a model for this request", param="model")
    # What this engine cannot do is refused first, naming the field, before any plugin
    # checks how the field is used.
    check_field_policy(state, ctx, request, model)
    problems = state.host.validate(ctx, request)
    if problems:
        raise problems_error(problems)
    return model


def prompt_ids(ctx: RequestContext, request: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> list[list[int]]:
    """The request's prompt token ids, exactly as generation tokenises them (one BOS rule,
    chat template, ``add_special_tokens``). Scoring uses the same function."""
    return _prompt_ids(ctx, request, model)


def prepare_generation(state: AppState, ctx: RequestContext, request: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> Prepared:
    """Prompt ids, token budget and the plugins' plan for an admitted request."""
    prompts = _prompt_ids(ctx, request, model)
    max_new = _budget(request, prompts, model, state.settings.default_max_tokens)
    plan = ForwardPlan(sampling=SamplingParams(seed=fresh_seed(ctx.request_id)), max_new_tokens=max_new)
    state.host.pre_forward(ctx, request, plan)
    n = _int(request.n) if _sent(request.n) else 1
    return Prepared(ctx=ctx, request=request, model=model, plan=plan, prompts=prompts, n=n)


@dataclass
class RunHandle:
    """A submitted job and the queue its events arrive on."""

    job: Job
    events: asyncio.Queue[JobEvent]
    rows: int


def submit(state: AppState, prepared: Prepared) -> RunHandle:
    engine = prepared.model.engine
    rows: list[RowSpec] = []
    drivers: list[RowDriver] = []
    for p_index, ids in enumerate(prepared.prompts):
        for j in range(prepared.n):
            index = p_index * prepared.n + j
            sampling = msgspec.structs.replace(prepared.plan.sampling, stream=index)
            rows.append(
                RowSpec(prompt_ids=tuple(ids), sampling=sampling, deltas=dict(prepared.plan.deltas), max_new_tokens=prepared.plan.max_new_tokens)
            )
            info = RowInfo(index=index, prompt_index=p_index, prompt_tokens=len(ids))
            drivers.append(
                RowDriver(
                    index,
                    decode=engine.decode,
                    processors=[factory(info) for factory in prepared.plan.processor_factories],
                    eos_token_ids=engine.eos_token_ids,
                    max_new_tokens=prepared.plan.max_new_tokens,
                )
            )
    queue: asyncio.Queue[JobEvent] = asyncio.Queue()
    job = Job(
        engine=engine,
        rows=rows,
        drivers=drivers,
        emit=threadsafe_emitter(asyncio.get_running_loop(), queue),
        request_id=prepared.ctx.request_id,
    )
    state.scheduler.submit(job)
    return RunHandle(job=job, events=queue, rows=len(rows))


async def events(handle: RunHandle) -> AsyncIterator[StepEvents]:
    """Step events until the job ends; a failed job raises its error here."""
    while True:
        event = await handle.events.get()
        if isinstance(event, StepEvents):
            yield event
        elif isinstance(event, JobDone):
            return
        elif isinstance(event, JobFailed):
            raise event.error


def outcome(prepared: Prepared, texts: list[str], reasons: list[str | None], counts: list[int], cancelled: bool = False) -> Outcome:
    choices = tuple(
        ChoiceResult(index=i, text=texts[i], finish_reason=reasons[i] or "cancelled", completion_tokens=counts[i])
        for i in range(len(texts))
    )
    completion = sum(counts)
    return Outcome(choices=choices, prompt_tokens=prepared.prompt_tokens, completion_tokens=completion, cancelled=cancelled)


def finalize(state: AppState, prepared: Prepared, result: Outcome) -> Finalization:
    out = Finalization()
    state.host.finalize(prepared.ctx, prepared.request, result, out)
    return out
