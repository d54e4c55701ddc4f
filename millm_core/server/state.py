"""Objects shared by every request, owned by the app's lifespan (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Settings
from ..fields import FieldPolicy
from ..plugins import PluginHost
from ..registry import ModelRegistry
from ..scheduler import Scheduler
from ..store import Store


@dataclass
class AppState:
    """Reachable from a route as ``request.app.state.millm``."""

    settings: Settings
    host: PluginHost
    models: ModelRegistry
    policy: FieldPolicy
    scheduler: Scheduler
    store: Store
    load_error: str | None = None
    loading: bool = False
    extra: dict[str, object] = field(default_factory=dict)
