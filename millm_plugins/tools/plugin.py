"""Function calling: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on
``/v1/chat/completions``, streamed or not.

The tools are shown to the model by its own chat template (``tools=``); the call format
is read off that template (:func:`~millm_plugins.tools.formats.detect_format`), never
off the model's name. The reply is parsed back into ``tool_calls`` by a per-token
processor (:class:`~millm_plugins.tools.processor.ToolCalls`). ``required`` and a named
function open the call in the assistant's turn; a named call's arguments are then
constrained to the function's ``parameters`` with the structured-output machinery, so a
forced call always parses and validates.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from millm_core.api import (
    AppContext,
    Capability,
    ChatRender,
    ForwardPlan,
    InvalidRequest,
    MillmError,
    PassThrough,
    Problem,
    RequestContext,
    RequestField,
    RowInfo,
    ServedModel,
    StashKey,
    TokenProcessor,
    hookimpl,
)
from millm_plugins.structured.public import (
    MAX_BYTES,
    MAX_DEPTH,
    LazyConstraint,
    ResponseFormatUnsupported,
    automata,
    check_schema,
    check_validator,
    constraint_of,
    pattern_problem,
    ready_vocab,
    schema_pattern_problems,
    schema_patterns,
    shutdown_automata,
    vocab_for,
)

from .fields import MAX_TOOLS, Tool, ToolChoice, forced_name, tool_dicts, unset
from .formats import CallFormat, ForcedCall, detect_format, takes_tools
from .formats.base import parameters_of
from .pattern import pattern_parser
from .processor import ToolCalls, special_markers

log = structlog.get_logger("millm.tools")

NAME = "tools"
# A parameters schema's JSON nesting (a subschema level is two JSON levels: "properties", then the name).
MAX_JSON_DEPTH = 2 * MAX_DEPTH + 4
CONSTRAINED_HEADER = "X-miLLM-Constrained"

TOOLS: RequestField[list[Tool]] = RequestField(
    "tools",
    list[Tool],
    ("chat.completions",),
    owner=NAME,
    neutral=lambda v: v == [],
    requires=Capability.TOOLS,
    condition="the model's chat template takes tools in a known call format (else 400 naming tools)",
    description="functions the model may call (OpenAI function calling)",
)
TOOL_CHOICE: RequestField[ToolChoice] = RequestField(
    "tool_choice",
    ToolChoice,
    ("chat.completions",),
    owner=NAME,
    neutral=lambda v: v == "none",
    requires=Capability.TOOLS,
    description='"auto" (default with tools), "none", "required", or {"type": "function", "function": {"name": …}}',
)
PARALLEL: RequestField[bool] = RequestField(
    "parallel_tool_calls",
    bool,
    ("chat.completions",),
    owner=NAME,
    neutral=lambda v: v is True,
    requires=Capability.TOOLS,
    description="false: at most one call per reply",
)


class Calling:
    """How this request calls tools, decided while its prompt is rendered."""

    def __init__(
        self,
        fmt: CallFormat,
        offered: frozenset[str],
        parallel: bool,
        forced: ForcedCall | None,
        constrained: bool,
        schemas: dict[str, dict[str, Any]],
    ) -> None:
        self.fmt = fmt
        self.offered = offered
        self.parallel = parallel
        self.forced = forced
        self.constrained = constrained
        self.schemas = schemas  # a constrained forced call's functions: its arguments are validated


CALLING = StashKey[Calling]("tools.calling")


def _choice(request: Any) -> ToolChoice:
    choice = TOOL_CHOICE.get(request)
    return choice if choice is not None else "auto"


def _active(request: Any) -> bool:
    """Tools are shown: some were sent and ``tool_choice`` is not ``none``."""
    return bool(TOOLS.get(request)) and _choice(request) != "none"


@hookimpl
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    register(TOOLS)
    register(TOOL_CHOICE)
    register(PARALLEL)


@hookimpl
def millm_model_loaded(app: AppContext, model: ServedModel) -> None:
    """Forced calls are constrained: start building the constraint vocabulary now."""
    if Capability.STRUCTURED_OUTPUT in model.capabilities and Capability.TOOLS in model.capabilities:
        vocab_for(app, model)


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    return takes_tools(template)


@functools.lru_cache(maxsize=16)
def _format_of(template: str) -> CallFormat | None:
    return detect_format(template)


def _template_of(model: ServedModel | None) -> str | None:
    template = getattr(model.engine, "chat_template", None) if model is not None else None
    return template if isinstance(template, str) and template else None


def _template_problem(model: ServedModel | None) -> Problem | None:
    """Why this model's template cannot serve tools (None: it can)."""
    template = _template_of(model)
    name = model.info.served_name if model is not None else "this model"
    if template is None:
        return Problem(f"'{name}' has no chat template, so it cannot be shown tools", param="tools", code="field_not_honoured")
    if not _reads_tools(template):
        return Problem(
            f"the chat template of '{name}' takes no tools; serve it with --chat-template naming a template that does",
            param="tools",
            code="field_not_honoured",
        )
    if _format_of(template) is None:
        return Problem(
            f"the chat template of '{name}' writes tool calls in a format millm does not parse "
            "(known: Hermes <tool_call> JSON, pythonic <|tool_call_start|>, Llama 3 JSON)",
            param="tools",
            code="field_not_honoured",
        )
    return None


@hookimpl
def millm_validate(ctx: RequestContext, request: Any) -> list[Problem]:
    if ctx.endpoint != "chat.completions":
        return []
    tools = TOOLS.get(request) or []
    choice = _choice(request)
    name = forced_name(choice)
    problems: list[Problem] = []
    if len(tools) > MAX_TOOLS:  # nothing else is checked: the list may be of any length
        return [Problem(f"at most {MAX_TOOLS} tools per request; this one has {len(tools)}", param="tools")]
    names = [t.function.name for t in tools]
    for index, tool in enumerate(tools):
        parameters = tool.function.parameters
        if isinstance(parameters, dict):
            too_big = _too_big(parameters)
            if too_big:
                problems.append(Problem(f"the parameters schema {too_big}", param=f"tools[{index}].function.parameters"))
            elif (kind := _not_an_object(parameters)) is not None:
                problems.append(
                    Problem(
                        f'a function\'s parameters must be a JSON Schema of type "object" (its arguments are a JSON object), not type {kind}',
                        param=f"tools[{index}].function.parameters",
                    )
                )
    if PARALLEL.sent(request) and not tools:
        ctx.ignored_fields.append("parallel_tool_calls")
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    if duplicates:
        problems.append(Problem(f"tool names must be unique; repeated: {', '.join(duplicates)}", param="tools"))
    if choice == "required" and not tools:
        problems.append(Problem('tool_choice "required" needs tools', param="tool_choice"))
    elif choice == "auto" and TOOL_CHOICE.sent(request) and not tools:  # as OpenAI: "none" alone asks for nothing
        problems.append(Problem('tool_choice "auto" needs tools; send tools, or leave tool_choice out', param="tool_choice"))
    if name is not None and name not in names:
        problems.append(Problem(f"tool_choice names {name!r}, which is not in tools", param="tool_choice"))
    if not _active(request):
        return problems
    if constraint_of(request) is not None:
        problems.append(Problem("tools cannot be combined with a JSON response_format", param="tools", code="field_not_honoured"))
    template = _template_problem(ctx.model)
    if template is not None:
        problems.append(template)
    return problems


def _not_an_object(parameters: dict[str, Any]) -> str | None:
    """The ``type`` of a parameters schema that does not describe a JSON object (None when
    it does, or says nothing: an untyped schema is held to an object when constrained)."""
    kind = parameters.get("type", "object")
    if kind == "object" or kind == ["object"]:
        return None
    return json.dumps(kind)


def _too_big(schema: dict[str, Any]) -> str | None:
    """Why a parameters schema is beyond what the server takes (None: it is not): the
    structured-output limits, checked without recursion (a schema nested thousands deep
    must be a 400, never a RecursionError)."""
    if len(msgspec.json.encode(schema)) > MAX_BYTES:
        return f"exceeds {MAX_BYTES // 1024} KiB"
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nests deeper than {MAX_JSON_DEPTH} JSON levels"
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return None


def _history(chat: ChatRender, template: str) -> None:
    """Put the assistant messages' ``tool_calls`` (arguments as objects, which templates
    render with ``tojson``) and the tool messages' ``tool_call_id`` into the render, when
    the template reads them; otherwise they stay reported unused."""
    reads_calls, reads_ids = "tool_calls" in template, "tool_call_id" in template
    for message, target in zip(chat.source, chat.messages, strict=True):
        calls = message.tool_calls
        if reads_calls and isinstance(calls, list) and calls:
            target["tool_calls"] = [_call_for_template(c) for c in calls]
            chat.rendered_fields.add("tool_calls")
        if reads_ids and not unset(message.tool_call_id):
            target["tool_call_id"] = message.tool_call_id
            chat.rendered_fields.add("tool_call_id")


def _call_for_template(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    out = dict(call)
    function = out.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            out["function"] = {**function, "arguments": json.loads(function["arguments"])}
        except (ValueError, RecursionError):
            pass  # not JSON (or too deep to read): the template gets the string as sent
    return out


class _Unbuilt(MillmError):
    """A forced call's argument automaton that could not be built in time (caught: the
    arguments go unconstrained)."""


def _unheld_strict(ctx: RequestContext, tools: list[Tool]) -> None:
    """``strict: true`` asks for arguments held to the schema; where no call is
    constrained (``auto``, ``none``, arguments beyond the enforced subset) it is reported."""
    ctx.ignored_fields.extend(f"tools[{i}].function.strict" for i, t in enumerate(tools) if t.function.strict is True)


def _valid_schema(parameters: Any) -> bool:
    """Whether a tool's ``parameters`` is absent or a valid Draft 2020-12 schema."""
    if not isinstance(parameters, dict):
        return True
    try:
        check_validator(parameters, "tools")
    except ResponseFormatUnsupported:
        return False
    return True


@hookimpl(tryfirst=True)
def millm_render_chat(ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
    """First of the render hooks, while ``chat.messages`` still lines up with the
    request's messages."""
    template = _template_of(model)
    if ctx.endpoint != "chat.completions" or Capability.TOOLS not in model.capabilities or template is None:
        return
    _history(chat, template)
    if not _active(request):
        _unheld_strict(ctx, TOOLS.get(request) or [])
        return
    tools = TOOLS.get(request) or []
    fmt = _format_of(template)
    if fmt is None:  # refused in validate
        return
    offered = tool_dicts(tools)
    chat.tools = offered
    choice = _choice(request)
    forced: ForcedCall | None = None
    if choice == "required" or forced_name(choice) is not None:
        try:
            forced = fmt.forced(offered, forced_name(choice))
        except (ValueError, TypeError, RecursionError) as exc:  # a name this format cannot write ("get-weather" in pythonic)
            raise InvalidRequest(f"this model's call format cannot force that call: {exc}", param="tool_choice") from exc
        chat.opening = forced.opening
    constrained = False
    if forced is not None and Capability.STRUCTURED_OUTPUT in model.capabilities:
        if forced.pattern is not None:
            # A pattern too costly to compile, or parameters that are no valid schema (the
            # finished call could not be checked against them), leave the call unconstrained.
            named = forced_name(choice)
            callable_ = [t for t in tools if named is None or t.function.name == named]
            constrained = pattern_problem(forced.pattern) is None and all(_valid_schema(t.function.parameters) for t in callable_)
        elif forced.schema is not None:
            try:
                check_schema(forced.schema, "tools")
                # A pattern too costly to compile leaves the arguments unconstrained.
                constrained = not schema_pattern_problems(forced.schema)
            except ResponseFormatUnsupported:
                constrained = False  # arguments outside the enforced subset: the opening is still forced
    if not constrained:
        _unheld_strict(ctx, tools)
    parallel = PARALLEL.get(request)
    schemas = {t.function.name: parameters_of(msgspec.to_builtins(t.function)) for t in tools}
    ctx.stash[CALLING] = Calling(
        fmt, frozenset(t.function.name for t in tools), parallel is not False, forced, constrained, schemas if constrained else {}
    )


@hookimpl(tryfirst=True)
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    """The tool-call processor runs first, so that later processors (``stop``) never see
    text inside a call."""
    if CALLING not in ctx.stash:
        return
    calling = ctx.stash[CALLING]
    opening = calling.forced.opening if calling.forced is not None else ""
    markers = special_markers(ctx.model.engine, calling.fmt) if ctx.model is not None else {}

    # A forced call's argument automata are built before the rows run (see the wait below);
    # one that cannot be built in time leaves the arguments unconstrained, as a costly
    # pattern does at validation.
    held = {"constrained": calling.constrained}

    def calls(_row: RowInfo) -> TokenProcessor:
        schemas = calling.schemas if held["constrained"] else {}
        return ToolCalls(calling.fmt, calling.offered, parallel=calling.parallel, opening=opening, markers=markers, schemas=schemas)

    plan.add_processor(calls)
    if calling.constrained and calling.forced is not None and ctx.model is not None:
        vocab = ready_vocab(ctx.app, ctx.model)
        forced = calling.forced
        built: dict[str, Any] = {}  # the arguments' pattern automata, filled before the rows run
        patterns = {forced.pattern} if forced.pattern is not None else schema_patterns(forced.schema)
        tools = list(getattr(request, "tools", None) or [])
        if patterns:
            wait = automata(ctx.app).wait(patterns, built, _Unbuilt, ctx)

            async def arguments_built() -> None:
                try:
                    await wait()
                except _Unbuilt as exc:
                    held["constrained"] = False
                    _unheld_strict(ctx, tools)
                    log.warning("tool_arguments_unconstrained", reason=exc.message[:300])
                else:
                    ctx.set_header(CONSTRAINED_HEADER, "tool_arguments")

            plan.add_wait(arguments_built)
        else:
            ctx.set_header(CONSTRAINED_HEADER, "tool_arguments")

        def arguments(_row: RowInfo) -> TokenProcessor:
            if not held["constrained"]:
                return PassThrough()  # unconstrained: nothing to do
            if forced.pattern is not None:
                return LazyConstraint(vocab, lambda: pattern_parser(forced.pattern or "", forced.suffix, built.get(forced.pattern or "")))
            return LazyConstraint.json(vocab, forced.schema, forced.suffix, automata=built)

        plan.add_processor(arguments)


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    """Stop the argument automata's builds (the structured plugin may not be enabled)."""
    shutdown_automata(app)
