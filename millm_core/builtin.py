"""The core's own hook implementations, registered like any plugin under the name
``core``: the fields the core honours itself, cross-field checks, and the default model
resolution (``trylast``, so a plugin can take over)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from .context import RequestContext
from .engine import Capability
from .errors import ModelNotFound
from .fields import FieldRule
from .hookspecs import hookimpl
from .pipeline_types import Problem
from .registry import ModelRegistry, ServedModel, SwitchTarget

NAME = "core"

# Fields the pipeline itself consumes; they are never refused.
STRUCTURAL_FIELDS = ("model", "messages", "prompt", "input")


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


@hookimpl
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    register(FieldRule("add_special_tokens", ("completions",), by=NAME))
    register(FieldRule("extra_messages", ("chat.completions",), by=NAME))
    register(FieldRule("chat_template_kwargs", ("chat.completions",), by=NAME, requires=Capability.CHAT_TEMPLATE_KWARGS))
    # An engine whose template rendering takes no kwargs accepts them and reports them unused.
    register(FieldRule("chat_template_kwargs", ("chat.completions",), by=NAME, condition="reported in X-miLLM-Ignored-Fields: this engine's templates take none"))


@hookimpl
def millm_validate_switch(ctx: RequestContext, request: Any, target: SwitchTarget) -> Iterable[Problem]:
    """The request's own shape is checked before a switch unloads the resident model."""
    return _request_problems(ctx, request)


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> Iterable[Problem]:
    return _request_problems(ctx, request)


def _request_problems(ctx: RequestContext, request: Any) -> list[Problem]:
    """What the request asks that no model could serve: lengths that disagree, stream
    options without a stream, several choices streamed or beside extra conversations,
    more rows than the server runs per request, a tool message answering no call."""
    problems: list[Problem] = []
    if ctx.endpoint == "embeddings":
        return problems
    max_tokens, max_completion = request.max_tokens, request.max_completion_tokens
    if _sent(max_tokens) and _sent(max_completion) and max_tokens != max_completion:
        problems.append(
            Problem(
                f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) differ; "
                "send one of them (max_completion_tokens is max_tokens under OpenAI's newer name)",
                param="max_completion_tokens",
            )
        )
    if not ctx.stream and _sent(getattr(request, "stream_options", None)):
        # As OpenAI: the options shape a stream, and nothing else reads them.
        problems.append(Problem("stream_options is only allowed with stream: true", param="stream_options"))
    if ctx.stream and _sent(request.n) and request.n > 1:
        problems.append(Problem("n > 1 is not available with stream: true; send n: 1 or stream: false", param="n"))
    n = request.n if _sent(request.n) else 1
    prompts = len(request.prompts()) if ctx.endpoint == "completions" else len(request.conversations())
    if prompts > 1 and n > 1 and ctx.endpoint == "chat.completions":
        problems.append(Problem("n > 1 and extra_messages together are not served: each conversation is one choice; send one of them", param="n"))
    if ctx.endpoint == "chat.completions":
        problems.extend(_unanswered_tool_messages(request.conversations()))
    limit = ctx.settings.max_rows_per_request
    if prompts * n > limit:
        unit, many = ("prompt", "prompt") if ctx.endpoint == "completions" else ("conversation", "extra_messages")
        problems.append(
            Problem(
                f"this request asks for {prompts * n} rows ({prompts} {unit}(s) × n={n}); this server runs at most {limit} "
                "per request (--max-rows-per-request)",
                param="n" if n > 1 else many,
                code="too_many_rows",
            )
        )
    return problems


def _unanswered_tool_messages(conversations: list[list[Any]]) -> list[Problem]:
    """A ``role: "tool"`` message must say which call it answers (``tool_call_id``), as
    OpenAI requires: without it a template renders an answer to no call."""
    problems = []
    for j, messages in enumerate(conversations):
        where = "messages" if j == 0 else f"extra_messages[{j - 1}]"
        for i, message in enumerate(messages):
            if message.role == "tool" and not _sent(message.tool_call_id):
                reason = 'a "tool" message needs the tool_call_id of the call it answers'
                problems.append(Problem(reason, param=f"{where}[{i}].tool_call_id"))
    return problems


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    from .server.routes.lifecycle import ROUTES  # the server's modules load only when a server is built

    for path, endpoint, methods, doc in ROUTES:
        register(path, endpoint, methods, doc=doc)


@hookimpl(trylast=True)
def millm_requested_model(ctx: RequestContext, request: Any) -> str | None:
    name = getattr(request, "model", None)
    return name if isinstance(name, str) else None


@hookimpl(trylast=True)
def millm_resolve(ctx: RequestContext, request: Any, models: ModelRegistry) -> ServedModel:
    model = models.get(request.model)
    if model is None:
        served = ", ".join(sorted(m.info.served_name for m in models)) or "none"
        raise ModelNotFound(
            f"The model '{request.model}' does not exist on this server; served models: {served}",
            param="model",
        )
    return model
