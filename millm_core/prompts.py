"""A request's prompt token ids and its token budget, shared by generation and scoring."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import msgspec

from .context import RequestContext
from .contracts.chat import ChatCompletionRequest
from .contracts.completions import CompletionRequest
from .engine import Capability
from .errors import ContextLengthExceeded, InvalidRequest, MillmError, ServiceUnavailable
from .pipeline_types import ChatRender
from .registry import ServedModel
from .templatevars import key_location, template_variables

# Message fields every chat render reads; a plugin that renders another names it in
# ``ChatRender.rendered_fields``, and any other sent message field is reported unused.
RENDERED_MESSAGE_FIELDS = frozenset({"role", "content"})


def _sent(value: Any) -> bool:
    return value is not None and value is not msgspec.UNSET


def _int(value: Any) -> int:
    """A sent integer field (callers check ``_sent`` first)."""
    assert isinstance(value, int)
    return value


def _where(conversation: int) -> str:
    """The location of a conversation's messages in the request body."""
    return "messages" if conversation == 0 else f"extra_messages[{conversation - 1}]"


def _unread_message_fields(chat: ChatRender) -> list[str]:
    unread: list[str] = []
    for index, message in enumerate(chat.source):
        for name in message.__struct_fields__:
            if name not in RENDERED_MESSAGE_FIELDS and name not in chat.rendered_fields and _sent(getattr(message, name)):
                unread.append(f"{_where(chat.conversation)}[{index}].{name}")
    return unread


def _unread_kwargs(engine: Any, kwargs: dict[str, Any], read: set[str]) -> list[str]:
    """The request's template kwargs that neither the engine's chat template nor a plugin
    reads. Only an engine that exposes its template's Jinja source (``chat_template``) can
    tell; from any other nothing is reported."""
    source = getattr(engine, "chat_template", None)
    variables = template_variables(source) if isinstance(source, str) and kwargs else None
    if variables is None:
        return []
    return [key for key in kwargs if key not in variables and key not in read]


def with_opening(messages: list[dict[str, Any]], opening: str) -> list[dict[str, Any]]:
    """The chat continued with ``opening``: appended to a trailing assistant message
    (a partial answer), else as a new one (see :mod:`millm_core.chatformat`)."""
    if not opening:
        return messages
    if len(messages) > 1 and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content") or "", str):
        last = dict(messages[-1])
        last["content"] = (last.get("content") or "") + opening
        return [*messages[:-1], last]
    return [*messages, {"role": "assistant", "content": opening}]


def prompt_ids(
    ctx: RequestContext,
    request: ChatCompletionRequest | CompletionRequest,
    model: ServedModel,
    adjust: Callable[[ChatRender], None] | None = None,
) -> list[list[int]]:
    """The request's prompt token ids, exactly as generation tokenises them (one BOS rule,
    the chat template with its ``chat_template_kwargs``, ``add_special_tokens``). Scoring
    uses the same function, so a scored prompt is the prompt generation would see. The
    core renders them once per request, off the event loop (``adjust`` runs the plugins'
    ``millm_render_chat`` on a chat first); later calls return those."""
    if ctx.prompts is not None:
        return ctx.prompts
    engine = model.engine
    if isinstance(request, ChatCompletionRequest):
        kwargs: dict[str, Any] = request.chat_template_kwargs if isinstance(request.chat_template_kwargs, dict) else {}
        if kwargs and Capability.CHAT_TEMPLATE_KWARGS not in model.capabilities:
            ctx.ignored_fields.append("chat_template_kwargs")  # accepted, and said to be unused
            kwargs = {}
        if "tools" in kwargs:  # the render's own parameter, set by plugins (the request's ``tools``)
            raise InvalidRequest("chat_template_kwargs may set template variables only; tools cannot be set by a request", param="chat_template_kwargs.tools")
        prompts: list[list[int]] = []
        read: set[str] = set()
        for conversation, sent in enumerate(request.conversations()):
            chat = ChatRender(
                messages=[{"role": m.role, "content": m.text()} for m in sent],
                template_kwargs=dict(kwargs),
                conversation=conversation,
                source=sent,
            )
            if adjust is not None:
                adjust(chat)
            read |= chat.read_kwargs
            ctx.ignored_fields.extend(_unread_message_fields(chat))
            messages = with_opening(chat.messages, chat.opening)
            try:
                if chat.tools is not None:
                    prompts.append(engine.render_chat(messages, tools=chat.tools, **chat.template_kwargs))
                else:
                    prompts.append(engine.render_chat(messages, **chat.template_kwargs))
            except MillmError as exc:
                if conversation and exc.param == "messages":  # name the conversation that failed
                    exc.param = _where(conversation)
                raise
        ctx.ignored_fields.extend(key_location(key) for key in _unread_kwargs(engine, kwargs, read))
        return prompts
    add_special = request.add_special_tokens if _sent(request.add_special_tokens) else True
    # An empty prompt is returned as is: each path refuses it with its own error.
    return [engine.encode(text, add_special_tokens=bool(add_special)) for text in request.prompts()]


def refuse_empty(request: CompletionRequest, prompts: list[list[int]], code: str = "invalid_parameter") -> None:
    """Refuse a prompt that tokenises to nothing, naming it."""
    for index, ids in enumerate(prompts):
        if not ids:
            param = "prompt" if isinstance(request.prompt, str) else f"prompt[{index}]"
            raise InvalidRequest("The prompt tokenises to nothing; send at least one token", code=code, param=param)


async def render_prompts(
    ctx: RequestContext,
    request: ChatCompletionRequest | CompletionRequest,
    model: ServedModel,
    pool: Executor,
    timeout_s: float,
    adjust: Callable[[ChatRender], None] | None = None,
) -> list[list[int]]:
    """Render and tokenise the request's prompts on ``pool`` (never on the event loop),
    refusing a render that takes longer than ``timeout_s``; the ids are kept on ``ctx``."""
    loop = asyncio.get_running_loop()
    started: list[bool] = []

    def render() -> list[list[int]]:
        started.append(True)
        return prompt_ids(ctx, request, model, adjust)

    try:
        ctx.prompts = await asyncio.wait_for(loop.run_in_executor(pool, render), timeout_s)
    except TimeoutError as exc:
        if not started:  # it waited behind other renders all along: overload, not this prompt
            raise ServiceUnavailable(
                f"the prompt waited {timeout_s:g} s for the text thread behind other requests; retry shortly", code="render_busy"
            ) from exc
        raise InvalidRequest(
            f"rendering and tokenising the prompt took longer than {timeout_s:g} s; send a shorter prompt",
            code="prompt_render_timeout",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        ) from exc
    return ctx.prompts


def token_budget(request: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], model: ServedModel, default: int) -> int:
    """The request's completion budget: its ``max_tokens`` (refused past the context
    window), else ``default`` within the window (``default`` 0: the whole window left)."""
    limit = model.info.context_length
    asked = request.max_tokens if _sent(request.max_tokens) else request.max_completion_tokens
    longest = max(len(p) for p in prompts)
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if _sent(asked):
        if longest + _int(asked) > limit:
            budget = "max_tokens" if _sent(request.max_tokens) else "max_completion_tokens"
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + _int(asked)} tokens ({longest} in the prompt, {asked} for the completion). "
                + (f"Shorten the prompt or lower '{budget}'." if longest < limit else "The prompt alone fills the context: shorten it."),
                param=budget if longest < limit else prompt_param,  # the field that has to change
            )
        return _int(asked)
    if longest >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, the prompt has "
            f"{longest} tokens, leaving no room for a completion. Shorten the prompt.",
            param=prompt_param,
        )
    return limit - longest if default == 0 else min(default, limit - longest)
