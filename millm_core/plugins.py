"""PluginHost: the typed facade over pluggy. Built-in and third-party plugins are found
the same way, through the ``millm`` entry-point group; the allow-list selects which
feature plugins run.

A plugin module may set ``MILLM_PLUGIN_KIND`` to ``"engine"`` or ``"models"``: those are
infrastructure and load unless blocked. Everything else is a feature plugin, loaded only
if the allow-list (``--plugins``) names it, or when there is no allow-list.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import pluggy
import structlog

from . import hookspecs
from .commands import Command
from .config import PluginSetting, Settings
from .context import AppContext, RequestContext
from .engine import EngineFactory, ModelLocation, ModelSource
from .errors import ConfigError
from .fields import FieldRule
from .openapi import Documented, RouteDoc
from .pipeline_types import ChatRender, Execution, Finalization, ForwardPlan, Outcome, Problem
from .registry import ModelRegistry, ServedModel, SwitchTarget
from .requestfields import RequestField

log = structlog.get_logger("millm.plugins")

ENTRY_POINT_GROUP = "millm"
INFRA_KINDS = frozenset({"engine", "models"})


# Hooks the host calls implementation by implementation (every one runs even after one
# raised, or their results are ordered by registration): pluggy's wrappers cannot wrap them.
_CALLED_ONE_BY_ONE = ("millm_validate", "millm_validate_switch", "millm_model_unloaded", "millm_shutdown")


@dataclass(frozen=True)
class PluginRecord:
    """A plugin the host knows about, loaded or not."""

    name: str
    kind: str
    loaded: bool
    origin: str


def plugin_kind(plugin: object) -> str:
    return str(getattr(plugin, "MILLM_PLUGIN_KIND", "feature"))


class PluginHost:
    """Owns one pluggy PluginManager. Every hook is called through a typed method here."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []

    # -------------------------------------------------------------- discovery

    def register(self, plugin: object, name: str, *, origin: str = "direct") -> None:
        """Register a plugin object (module or instance) under ``name``. Raises
        ``ConfigError`` for a wrapper on a hook the host calls implementation by
        implementation (see :data:`_CALLED_ONE_BY_ONE`), and for a name or plugin object
        registered already (an installed plugin passed again, say)."""
        for record in self.records:
            if record.loaded and (record.name == name or self._pm.get_plugin(record.name) is plugin):
                raise ConfigError(
                    f"plugin {name!r} is registered already, as {record.name!r} from {record.origin}: an installed plugin is "
                    "found through its entry point; do not register it again (or block the installed one)"
                )
        self._pm.register(plugin, name=name)
        for hook in _CALLED_ONE_BY_ONE:
            for impl in getattr(self._pm.hook, hook).get_hookimpls():
                if impl.plugin_name == name and (impl.hookwrapper or getattr(impl, "wrapper", False)):
                    self._pm.unregister(name=name)
                    raise ConfigError(f"plugin {name!r}: {hook} takes no wrappers (the host calls each implementation itself)")
        self.records.append(PluginRecord(name, plugin_kind(plugin), True, origin))

    def unregister(self, name: str) -> None:
        plugin = self._pm.get_plugin(name)
        if plugin is not None:
            self._pm.unregister(plugin)
        self.records = [r for r in self.records if r.name != name]

    def discover(self, settings: Settings, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        """Load plugins from the entry-point group, applying allow- and block-lists."""
        eps = list(entry_points if entry_points is not None else importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        known = {ep.name for ep in eps}
        allow = set(settings.plugins) if settings.plugins is not None else None
        for name in (allow or set()) | set(settings.block_plugins):
            if name not in known:
                raise ConfigError(f"unknown plugin {name!r}; installed plugins: {', '.join(sorted(known))}")
        for ep in sorted(eps, key=lambda e: e.name):
            if ep.name in settings.block_plugins or self._pm.has_plugin(ep.name):
                continue
            try:
                plugin: ModuleType = ep.load()
            except Exception as exc:  # an installed plugin that cannot import: say which, and the way out
                raise ConfigError(
                    f"plugin {ep.name!r} ({ep.value}) could not be imported: {type(exc).__name__}: {exc}; "
                    f"fix or uninstall it, or leave it out with --block-plugins {ep.name}"
                ) from exc
            kind = plugin_kind(plugin)
            if kind not in INFRA_KINDS and allow is not None and ep.name not in allow:
                self.records.append(PluginRecord(ep.name, kind, False, ep.value))
                continue
            self.register(plugin, ep.name, origin=ep.value)
            log.debug("plugin_loaded", plugin=ep.name, kind=kind)

    @classmethod
    def build(cls, settings: Settings) -> PluginHost:
        """A host with the core's own hooks and every discovered plugin the settings
        enable."""
        from . import builtin

        host = cls()
        host.register(builtin, builtin.NAME, origin="millm_core.builtin")
        host.discover(settings)
        return host

    @classmethod
    def declared_settings(cls, blocked: Iterable[str] = ()) -> list[PluginSetting[Any]]:
        """The settings every installed plugin declares, enabled or not (cheap: plugin
        modules import no heavy libraries), except the ``blocked`` ones (never imported)."""
        host = cls()
        host.discover(Settings(block_plugins=tuple(blocked)))
        return host.plugin_settings()

    def has(self, name: str) -> bool:
        return self._pm.has_plugin(name)

    def culprit(self, exc: BaseException) -> str | None:
        """The plugin whose code raised ``exc``: for the innermost traceback frame that has
        one, a registered plugin object whose method it is, else the plugin whose module it
        is, else the plugin whose package holds it (the longest such package; a plugin
        module's package, or a package registered as the plugin). None when no frame is a
        plugin's (the core's own code, or a library called by the core)."""
        modules: dict[str, str] = {}
        packages: list[tuple[str, str]] = []
        instances: dict[int, str] = {}
        for name, plugin in self._pm.list_name_plugin():
            if name == "core" or plugin is None:
                continue
            if isinstance(plugin, ModuleType):
                module = plugin.__name__
                if hasattr(plugin, "__path__"):  # a package: its modules are its
                    packages.append((module + ".", name))
            else:
                module = type(plugin).__module__
                instances[id(plugin)] = name
            modules.setdefault(module, name)
            package = module.rpartition(".")[0]
            if package and package not in ("millm_plugins", "millm_engines"):  # shared namespaces own nothing
                packages.append((package + ".", name))
        packages.sort(key=lambda item: -len(item[0]))
        tb = exc.__traceback__
        frames: list[Any] = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            bound = frame.f_locals.get("self")
            if bound is not None and id(bound) in instances:  # a method of a plugin object
                return instances[id(bound)]
            module = str(frame.f_globals.get("__name__", ""))
            if module in modules:
                return modules[module]
            owner = next((name for prefix, name in packages if module.startswith(prefix)), None)
            if owner is not None:
                return owner
        return None

    def names(self) -> list[str]:
        return [r.name for r in self.records if r.loaded]

    def hook_order(self, hook: str) -> list[str]:
        """Plugin names implementing ``hook``, in the order pluggy calls them."""
        caller = getattr(self._pm.hook, hook)
        return [self._pm.get_name(impl.plugin) or "?" for impl in reversed(caller.get_hookimpls())]

    # -------------------------------------------------------------- start-up hooks

    def commands(self) -> list[Command]:
        found: list[Command] = []
        self._pm.hook.millm_register_commands(register=found.append)
        return found

    @classmethod
    def declared_commands(cls, blocked: Iterable[str] = ()) -> list[Command]:
        """The subcommands every installed plugin but the ``blocked`` ones offers."""
        host = cls()
        host.discover(Settings(block_plugins=tuple(blocked)))
        return host.commands()

    def engines(self) -> list[EngineFactory]:
        found: list[EngineFactory] = []
        self._pm.hook.millm_register_engines(register=found.append)
        return sorted(found, key=lambda f: f.priority)

    def model_sources(self) -> dict[str, ModelSource]:
        found: list[ModelSource] = []
        self._pm.hook.millm_register_model_sources(register=found.append)
        return {s.name: s for s in found}

    def locate_model(self, name: str, settings: Settings) -> ModelLocation | None:
        result: ModelLocation | None = self._pm.hook.millm_locate_model(name=name, settings=settings)
        return result

    def default_model(self, settings: Settings) -> str | None:
        result: str | None = self._pm.hook.millm_default_model(settings=settings)
        return result

    def plugin_settings(self) -> list[PluginSetting[Any]]:
        found: list[PluginSetting[Any]] = []
        self._pm.hook.millm_register_settings(register=found.append)
        return found

    def field_rules(self) -> list[FieldRule]:
        found: list[FieldRule] = []
        self._pm.hook.millm_register_fields(register=found.append)
        return found

    def request_fields(self) -> list[RequestField[Any]]:
        found: list[RequestField[Any]] = []
        self._pm.hook.millm_register_request_fields(register=found.append)
        return found

    def response_schemas(self) -> list[tuple[str, type]]:
        found: list[tuple[str, type]] = []
        self._pm.hook.millm_register_schemas(register=lambda path, struct: found.append((path, struct)))
        return found

    def _routes(self) -> list[tuple[str, Callable[..., Any], list[str], RouteDoc | None]]:
        found: list[tuple[str, Callable[..., Any], list[str], RouteDoc | None]] = []

        def register(path: str, endpoint: Callable[..., Any], methods: list[str], doc: RouteDoc | None = None) -> None:
            found.append((path, endpoint, methods, doc))

        self._pm.hook.millm_register_routes(register=register)
        return found

    def routes(self) -> list[tuple[str, Callable[..., Any], list[str]]]:
        return [(path, endpoint, methods) for path, endpoint, methods, _ in self._routes()]

    def documented_routes(self) -> list[Documented]:
        """``(path, method, doc)`` for every route registered with a ``doc``."""
        return [(path, method, doc) for path, _, methods, doc in self._routes() if doc is not None for method in methods]

    # -------------------------------------------------------------- lifecycle hooks

    def startup(self, app: AppContext) -> None:
        self._pm.hook.millm_startup(app=app)

    def model_loaded(self, app: AppContext, model: ServedModel) -> None:
        self._pm.hook.millm_model_loaded(app=app, model=model)

    def model_unloading(self, app: AppContext, model: ServedModel) -> None:
        """Raises the first plugin's refusal to let ``model`` go."""
        self._pm.hook.millm_model_unloading(app=app, model=model)

    def model_unloaded(self, app: AppContext, model: ServedModel) -> None:
        """Every implementation runs, even after one raised (each error is logged)."""
        for impl in reversed(self._pm.hook.millm_model_unloaded.get_hookimpls()):
            try:
                impl.function(*[{"app": app, "model": model}[name] for name in impl.argnames])
            except Exception:  # noqa: BLE001 - an unload must reach every plugin
                log.exception("plugin_model_unloaded_failed", plugin=impl.plugin_name)

    def shutdown(self, app: AppContext) -> None:
        """Every implementation runs, even after one raised (each error is logged)."""
        for impl in reversed(self._pm.hook.millm_shutdown.get_hookimpls()):
            try:
                impl.function(*[{"app": app}[name] for name in impl.argnames])
            except Exception:  # noqa: BLE001 - shutdown must reach every plugin
                log.exception("plugin_shutdown_failed", plugin=impl.plugin_name)

    # -------------------------------------------------------------- request hooks

    def validate(self, ctx: RequestContext, request: Any) -> list[Problem]:
        return self._problems("millm_validate", {"ctx": ctx, "request": request})

    def _problems(self, hook: str, arguments: dict[str, Any]) -> list[Problem]:
        """Every plugin's problems, reported in the plugins' registration order (the first
        decides the response's status and code). The implementations run in pluggy's order,
        so a ``tryfirst`` one (scoring) has reported the fields it leaves unused before the
        others look at them."""
        order = {record.name: index for index, record in enumerate(self.records)}
        found: list[tuple[int, list[Problem]]] = []
        for impl in reversed(getattr(self._pm.hook, hook).get_hookimpls()):  # pluggy's call order
            batch = cast("Iterable[Problem] | None", impl.function(*[arguments[name] for name in impl.argnames]))
            found.append((order.get(impl.plugin_name or "", len(order)), list(batch or ())))
        return [problem for _, batch in sorted(found, key=lambda item: item[0]) for problem in batch]

    def resolve(self, ctx: RequestContext, request: Any, models: ModelRegistry) -> ServedModel | None:
        result: ServedModel | None = self._pm.hook.millm_resolve(ctx=ctx, request=request, models=models)
        return result

    def requested_model(self, ctx: RequestContext, request: Any) -> str | None:
        result: str | None = self._pm.hook.millm_requested_model(ctx=ctx, request=request)
        return result

    def validate_switch(self, ctx: RequestContext, request: Any, target: SwitchTarget) -> list[Problem]:
        return self._problems("millm_validate_switch", {"ctx": ctx, "request": request, "target": target})

    def execute(self, ctx: RequestContext, request: Any, model: ServedModel) -> Execution | None:
        result: Execution | None = self._pm.hook.millm_execute(ctx=ctx, request=request, model=model)
        return result

    def render_chat(self, ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
        self._pm.hook.millm_render_chat(ctx=ctx, request=request, model=model, chat=chat)

    def pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        self._pm.hook.millm_pre_forward(ctx=ctx, request=request, plan=plan)

    def finalize(self, ctx: RequestContext, request: Any, outcome: Outcome, out: Finalization) -> None:
        self._pm.hook.millm_finalize(ctx=ctx, request=request, outcome=outcome, out=out)
