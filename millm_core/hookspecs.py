"""Every millm hook, in the order a server meets them.

Start-up hooks run once while the app starts; request hooks run for every chat or text
completion, in this order: ``millm_resolve`` → (the core's field-policy check against
the resolved engine) → ``millm_validate`` → ``millm_execute`` (who serves it); for generation then ``millm_pre_forward`` → (the per-token stage: the
:class:`~millm_core.engine.TokenProcessor` objects contributed in pre-forward, run by the
core at every decode step) → ``millm_finalize``.

Contribution hooks take a ``register`` callback rather than returning values, so that
one plugin can contribute several things and the call site stays typed. Call hooks only
through :class:`millm_core.plugins.PluginHost`, with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from starlette.responses import Response

    from .commands import Command
    from .config import PluginSetting, Settings
    from .context import RequestContext
    from .engine import EngineFactory, ModelSource
    from .fields import FieldRule
    from .pipeline_types import Finalization, ForwardPlan, Outcome, Problem
    from .registry import ModelRegistry, ServedModel

PROJECT = "millm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------- start-up hooks


@hookspec
def millm_register_engines(register: Callable[[EngineFactory], None]) -> None:
    """Offer engines. Call ``register(EngineFactory(...))`` once per engine.

    Return: nothing. Importing heavy libraries (torch, llama_cpp) belongs in the
    factory's ``load``, never at plugin import time.
    """


@hookspec
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    """Offer named models that can be made available locally (e.g. weights shipped in a
    package). Call ``register(ModelSource(...))``.

    Return: nothing.
    """


@hookspec(firstresult=True)
def millm_default_model(settings: Settings) -> str | None:
    """Name the model served when the operator names none (``--model`` absent).

    Return: a model name or path, or None to let another plugin answer. The first
    non-None answer wins.
    """


@hookspec
def millm_register_settings(register: Callable[[PluginSetting], None]) -> None:
    """Declare settings: ``register(PluginSetting(name, default, help, parse))``. Each
    becomes a ``millm serve --<name>`` flag and a ``MILLM_<NAME>`` environment variable;
    read the value with ``ctx.settings.plugin(name)``. Names must not shadow a core
    setting or another plugin's.

    Return: nothing. Declared by every installed plugin, enabled or not, so that the
    command line is the same whatever the allow-list.
    """


@hookspec
def millm_register_fields(register: Callable[[FieldRule], None]) -> None:
    """Declare which request fields this plugin honours, on which endpoints, with which
    engine capability. A non-neutral field nothing honours is refused with
    ``400 field_not_honoured``.

    Return: nothing.
    """


@hookspec
def millm_register_schemas(register: Callable[[str, type], None]) -> None:
    """Add a response shape to the published OpenAPI document: ``register(path, Struct)``
    makes the Struct one more possible 200 body of ``path`` (for example the scoring
    plugin's scored completion on ``/v1/completions``).

    Return: nothing.
    """


@hookspec
def millm_register_commands(register: Callable[[Command], None]) -> None:
    """Add ``millm`` subcommands: ``register(Command(name, help, configure, run))``.
    ``configure(parser)`` adds the command's arguments beside the server's settings flags;
    ``run(args, settings)`` returns the exit status. Raise
    :class:`~millm_core.errors.ConfigError` for a usage error (exit status 2).

    Return: nothing.
    """


@hookspec
def millm_register_routes(register: Callable[..., None]) -> None:
    """Add HTTP routes: ``register(path, endpoint, methods, doc=None)`` with a Starlette
    endpoint ``async def endpoint(request) -> Response``. Shared objects are on
    ``request.app.state.millm``. A ``doc`` (:class:`~millm_core.openapi.RouteDoc`: summary,
    request and response Structs, status, error statuses) puts the route in the served
    OpenAPI document; raise :class:`~millm_core.errors.MillmError` subclasses for errors so
    they take the API's error shape.

    Return: nothing.
    """


# ---------------------------------------------------------------- request hooks


@hookspec
def millm_validate(ctx: RequestContext, request: Any) -> Iterable[Problem] | None:
    """Check a decoded request before anything runs. ``request`` is a
    :class:`~millm_core.contracts.chat.ChatCompletionRequest` or
    :class:`~millm_core.contracts.completions.CompletionRequest`.

    Return: problems (or None). The core turns all problems of all plugins into one error
    response (the first problem sets status, code and param; the message lists them all).
    Must not mutate the request or any shared state.
    """


@hookspec(firstresult=True)
def millm_resolve(ctx: RequestContext, request: Any, models: ModelRegistry) -> ServedModel | None:
    """Choose the model that serves this request.

    Return: a :class:`~millm_core.registry.ServedModel`, or None to defer. The core's own
    implementation runs last (``trylast``): it matches ``request.model`` against the served
    names and raises ``404 model_not_found``.
    """


@hookspec(firstresult=True)
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel, state: Any) -> Awaitable[Response] | None:
    """Run an admitted request and produce its response. The first plugin that returns
    an awaitable serves the request: the ``scoring`` plugin takes scoring-mode requests
    (one forward pass, nothing generated); the ``sampling`` plugin (``trylast``) generates.
    When no enabled plugin takes a request it is refused with ``400 field_not_honoured``,
    so a scoring-only server runs no generation code at all.

    ``state`` is the app's shared state (scheduler, plugin host, settings). Model code must
    run on the scheduler's thread (``state.scheduler.call``). Return None to pass.
    """


@hookspec
def millm_pre_forward(ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
    """Contribute to how this request runs: sampling parameters, token processors (the
    per-token stage), response headers known before generation.

    Return: nothing; mutate ``plan`` (which belongs to this request alone). Never mutate
    global state for one request.
    """


@hookspec
def millm_finalize(ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
    """After generation: contribute response headers (non-streamed responses), body
    extensions (top-level keys; on a stream they arrive in one closing chunk with
    ``choices: []`` before ``[DONE]``) and usage details.

    Return: nothing; write into ``out``. Read what ran from ``outcome``, never echo the
    request.
    """
