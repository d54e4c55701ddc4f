"""Objects shared by every request, owned by the app's lifespan (no module globals).

:class:`AppState` is the server's private side; plugins see only its
:class:`~millm_core.context.AppContext` (``state.app``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..config import Settings
from ..context import AppContext, Endpoint
from ..fields import FieldPolicy
from ..ledger import MemoryLedger
from ..lifecycle import ModelLifecycle
from ..metrics import Metrics
from ..plugins import PluginHost
from ..registry import ModelRegistry
from ..scheduler import Scheduler


@dataclass
class AppState:
    """Reachable from a route as ``request.app.state.millm``."""

    app: AppContext
    host: PluginHost
    policy: FieldPolicy
    scheduler: Scheduler
    # Each endpoint's request type: the core's contract joined with the plugins' fields.
    request_types: dict[Endpoint, type[msgspec.Struct]]
    # One thread renders chat templates and tokenises prompts, off the event loop (one:
    # a tokenizer is not safe to drive from several threads at once).
    render_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="millm-render"))
    metrics: Metrics = field(default_factory=lambda: Metrics())
    # Rows admitted by memory and not finished (see millm_core/ledger.py).
    memory: MemoryLedger = field(default_factory=lambda: MemoryLedger())
    # Loads and unloads in progress, the lock, the requests running per model.
    lifecycle: ModelLifecycle = field(default_factory=lambda: ModelLifecycle())
    serves_embeddings: bool = False
    openapi_json: bytes = b""
    docs_html: str = ""
    load_error: str | None = None
    loading: bool = False

    @property
    def settings(self) -> Settings:
        return self.app.settings

    @property
    def models(self) -> ModelRegistry:
        return self.app.models


def app_state(request: Any) -> AppState:
    """The server's state, from a starlette request (``request.app.state.millm``)."""
    state: AppState = request.app.state.millm
    return state
