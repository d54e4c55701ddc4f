"""Structured output: ``response_format`` ``json_object`` and ``json_schema``, enforced
token by token with lm-format-enforcer and validated with ``jsonschema`` at the end.

Each constrained row gets its own :class:`~millm_plugins.structured.constraint.JsonConstraint`
(a per-token processor with ``allowed_tokens``), so constrained rows share a batch with
unconstrained ones and ``n > 1`` is constrained per choice. ``finish_reason: "stop"``
means the model closed the document (EOS is allowed only then) and the server validated
it; ``"length"`` means ``max_tokens`` cut it. A closed document that does not validate is
a ``500 constrained_output_invalid``, never a 200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from millm_core.api import (
    AppContext,
    Capability,
    ForwardPlan,
    Problem,
    RequestContext,
    RequestField,
    RowInfo,
    ServedModel,
    hookimpl,
)

from .automata import automata, shutdown_automata
from .budget import schema_pattern_problems
from .cache import ready_vocab, shutdown, vocab_for
from .formats import JsonObjectFormat, JsonSchemaFormat, ResponseFormat, TextFormat, constrained_header
from .lazy import LazyConstraint
from .lowering import schema_patterns
from .schema import ResponseFormatUnsupported, check_schema

NAME = "structured"
HEADER = "X-miLLM-Constrained"
PARAM = "response_format"
SCHEMA_PARAM = "response_format.json_schema.schema"
DESCRIPTION = "response_format.json_schema.description"

RESPONSE_FORMAT: RequestField[ResponseFormat] = RequestField(
    "response_format",
    ResponseFormat,
    ("chat.completions",),
    owner=NAME,
    neutral=lambda v: isinstance(v, TextFormat) or v == {"type": "text"},
    requires=Capability.STRUCTURED_OUTPUT,
    description="constrain the reply to one JSON object (json_object) or to a JSON Schema (json_schema)",
)


def constraint_of(request: Any) -> JsonObjectFormat | JsonSchemaFormat | None:
    """The request's constraint, or None for plain text."""
    fmt = RESPONSE_FORMAT.get(request)
    return fmt if isinstance(fmt, JsonObjectFormat | JsonSchemaFormat) else None


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(RESPONSE_FORMAT)


@hookimpl
def millm_model_loaded(app: AppContext, model: ServedModel) -> None:
    """Start building the model's constraint vocabulary now, off the event loop."""
    if Capability.STRUCTURED_OUTPUT in model.capabilities:
        vocab_for(app, model)


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    fmt = constraint_of(request)
    if fmt is None:
        return []
    problems: list[Problem] = []
    stop = getattr(request, "stop", None)
    if stop:
        problems.append(
            Problem(
                "response_format cannot be combined with stop: a stop string could cut the document and report it complete",
                param=PARAM,
                code=ResponseFormatUnsupported.code,
            )
        )
    if isinstance(fmt, JsonSchemaFormat):
        if isinstance(fmt.json_schema.description, str) and fmt.json_schema.description:
            ctx.ignored_fields.append(DESCRIPTION)  # OpenAI shows it to the model; nothing here does
        try:
            check_schema(fmt.json_schema.schema, SCHEMA_PARAM)  # the metaschema check included
        except ResponseFormatUnsupported as exc:
            problems.append(Problem(exc.message, param=exc.param or SCHEMA_PARAM, code=exc.code))
        else:  # a refused schema's patterns are not costed too: it may hold any number of them
            for pointer, reason in schema_pattern_problems(fmt.json_schema.schema):
                problems.append(Problem(f"{reason} at {pointer}", param=SCHEMA_PARAM, code=ResponseFormatUnsupported.code))
    return problems


@hookimpl
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    fmt = constraint_of(request)
    if fmt is None:
        return
    assert ctx.model is not None  # resolved before any pre-forward
    schema = fmt.json_schema.schema if isinstance(fmt, JsonSchemaFormat) else None
    vocab = ready_vocab(ctx.app, ctx.model)
    ctx.set_header(HEADER, constrained_header(fmt))
    built: dict[str, Any] = {}  # the schema's pattern automata, filled before the rows run
    patterns = schema_patterns(schema)
    if patterns:
        plan.add_wait(automata(ctx.app).wait(patterns, built, lambda reason: ResponseFormatUnsupported(reason, param=SCHEMA_PARAM), ctx))

    def constrain(_row: RowInfo) -> LazyConstraint:
        return LazyConstraint.json(vocab, schema, automata=built)

    plan.add_processor(constrain)


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    shutdown(app)
    shutdown_automata(app)
