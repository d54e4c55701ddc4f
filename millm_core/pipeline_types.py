"""What request hooks exchange with the core: problems, the execution a plugin chose,
the forward plan, the outcome and the finalisation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from .engine import SamplingParams, Tap, TokenProcessor


@dataclass(frozen=True)
class Problem:
    """One reason to refuse a request. ``status``/``code``/``param`` follow the error
    table; the first problem of a request decides the response's status and code."""

    message: str
    param: str | None = None
    code: str = "invalid_parameter"
    status: int = 400


@dataclass
class ChatRender:
    """How a chat request becomes its prompt, built by the core and adjusted by plugins
    in ``millm_render_chat`` before the engine renders it. Belongs to this request alone.

    ``messages`` are the dicts the chat template sees (the core puts ``role`` and
    ``content`` in each); a plugin that adds a message field (``tool_calls``,
    ``tool_call_id``, …) names it in ``rendered_fields`` so that it is not reported as
    unused. ``tools`` becomes the template's ``tools`` variable (engines with
    :attr:`~millm_core.engine.Capability.TOOLS`). ``opening`` is text the assistant's turn
    starts with: it is part of the prompt, never of the response (a forced tool call's
    opening, for example). ``template_kwargs`` start as the request's
    ``chat_template_kwargs``; a plugin that acts on one of them itself (rather than
    leaving it to the template) names it in ``read_kwargs``, so that a key the template
    never reads is reported unused only when no plugin read it either. A request with ``extra_messages`` renders each conversation in
    its own ``ChatRender`` (``millm_render_chat`` runs once per conversation): read the
    sent messages from ``source``, never from ``request.messages``."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    opening: str = ""
    rendered_fields: set[str] = field(default_factory=set)
    read_kwargs: set[str] = field(default_factory=set)
    # Which of the request's conversations this is (0: ``messages``; i: ``extra_messages[i - 1]``)
    # and its messages as the request sent them (``ChatMessage``s, aligned with ``messages``).
    conversation: int = 0
    source: Sequence[Any] = ()


@dataclass(frozen=True)
class RowInfo:
    """What a processor factory knows about the row it builds for."""

    index: int
    prompt_index: int
    prompt_tokens: int
    prompt_ids: tuple[int, ...] = ()


ProcessorFactory = Callable[[RowInfo], TokenProcessor]


@dataclass
class ForwardPlan:
    """How one request runs; built in pre-forward, owned by that request alone."""

    sampling: SamplingParams
    max_new_tokens: int
    processor_factories: list[ProcessorFactory] = field(default_factory=list)
    # layer -> vector added to that block's output for this request's rows (steering).
    deltas: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # The scheduling lane: "interactive" (default) or "agent", served after interactive
    # work and never starved (a plugin sets it; see the lanes plugin).
    lane: str = "interactive"
    # The token count of each of the request's prompts (known before pre-forward).
    prompt_lengths: tuple[int, ...] = ()
    # Where this request's rows are read back (engines with Capability.TAPS): a plugin
    # adds a Tap and reads the vectors in its processors' ``on_residuals``.
    taps: set[Tap] = field(default_factory=set)
    # Work the request waits for before its rows join a batch (see ``add_wait``).
    waits: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def add_wait(self, wait: Callable[[], Awaitable[None]]) -> None:
        """Have the request await ``wait()`` on the event loop after pre-forward and before
        its rows are submitted, in the order added: for work a row needs that is built off
        the event loop and the model thread (a constraint's automaton on a thread of the
        plugin's own), so that neither waits for it. A
        :class:`~millm_core.errors.MillmError` it raises refuses the request; it must
        bound its own wait."""
        self.waits.append(wait)

    def add_processor(self, factory: ProcessorFactory, *, first: bool = False) -> None:
        """Register a per-row processor factory; processors run in registration order.
        ``first`` puts it before every processor added so far (a row owner, such as the
        reasoning plugin's, must see each token before the others do)."""
        if first:
            self.processor_factories.insert(0, factory)
        else:
            self.processor_factories.append(factory)


@dataclass(frozen=True)
class Generate:
    """``millm_execute``'s answer "generate this request": the core builds the prompt ids
    and token budget, runs ``millm_pre_forward``, the decode loop with its per-token stage,
    ``millm_finalize``, and answers with JSON or SSE."""


@dataclass(frozen=True)
class Reply:
    """A response body a plugin computed (scoring, embeddings): a Struct or plain data,
    the headers the plugin itself owns, and what ran, for ``millm_finalize``."""

    body: msgspec.Struct | dict[str, Any]
    outcome: Outcome
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Compute:
    """``millm_execute``'s answer "I compute this response": ``run()`` is awaited after
    every check passed (model code goes through ``AppContext.run_model``); the core adds
    the common headers, runs ``millm_finalize`` and encodes the body."""

    run: Callable[[], Awaitable[Reply]]


Execution = Generate | Compute


@dataclass(frozen=True)
class ChoiceResult:
    """One choice as it ran: its text, why it ended, its token count and the message
    fields processors added as it ended (``RowEnd.fields``, for example ``tool_calls``)."""

    index: int
    text: str
    finish_reason: str
    completion_tokens: int
    fields: dict[str, Any] | None = None


@dataclass(frozen=True)
class Outcome:
    """What actually ran, read after it ran. ``kind`` says which path served the request:
    ``generation`` (the decode loop), ``scoring`` (one forward pass, nothing generated) or
    ``embeddings``; a plugin's computed reply may name its own kind. ``cached_tokens``:
    the part of ``prompt_tokens`` the engine resumed from retained state instead of
    prefilling (``usage.prompt_tokens_details.cached_tokens``)."""

    choices: tuple[ChoiceResult, ...]
    prompt_tokens: int
    completion_tokens: int
    cancelled: bool = False
    kind: Literal["generation", "scoring", "embeddings"] | str = "generation"
    cached_tokens: int = 0


DEFAULT_CLOSING_ORDER = 50


@dataclass
class Finalization:
    """What finalize hooks contribute to the response: headers, and body extensions
    (``extensions[key] = value``: a top-level key beside ``choices`` in a JSON body; on a
    stream, one closing chunk ``{..., "choices": [], key: value}`` after the last choice's
    final chunk and before ``[DONE]``).

    Closing chunks go out in ascending ``order[key]`` (default
    :data:`DEFAULT_CLOSING_ORDER`), then by key; set an order with :meth:`extend`. The
    built-in plugins use: probe verdicts 10, SAE activations (``millm``) 20, steering 90
    (the built-in reports close with it; a plugin going after it does so on purpose)."""

    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)

    def extend(self, key: str, value: Any, *, order: int = DEFAULT_CLOSING_ORDER) -> None:
        """Add body extension ``key`` whose closing chunk goes out at ``order``."""
        self.extensions[key] = value
        self.order[key] = order

    def closing(self) -> list[tuple[str, Any]]:
        """The extensions in the order their closing chunks are sent."""
        return sorted(self.extensions.items(), key=lambda item: (self.order.get(item[0], DEFAULT_CLOSING_ORDER), item[0]))
