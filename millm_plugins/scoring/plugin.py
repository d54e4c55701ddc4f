"""Scoring mode on ``/v1/completions`` and ``/v1/chat/completions``: one forward pass per
prompt, nothing generated, the next token's log-probabilities returned."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from millm_core.api import (
    GENERATION_ENDPOINTS,
    Capability,
    ChatCompletionRequest,
    ChoiceResult,
    Compute,
    ContextLengthExceeded,
    Execution,
    FieldNotHonoured,
    FieldRule,
    Finalization,
    InvalidRequest,
    Outcome,
    PluginSetting,
    Problem,
    Reply,
    RequestContext,
    RequestField,
    Scorer,
    ServedModel,
    Usage,
    hookimpl,
    prompt_ids,
    refuse_empty,
)
from millm_plugins.sampling.public import SEED_HEADER, seed_header

from .contrib import readers
from .logprobs import score_row
from .schema import (
    FIELDS,
    PRECISION,
    ChatLogprobs,
    ChatScoringChoice,
    ChatScoringResponse,
    CompletionLogprobs,
    CompletionScoringChoice,
    CompletionScoringResponse,
    ScoredMessage,
    TokenLogprob,
    TopLogprob,
)

NAME = "scoring"  # the owner named in schema.FIELDS
PRECISION_HEADER = "X-miLLM-Scoring-Precision"

DEVICE = PluginSetting("scoring_float32_device", "auto", "where float32 scoring copies go: auto, cpu or a device name")
HEADROOM = PluginSetting("scoring_float32_headroom_mb", 1024, "memory (MiB) to leave free beside a float32 scoring copy", int)
MAX_ALTERNATIVES = 20
MIN_TEMPERATURE = 0.001
# Fields that cannot change a scored answer; sent with a scoring request they are reported.
INERT_WHEN_SCORING = ("top_p", "top_k", "stop", "frequency_penalty", "presence_penalty")
NEVER_WHEN_SCORING = ("profile", "steering_intensity", "steering", "response_format", "tools", "tool_choice")
# Their values that ask for nothing (the API contract's neutral values), accepted on scoring too.
NEUTRAL_WHEN_SCORING: dict[str, Any] = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}
_NO_NEUTRAL = object()
SCORING_KEY_PREFIX = "token_id:"


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def is_scoring(request: Any) -> bool:
    """Scoring mode: ``logprobs`` (an integer on completions, ``true`` on chat) or
    ``allowed_token_ids``."""
    if _sent(getattr(request, "allowed_token_ids", None)):
        return True
    logprobs = getattr(request, "logprobs", None)
    return _sent(logprobs) and logprobs is not False


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(DEVICE)
    register(HEADROOM)


@hookimpl
def millm_register_schemas(register: Callable[[str, type], None]) -> None:
    register("/v1/completions", CompletionScoringResponse)
    register("/v1/chat/completions", ChatScoringResponse)


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    for field in FIELDS:
        register(field)


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    scoring = "scoring mode"
    # What a scoring request needs or accepts even where nothing generates (--plugins
    # scoring): the fields that cannot change a scored answer are reported, a seed echoed.
    for name in ("max_tokens", "max_completion_tokens", "n", "temperature"):
        register(FieldRule(name, GENERATION_ENDPOINTS, by=NAME, requires=Capability.SCORING, condition=scoring))
    for name in INERT_WHEN_SCORING:
        register(FieldRule(name, GENERATION_ENDPOINTS, by=NAME, requires=Capability.SCORING, condition=f"{scoring}: reported, unused"))
    register(FieldRule("seed", GENERATION_ENDPOINTS, by=NAME, requires=Capability.SCORING, condition=f"{scoring}: echoed, changes nothing"))


def _problems_outside_scoring(request: Any) -> Iterable[Problem]:
    chat = isinstance(request, ChatCompletionRequest)
    if chat and _sent(request.top_logprobs) and request.logprobs is not True:
        yield Problem("top_logprobs needs logprobs: true", param="top_logprobs")
    if PRECISION.get(request) == "float32":
        yield Problem(
            'scoring_precision "float32" applies to scoring requests only (logprobs with max_tokens: 1)',
            param="scoring_precision",
            code="field_not_honoured",
        )
    if getattr(request, "return_tokens_as_token_ids", None) is True:
        yield Problem("return_tokens_as_token_ids applies to scoring requests only", param="return_tokens_as_token_ids", code="field_not_honoured")


def _problems_when_scoring(ctx: RequestContext, request: Any) -> Iterable[Problem]:
    chat = isinstance(request, ChatCompletionRequest)
    budget = request.max_tokens if _sent(request.max_tokens) else request.max_completion_tokens
    if budget != 1:
        param = "max_tokens" if _sent(request.max_tokens) or not _sent(request.max_completion_tokens) else "max_completion_tokens"
        yield Problem(f"scoring (logprobs or allowed_token_ids) needs {param}: 1; nothing is generated", param=param)
    if _sent(request.n) and request.n != 1:
        yield Problem("scoring needs n: 1", param="n")
    if ctx.stream:
        yield Problem("scoring requests cannot be streamed", param="stream")
    temperature = request.temperature
    if _sent(temperature) and 0 < temperature < MIN_TEMPERATURE:
        yield Problem(f"temperature must be 0 (no scaling) or at least {MIN_TEMPERATURE} in scoring mode", param="temperature")
    if chat:
        if _sent(request.logprobs) and request.logprobs is not True and request.logprobs is not False:
            yield Problem("logprobs on chat completions is true or false; use top_logprobs for alternatives", param="logprobs")
        if _sent(request.top_logprobs) and not 0 <= request.top_logprobs <= MAX_ALTERNATIVES:
            yield Problem(f"top_logprobs must be 0–{MAX_ALTERNATIVES}", param="top_logprobs")
        if _sent(request.top_logprobs) and request.logprobs is not True:
            yield Problem("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        logprobs = request.logprobs
        if _sent(logprobs) and (isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_ALTERNATIVES):
            yield Problem(f"logprobs on /v1/completions is an integer 0–{MAX_ALTERNATIVES}", param="logprobs")
    allowed = request.allowed_token_ids
    if _sent(allowed):
        if not allowed:
            yield Problem("allowed_token_ids must list at least one token id", param="allowed_token_ids", code="invalid_scoring_request")
        elif any(t < 0 for t in allowed):
            yield Problem("allowed_token_ids must be non-negative token ids", param="allowed_token_ids", code="invalid_scoring_request")
        elif len(set(allowed)) < len(allowed):
            # The log-probabilities are normalised over the set: a repeated id would count twice.
            repeated = sorted(t for t, n in Counter(allowed).items() if n > 1)
            shown = ", ".join(map(str, repeated[:10])) + (f" and {len(repeated) - 10} more" if len(repeated) > 10 else "")
            yield Problem(
                f"allowed_token_ids lists {shown} more than once: each id is a member of the set the log-probabilities are "
                "normalised over, so list it once",
                param="allowed_token_ids",
                code="invalid_scoring_request",
            )
    for name in NEVER_WHEN_SCORING:
        value = getattr(request, name, msgspec.UNSET)
        if _sent(value) and msgspec.to_builtins(value) != NEUTRAL_WHEN_SCORING.get(name, _NO_NEUTRAL):
            yield Problem(f"{name} cannot be used on a scoring request: scoring is never steered or constrained", param=name, code="field_not_honoured")


@hookimpl(tryfirst=True)  # reports the fields scoring leaves unused before other plugins judge them
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    if ctx.endpoint == "embeddings":
        return []
    if not is_scoring(request):
        return list(_problems_outside_scoring(request))
    for name in INERT_WHEN_SCORING:
        if _sent(getattr(request, name, None)):
            ctx.ignored_fields.append(name)
    return list(_problems_when_scoring(ctx, request))


def _key(engine: Scorer, token: int, by_id: bool) -> str:
    return f"{SCORING_KEY_PREFIX}{token}" if by_id else engine.token_text(token)


def _prompts(ctx: RequestContext, request: Any, model: ServedModel, engine: Scorer) -> tuple[list[list[int]], list[str]]:
    """The prompts to score, tokenised as generation would, and their texts (completions)."""
    if isinstance(request, ChatCompletionRequest):
        if not getattr(getattr(engine, "tokenizer", None), "chat_template", None):
            raise InvalidRequest(
                f"'{model.info.served_name}' has no chat template; scoring would score a prompt the model never saw. "
                "Score the text on /v1/completions instead",
                code="no_chat_template",
                param="messages",
            )
        prompts = prompt_ids(ctx, request, model)
        return prompts, [""] * len(prompts)
    prompts = prompt_ids(ctx, request, model)
    refuse_empty(request, prompts, code="invalid_scoring_request")
    return prompts, request.prompts()


def _check_context(prompts: list[list[int]], model: ServedModel, chat: bool) -> None:
    """A scored prompt must fit the context window like any other."""
    limit = model.info.context_length
    for index, ids in enumerate(prompts):
        if len(ids) > limit:
            where = ("messages" if index == 0 else f"extra_messages[{index - 1}]") if chat else ("prompt" if len(prompts) == 1 else f"prompt[{index}]")
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, the prompt to score has {len(ids)} tokens. "
                "Shorten the prompt.",
                param=where,
            )


async def _score(ctx: RequestContext, request: Any, model: ServedModel, prompts: list[list[int]], texts: list[str]) -> Reply:
    engine = model.engine
    assert isinstance(engine, Scorer)
    chat = isinstance(request, ChatCompletionRequest)
    allowed = list(request.allowed_token_ids) if _sent(request.allowed_token_ids) else None
    vocab = model.info.vocab_size
    if allowed and any(t >= vocab for t in allowed):
        bad = sorted({t for t in allowed if t >= vocab})
        raise InvalidRequest(f"token ids {bad} are outside the vocabulary (size {vocab})", code="invalid_scoring_request", param="allowed_token_ids")
    precision = PRECISION.get(request)
    float32 = precision == "float32"
    device, headroom = DEVICE.get(ctx.settings), HEADROOM.get(ctx.settings)
    prepared = [(reader, work) for reader in readers(ctx.app) if (work := reader.prepare(ctx, request, model, prompts)) is not None]
    if float32 and prepared:
        # Readers read the served model (in its own precision), never the float32 copy:
        # refused rather than reported as float32.
        fields = ", ".join(sorted({str(getattr(reader, "field", "a read of the scoring pass")) for reader, _ in prepared}))
        raise FieldNotHonoured(
            f'scoring_precision "float32" is not served with {fields}: it reads the model in the precision it is served in; '
            'send scoring_precision "native"',
            param="scoring_precision",
        )
    reads = [work for _, work in prepared]
    # A prompt's scores are its own whatever it is sent with: the Scorer contract.
    logits = await ctx.app.run_model(lambda: engine.next_token_logits(prompts, float32=float32, float32_device=device, headroom_mb=headroom))
    for work in reads:
        await ctx.app.run_model(work)
    temperature = float(request.temperature) if _sent(request.temperature) else 0.0
    by_id = getattr(request, "return_tokens_as_token_ids", None) is True
    if chat:
        wants = request.logprobs is True
        top = int(request.top_logprobs) if _sent(request.top_logprobs) else 0
    else:
        wants = _sent(request.logprobs) and request.logprobs is not False
        top = int(request.logprobs) if wants else 0
    info = model.info
    created, rid = ctx.created, uuid.uuid4().hex
    prompt_tokens = sum(len(p) for p in prompts)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens)
    headers: dict[str, str] = {PRECISION_HEADER: str(precision)} if precision else {}
    outcome_choices: list[ChoiceResult] = []
    if chat:  # one choice per conversation (messages, then each of extra_messages)
        chat_choices = []
        for index, row in enumerate(logits):
            scored = score_row(row, allowed, temperature, min(top, len(allowed)) if allowed else top)
            token, logprob = scored.best
            text = engine.token_text(token)
            logprobs = None
            if wants:
                tops = [TopLogprob(token=_key(engine, t, by_id), logprob=lp, bytes=list(engine.token_text(t).encode())) for t, lp in scored.candidates]
                logprobs = ChatLogprobs(content=[TokenLogprob(token=_key(engine, token, by_id), logprob=logprob, bytes=list(text.encode()), top_logprobs=tops)])
            chat_choices.append(ChatScoringChoice(index=index, message=ScoredMessage(content=text), logprobs=logprobs))
            outcome_choices.append(ChoiceResult(index=index, text=text, finish_reason="length", completion_tokens=0))
        body: msgspec.Struct = ChatScoringResponse(
            id=f"chatcmpl-{rid}", created=created, model=info.served_name, system_fingerprint=info.system_fingerprint, choices=chat_choices, usage=usage
        )
    else:
        choices = []
        for index, (text_in, row) in enumerate(zip(texts, logits, strict=True)):
            scored = score_row(row, allowed, temperature, None if allowed else top)
            token, logprob = scored.best
            text = engine.token_text(token)
            legacy = None
            if wants:
                alternatives: dict[str, float] = {}
                for t, lp in scored.candidates:
                    alternatives.setdefault(_key(engine, t, by_id), lp)  # colliding texts: one entry, the likelier
                # As OpenAI's legacy completions: the chosen token is always listed (logprobs: 0 too).
                alternatives.setdefault(_key(engine, token, by_id), logprob)
                legacy = CompletionLogprobs(tokens=[_key(engine, token, by_id)], token_logprobs=[logprob], top_logprobs=[alternatives], text_offset=[len(text_in)])
            choices.append(CompletionScoringChoice(index=index, text=text, logprobs=legacy))
            outcome_choices.append(ChoiceResult(index=index, text=text, finish_reason="length", completion_tokens=0))
        response = CompletionScoringResponse(
            id=f"cmpl-{rid}", created=created, model=info.served_name, system_fingerprint=info.system_fingerprint, choices=choices, usage=usage
        )
        if precision:
            response.scoring_precision = precision
        body = response
    outcome = Outcome(choices=tuple(outcome_choices), prompt_tokens=prompt_tokens, completion_tokens=0, kind="scoring")
    return Reply(body=body, outcome=outcome, headers=headers)


@hookimpl
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    """A scored request's seed changes nothing it returns, but its promise is stated as
    generation states it (``X-miLLM-Seed``)."""
    if outcome.kind == "scoring" and ctx.endpoint != "embeddings" and _sent(getattr(request, "seed", None)):
        out.headers[SEED_HEADER] = seed_header(int(request.seed), request)


@hookimpl
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
    engine = model.engine
    if ctx.endpoint == "embeddings" or not is_scoring(request) or Capability.SCORING not in model.capabilities or not isinstance(engine, Scorer):
        return None
    # Tokenised now, before the run: what rendering reports is seen by strict mode.
    prompts, texts = _prompts(ctx, request, model, engine)
    _check_context(prompts, model, isinstance(request, ChatCompletionRequest))
    return Compute(lambda: _score(ctx, request, model, prompts, texts))
