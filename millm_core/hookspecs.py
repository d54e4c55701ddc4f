"""Every millm hook, in the order a server meets them.

Registration hooks run while the app is built; lifecycle hooks when it starts, when a
model is loaded and when it stops. Request hooks run for every request to
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``, in this order:
(for a request naming a model that is not loaded: ``millm_requested_model`` →
``millm_validate_switch`` → ``millm_model_unloading`` → the switch) → ``millm_resolve`` → (the core's field-policy check against the resolved engine) →
``millm_validate`` → ``millm_execute`` (who serves it). For generation then
``millm_pre_forward`` → (the per-token stage: the
:class:`~millm_core.engine.TokenProcessor` objects contributed in pre-forward, run by the
core at every decode step) → ``millm_finalize``; for a computed reply (scoring,
embeddings) ``millm_finalize`` follows the computation.

Contribution hooks take a ``register`` callback rather than returning values, so that
one plugin can contribute several things and the call site stays typed. Call hooks only
through :class:`millm_core.plugins.PluginHost`, with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .commands import Command
    from .config import PluginSetting, Settings
    from .context import AppContext, RequestContext
    from .engine import EngineFactory, ModelLocation, ModelSource
    from .fields import FieldRule
    from .pipeline_types import ChatRender, Execution, Finalization, ForwardPlan, Outcome, Problem
    from .registry import ModelRegistry, ServedModel, SwitchTarget
    from .requestfields import RequestField

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
def millm_locate_model(name: str, settings: Settings) -> ModelLocation | None:
    """Find a model that ``--model`` names and that is neither a local path nor a
    registered :class:`~millm_core.engine.ModelSource` (for example an entry of the local
    Hugging Face cache). Never download anything.

    Return: its location, or None to let another plugin answer. The first non-None
    answer wins.
    """


@hookspec(firstresult=True)
def millm_default_model(settings: Settings) -> str | None:
    """Name the model served when the operator names none (``--model`` absent).

    Return: a model name or path, or None to let another plugin answer. The first
    non-None answer wins.
    """


@hookspec
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    """Declare settings: ``register(SETTING)`` with ``SETTING = PluginSetting(name,
    default, help, parse)``. Each becomes a ``millm serve --<name>`` flag and a
    ``MILLM_<NAME>`` environment variable; read the typed value with
    ``SETTING.get(settings)``. Names must not shadow a core
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
def millm_register_request_fields(register: Callable[[RequestField[Any]], None]) -> None:
    """Declare the request fields this plugin owns: ``register(RequestField(name, type,
    endpoints, owner, neutral=…, requires=…))``. The core joins them onto each endpoint's
    request type at start-up, so they are decoded and range-checked in the one typed pass,
    published in ``/v1/openapi.json``, listed in ``/api/policy`` and honoured on the
    endpoints named (when the engine has ``requires``). Read a value with
    ``FIELD.get(request)``. A name the core or another enabled plugin already declares on
    an endpoint stops the server at start-up.

    Return: nothing. Called only for enabled plugins.
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
    ``configure(parser, add_settings)`` adds the command's arguments, and calls
    ``add_settings(p)`` on each parser that takes the server's settings flags;
    ``run(args, settings)`` returns the exit status. Raise
    :class:`~millm_core.errors.ConfigError` for a usage error (exit status 2).

    Return: nothing.
    """


@hookspec
def millm_register_routes(register: Callable[..., None]) -> None:
    """Add HTTP routes: ``register(path, endpoint, methods, doc=None)`` with a Starlette
    endpoint ``async def endpoint(request) -> Response``. The application context is
    ``millm_core.api.app_context(request)``. A ``doc`` (:class:`~millm_core.openapi.RouteDoc`: summary,
    request and response Structs, status, error statuses) puts the route in the served
    OpenAPI document; raise :class:`~millm_core.errors.MillmError` subclasses for errors so
    they take the API's error shape.

    Return: nothing.
    """


# ---------------------------------------------------------------- lifecycle hooks


@hookspec
def millm_startup(app: AppContext) -> None:
    """The server is starting: create the plugin's state (``app.stash[KEY] = …``) and run
    its migrations (``app.store.migrate(namespace, statements)``). Runs before the server
    answers anything but health; an exception stops the server with its message, so a bad
    database never turns into a 500 on every request.

    Return: nothing.
    """


@hookspec
def millm_model_loaded(app: AppContext, model: ServedModel) -> None:
    """``model`` is loaded. A model loaded while the server starts joins ``app.models``
    (and readiness turns 200) only after every implementation returned. Runs on the event
    loop: keep it short.

    Return: nothing. An exception marks the load as failed (readiness says why).
    """


@hookspec
def millm_model_unloaded(app: AppContext, model: ServedModel) -> None:
    """``model`` was unloaded (``POST /api/models/{id}/unload``): its requests have ended
    and it has left ``app.models``. Detach what the plugin tied to it (per-model caches,
    reports about it). Runs on the event loop: keep it short. Every implementation runs
    even if one raises (the error is logged).

    Return: nothing.
    """


@hookspec
def millm_model_unloading(app: AppContext, model: ServedModel) -> None:
    """``model`` is about to be unloaded (``POST /api/models/{id}/unload``, or a request
    naming another model, which unloads the resident first), before anything is moved.
    Raise a :class:`~millm_core.errors.MillmError` to keep it loaded: nothing is unloaded
    and the request or the unload answers with that error (for example ``409
    weights_unsaved`` for a model whose weights carry edits no checkpoint records). Runs
    on the event loop: keep it short.

    Return: nothing.
    """


@hookspec
def millm_shutdown(app: AppContext) -> None:
    """The server is stopping, after the last request: release what ``millm_startup``
    created. Every implementation runs even if one raises (the error is logged).

    Return: nothing.
    """


# ---------------------------------------------------------------- request hooks


@hookspec(firstresult=True)
def millm_resolve(ctx: RequestContext, request: Any, models: ModelRegistry) -> ServedModel | None:
    """Choose the model that serves this request.

    Return: a :class:`~millm_core.registry.ServedModel`, or None to defer. The core's own
    implementation runs last (``trylast``): it matches ``request.model`` against the served
    names and raises ``404 model_not_found``.
    """


@hookspec(firstresult=True)
def millm_requested_model(ctx: RequestContext, request: Any) -> str | None:
    """The name of the model a request asks for, when a plugin reads ``request.model``
    otherwise than as a served name (the lanes plugin: ``model@agent`` names ``model``).
    Consulted only when no served model resolves the request, to load the model it names
    (``--auto-load``). The core's implementation runs last and answers ``request.model``.

    Return: a model name, or None to defer.
    """


@hookspec
def millm_validate_switch(ctx: RequestContext, request: Any, target: SwitchTarget) -> Iterable[Problem] | None:
    """The request names ``target``, a model that is not loaded: before the resident
    model is unloaded and ``target`` loaded for it, refuse what the request could never
    get on ``target`` (the steering plugin: steering for a model that has no SAE attached
    for it). Only what is known without the model loaded: the full validation
    (``millm_validate``) runs once it is.

    Return: problems (or None); any problem refuses the request and nothing is unloaded.
    """


@hookspec
def millm_validate(ctx: RequestContext, request: Any) -> Iterable[Problem] | None:
    """Check a decoded request before anything runs: after the model is resolved and the
    field policy passed, before any tokenisation. ``request`` is the endpoint's request
    type (:class:`~millm_core.contracts.chat.ChatCompletionRequest`,
    :class:`~millm_core.contracts.completions.CompletionRequest` or
    :class:`~millm_core.contracts.embeddings.EmbeddingRequest`, with the enabled plugins'
    fields); ``ctx.endpoint`` says which. A plugin may report a field it will not use
    (``ctx.ignored_fields.append(location)``); strict mode is decided after every hook ran.

    Return: problems (or None). The core turns all problems of all plugins into one error
    response (the first problem sets status, code and param; the message lists them all).
    Must not mutate the request or any shared state.
    """


@hookspec(firstresult=True)
def millm_execute(ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
    """Decide who serves an admitted request. The first plugin that answers serves it:
    :class:`~millm_core.pipeline_types.Generate` hands it to the core's decode loop (the
    ``sampling`` plugin, ``trylast``); :class:`~millm_core.pipeline_types.Compute` runs the
    plugin's own computation, which returns a :class:`~millm_core.pipeline_types.Reply`
    (the ``scoring`` plugin for scoring-mode requests, ``embeddings`` on its endpoint).
    Model code must run on the model thread (``ctx.app.run_model(fn)``). When no enabled
    plugin answers, the request is refused with ``400 field_not_honoured``, so a
    scoring-only server runs no generation code at all. Never build an HTTP response:
    the core encodes the reply, adds the common headers and runs ``millm_finalize``.

    Return: an execution, or None to pass.
    """


@hookspec
def millm_render_chat(ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
    """Adjust how a chat request is rendered, before the engine's chat template runs:
    add message fields, the template's ``tools``, or an ``opening`` the assistant's turn
    starts with (see :class:`~millm_core.pipeline_types.ChatRender`). Runs once for every
    chat request that renders a prompt (generation and scoring), after validation and
    before ``millm_execute``, off the event loop, on the text thread.

    Return: nothing; mutate ``chat`` (it belongs to this request alone). A refusal
    raised here (a :class:`~millm_core.errors.MillmError`) answers the request before
    anything runs.
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
    """After the request ran, on every endpoint and path: contribute response headers
    (non-streamed responses), body extensions (top-level keys; on a stream each arrives
    in a closing chunk with ``choices: []`` before ``[DONE]``, in the order
    :meth:`Finalization.extend` gives) and usage details. ``outcome.kind`` says which
    path ran (``generation``, ``scoring``, ``embeddings``).

    A stream whose client left before its end still gets this call, with
    ``outcome.cancelled`` true and the rows as far as they ran (their finish reason
    ``cancelled``): nothing written into ``out`` is sent then, but a plugin can record
    what happened (for example a monitor's interrupted result).

    Return: nothing; write into ``out``. Read what ran from ``outcome``, never echo the
    request. Write only your own plugin's headers.
    """
