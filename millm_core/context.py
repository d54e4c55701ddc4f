"""The two contexts hooks receive: :class:`AppContext` (the application's shared objects,
one per server, created before start-up hooks run) and :class:`RequestContext` (one
request's), each with a typed :class:`Stash` where plugins keep their own state (after
pytest's ``Stash``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, cast

from .config import Settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .registry import ModelRegistry, ServedModel
    from .store import Store

T = TypeVar("T")

Endpoint = Literal["chat.completions", "completions", "embeddings"]


class StashKey(Generic[T]):
    """A typed key: ``KEY = StashKey[int]()`` then ``ctx.stash[KEY] = 3``."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """A mapping from StashKey[T] to T; keys are compared by identity."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return cast(T, self._data[key])

    def get(self, key: StashKey[T], default: T) -> T:
        return cast(T, self._data.get(key, default))

    def __contains__(self, key: StashKey[Any]) -> bool:
        return key in self._data

    def setdefault(self, key: StashKey[T], factory: Callable[[], T]) -> T:
        """The value under ``key``, created with ``factory()`` the first time."""
        if key not in self._data:
            self._data[key] = factory()
        return cast(T, self._data[key])


class ModelThread(Protocol):
    """The one thread that runs model code (the scheduler's)."""

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the model thread between decode steps; its result or error
        arrives on the future."""


@dataclass
class AppContext:
    """What a plugin may reach of the running server: its settings, the served models,
    the database, the model thread and a stash for the plugin's own state. Created once
    per app, before ``millm_startup``; the same object is ``RequestContext.app``."""

    settings: Settings
    models: ModelRegistry
    store: Store
    model_thread: ModelThread
    # The app's Prometheus registry (``GET /metrics``): plugins may register their own metrics.
    metrics: CollectorRegistry
    # The thread that renders chat templates and tokenises, off the event loop.
    text_thread: Executor
    stash: Stash = field(default_factory=lambda: Stash())

    async def run_model(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread (all model code runs there) and await it."""
        return await asyncio.wrap_future(self.model_thread.call(fn))

    async def run_text(self, fn: Callable[[], T]) -> T:
        """Run tokenising or other text work ``fn`` off the event loop, on the thread the
        core tokenises prompts on (one: tokenizers are not safe across threads)."""
        return await asyncio.get_running_loop().run_in_executor(self.text_thread, fn)


@dataclass
class RequestContext:
    """One request's context, created by the core and passed to every request hook.

    Plugins add response headers with :meth:`set_header` (any time before the response
    starts: in validate or pre-forward for a stream) and keep private state in ``stash``.
    """

    request_id: str
    endpoint: Endpoint
    settings: Settings
    # The request's headers by lower-case name; a repeated header's values joined with ", ".
    headers: dict[str, str]
    app: AppContext
    stream: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)  # for latency metrics
    response_headers: dict[str, str] = field(default_factory=dict)
    ignored_fields: list[str] = field(default_factory=list)
    stash: Stash = field(default_factory=Stash)
    # The model serving this request, once ``millm_resolve`` chose it (every hook after
    # ``millm_validate``'s field policy check sees it set).
    model: ServedModel | None = None
    # The prompt token ids, once the core rendered them (chat and text completions).
    prompts: list[list[int]] | None = None
    # Fields added to this request's access-log line (the core adds token counts).
    access_log: dict[str, object] = field(default_factory=dict)
    # Whether naming a model that is not loaded may unload the resident to load it
    # (--auto-load). False for work that must never evict the model live traffic uses
    # (the Batch API's lines, while a model is loaded): it waits for its model instead.
    may_switch: bool = True

    def set_header(self, name: str, value: str) -> None:
        self.response_headers[name] = value
