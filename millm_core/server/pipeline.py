"""The request path's stages, shared by every model endpoint.

decode → strict mode → resolve (model) → field policy (engine capabilities, known fields
nothing declares) → validate (plugins) → execute (who serves it) → for generation: prompt
ids and token budget → pre-forward (plugins build the plan) → run (scheduler) → finalize
(plugins). Everything that can be refused is refused before the first byte of a response,
so a stream's 200 is never followed by a refusal it could have known.
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
from ..engine import Capability, Capacity, MemoryAware, RowSpec, SamplingParams
from ..errors import CapacityExceeded, FieldNotHonoured, InvalidRequest, MillmError, OutOfMemory
from ..ledger import Claim, MemoryLedger
from ..pipeline_types import (
    ChoiceResult,
    Finalization,
    ForwardPlan,
    Outcome,
    Problem,
    RowInfo,
)
from ..prompts import prompt_ids, refuse_empty, token_budget
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
    # The request's rows in the memory ledger, released when it ends (``release``).
    claim: Claim | None = None

    def release(self) -> None:
        """The request ended (or never ran): its rows no longer hold memory."""
        if self.claim is not None:
            self.claim.release()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def _int(value: Any) -> int:
    """A sent integer field (callers check ``_sent`` first)."""
    assert isinstance(value, int)
    return value


@dataclass
class Admission:
    """A decoded request on its way through admission."""

    state: AppState
    ctx: RequestContext
    request: Any
    # Known output-changing fields the body sent that no enabled plugin declares.
    refused_known: list[str]


def check_field_policy(
    state: AppState, ctx: RequestContext, request: msgspec.Struct, capabilities: frozenset[str], engine: str, known: list[str]
) -> None:
    """Refuse, naming them and why, the non-neutral fields nothing honours for this
    endpoint on an engine with ``capabilities`` (the loaded model's, or those an engine
    declares for a model not loaded yet), and the known output-changing fields nothing
    enabled declares."""
    refused = state.policy.refusals(request, ctx.endpoint, capabilities, STRUCTURAL_FIELDS) + known
    if not refused:
        return
    reasons = [f"{name} ({state.policy.why_refused(name, ctx.endpoint, engine)})" for name in refused]
    raise FieldNotHonoured(
        f"not honoured by this server for {ctx.endpoint} on the {engine} engine: {'; '.join(reasons)}; the request was not run",
        param=refused[0],
    )


def admit(admission: Admission) -> ServedModel:
    """Strict mode, model resolution, the field policy and the plugins' validation: every
    refusal that needs no tokenisation. Runs nothing."""
    state, ctx, request = admission.state, admission.ctx, admission.request
    # Strict mode is decided once every place that can report a field ran (the chat
    # render reports message fields), in serve().
    model = state.host.resolve(ctx, request, state.models)
    if model is None:  # pragma: no cover - the core's resolve always answers or raises
        raise InvalidRequest("no plugin resolved a model for this request", param="model")
    ctx.model = model
    # What this engine cannot do is refused first, naming the field, before any plugin
    # checks how the field is used.
    check_field_policy(state, ctx, request, model.capabilities, model.info.engine, admission.refused_known)
    problems = state.host.validate(ctx, request)
    if problems:
        raise problems_error(problems)
    return model


def check_capacity(
    model: ServedModel, prompts: list[list[int]], n: int, max_new: int, budget_param: str, ledger: MemoryLedger | None = None
) -> Claim | None:
    """Refuse, before anything runs (and before a stream's 200), a request the engine's
    declared :class:`~millm_core.engine.Capacity` could never hold, or that does not fit
    in memory now beside the requests admitted before it; returns the request's claim in
    the memory ledger (release it when the request ends)."""
    capacity: Capacity = getattr(model.engine, "capacity", None) or Capacity()
    rows = len(prompts) * n
    if capacity.max_rows is not None and rows > capacity.max_rows:
        raise CapacityExceeded(
            f"this request needs {rows} sequences at once ({len(prompts)} prompt(s) × n={n}); the {model.info.engine} engine "
            f"serving '{model.info.served_name}' runs at most {capacity.max_rows}",
            param="n" if n > 1 else "prompt",
        )
    need = sum(len(p) + max_new for p in prompts) * n
    if capacity.max_tokens is not None and need > capacity.max_tokens:
        raise CapacityExceeded(
            f"the prompts and their token budgets need {need} tokens of cache; the {model.info.engine} engine serving "
            f"'{model.info.served_name}' holds at most {capacity.max_tokens}. Lower {budget_param} or send fewer prompts",
            param=budget_param,
        )
    engine = model.engine
    if not isinstance(engine, MemoryAware):
        return None
    lengths = [len(p) for p in prompts for _ in range(n)]
    admitted = ledger.admitted(engine) if ledger is not None else []
    short = engine.memory_shortfall(lengths, max_new, admitted=admitted)
    if short:
        raise OutOfMemory(f"not enough memory for this request now: {short}. Retry later, or ask for fewer tokens or rows")
    # Checked and claimed in one step on the event loop: no other admission runs between.
    return ledger.claim(engine, [(length, max_new) for length in lengths]) if ledger is not None else None


def prepare_generation(
    state: AppState, ctx: RequestContext, request: ChatCompletionRequest | CompletionRequest, model: ServedModel
) -> Prepared:
    """Prompt ids, token budget and the plugins' plan for an admitted request."""
    prompts = prompt_ids(ctx, request, model)
    if isinstance(request, CompletionRequest):
        refuse_empty(request, prompts)
    max_new = token_budget(request, prompts, model, state.settings.default_max_tokens)
    plan = ForwardPlan(sampling=SamplingParams(seed=fresh_seed()), max_new_tokens=max_new, prompt_lengths=tuple(len(p) for p in prompts))
    n = _int(request.n) if _sent(request.n) else 1
    budget_param = next((name for name in ("max_tokens", "max_completion_tokens") if _sent(getattr(request, name))), "max_tokens")
    claim = check_capacity(model, prompts, n, max_new, budget_param, state.memory)
    try:
        state.host.pre_forward(ctx, request, plan)
        if plan.taps and Capability.TAPS not in model.engine.capabilities:
            raise FieldNotHonoured(
                f"a plugin asked to read this request's residual stream, but the {model.info.engine} engine "
                "cannot (it lacks the taps capability)"
            )
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    return Prepared(ctx=ctx, request=request, model=model, plan=plan, prompts=prompts, n=n, claim=claim)


@dataclass
class RunHandle:
    """A submitted job and the queue its events arrive on."""

    job: Job
    events: asyncio.Queue[JobEvent]
    rows: int
    ended: bool = False  # the job's last event (done or failed) was read


def submit(state: AppState, prepared: Prepared) -> RunHandle:
    engine = prepared.model.engine
    rows: list[RowSpec] = []
    drivers: list[RowDriver] = []
    taps = tuple(sorted(prepared.plan.taps, key=lambda tap: (tap.layer, tap.point)))
    for p_index, ids in enumerate(prepared.prompts):
        for j in range(prepared.n):
            index = p_index * prepared.n + j
            sampling = msgspec.structs.replace(prepared.plan.sampling, stream=index)
            rows.append(
                RowSpec(
                    prompt_ids=tuple(ids),
                    sampling=sampling,
                    deltas=dict(prepared.plan.deltas),
                    max_new_tokens=prepared.plan.max_new_tokens,
                    taps=taps,
                )
            )
            info = RowInfo(index=index, prompt_index=p_index, prompt_tokens=len(ids), prompt_ids=tuple(ids))
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
        lane=prepared.plan.lane,
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
            handle.ended = True
            return
        elif isinstance(event, JobFailed):
            handle.ended = True
            raise event.error


async def until_ended(handle: RunHandle, timeout: float) -> bool:
    """Wait (reading and dropping its events) until the job has ended; False if it has not
    within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not handle.ended:
        try:
            event = await asyncio.wait_for(handle.events.get(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return False
        handle.ended = isinstance(event, JobDone | JobFailed)
    return True


def outcome(
    prepared: Prepared,
    texts: list[str],
    reasons: list[str | None],
    counts: list[int],
    cancelled: bool = False,
    fields: list[dict[str, Any] | None] | None = None,
    cached_tokens: int = 0,
) -> Outcome:
    extra = fields or [None] * len(texts)
    choices = tuple(
        ChoiceResult(index=i, text=texts[i], finish_reason=reasons[i] or "cancelled", completion_tokens=counts[i], fields=extra[i])
        for i in range(len(texts))
    )
    completion = sum(counts)
    return Outcome(
        choices=choices, prompt_tokens=prepared.prompt_tokens, completion_tokens=completion, cancelled=cancelled, cached_tokens=cached_tokens
    )


def finalize(state: AppState, prepared: Prepared, result: Outcome) -> Finalization:
    out = Finalization()
    state.host.finalize(prepared.ctx, prepared.request, result, out)
    return out
