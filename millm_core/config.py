"""Server settings. Every CLI flag has a ``MILLM_*`` environment variable; precedence is
flag > environment > default."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

import msgspec

from .dbdialect import check_db
from .errors import ConfigError

T = TypeVar("T")


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything an operator can set. ``model`` None means the default model that a
    model-source plugin offers."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None
    engine: str | None = None
    plugins: tuple[str, ...] | None = None
    block_plugins: tuple[str, ...] = ()
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    # Completion budget of a request that sends no max_tokens (0: up to the context window).
    default_max_tokens: int = 1024
    # Rows (prompts × n) one request may generate or score at once.
    max_rows_per_request: int = 64
    # Bearer keys required on every route but health and readiness (none: no auth).
    api_key: tuple[str, ...] = ()
    # Host header values accepted (none: any), against DNS rebinding.
    allowed_hosts: tuple[str, ...] = ()
    # Seconds a client may take to send its request (slow-body clients are dropped).
    read_timeout: int = 30
    # HTTP requests in flight (reading, waiting or running) before new ones get 503.
    max_inflight: int = 256
    # Open client connections at once (0: no cap). Past it new connections wait in the
    # kernel's listen backlog, unaccepted, until an open one closes.
    max_connections: int = 512
    threads: int | None = None
    # Force the batch-invariant path where an engine has a faster one that is not (the
    # GGUF engine then decodes one sequence at a time); refused at load where none exists.
    batch_invariant: bool = False
    # A Jinja chat template file served instead of the model's own (for example one that
    # takes tools), as vLLM's --chat-template.
    chat_template: str | None = None
    cache_dir: str | None = None
    db: str | None = None
    # Directories whose Hugging Face checkpoint folders and GGUF files ``GET /api/models``
    # lists as loadable (none by default: only the loaded model and plugins' sources).
    model_roots: tuple[str, ...] = ()
    # Seconds an unload waits for the model's running requests before cancelling them.
    graceful_unload_timeout: float = 30.0
    # A request naming a model that is not loaded but can be (GET /api/models) loads it,
    # unloading the resident model first; off: such a request is a 404.
    auto_load: bool = True
    # Values of the settings plugins declared through ``millm_register_settings``; read
    # one with its declaration: ``SETTING.get(settings)``.
    plugin_values: dict[str, Any] = msgspec.field(default_factory=dict)


@dataclass(frozen=True)
class PluginSetting(Generic[T]):
    """A setting a plugin declares; it becomes ``--<name>`` and ``MILLM_<NAME>`` like the
    core's own. Keep the declaration and read the typed value with
    ``SETTING.get(settings)``. ``parse`` turns the flag's or variable's text into a value,
    raising ``ValueError`` for a bad one."""

    name: str
    default: T
    help: str = ""
    parse: Callable[[str], T] = str  # type: ignore[assignment]

    def get(self, settings: Settings) -> T:
        """This setting's value in ``settings`` (its default when not set)."""
        return cast(T, settings.plugin_values.get(self.name, self.default))


# flag name -> (settings field, parser). One table serves env vars and CLI flags.
def _csv(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


def blocked_plugins(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """The plugins ``--block-plugins`` (in ``argv`` or ``overrides``), else
    ``MILLM_BLOCK_PLUGINS``, leaves out: read before the plugins are discovered, so that a
    blocked plugin is never imported (one that cannot import is then no obstacle)."""
    value = overrides.get("block_plugins") if overrides else None
    if isinstance(value, str):
        return _csv(value)
    if isinstance(value, tuple | list):
        return tuple(str(v) for v in value)
    flag = "--block-plugins"
    given: str | None = None
    for i, arg in enumerate(argv):  # the last one counts, as for argparse (which takes no abbreviations here)
        if arg == flag and i + 1 < len(argv):
            given = argv[i + 1]
        elif arg.startswith(flag + "="):
            given = arg[len(flag) + 1 :]
    if given is not None:
        return _csv(given)
    environ = os.environ if environ is None else environ
    return _csv(environ.get(env_name("block_plugins"), ""))


def _keys(value: str) -> tuple[str, ...]:
    """API keys, comma-separated. A value that holds no key (blanks, commas) is refused: a
    key meant to guard the server that came out empty must not leave it open. ``""`` (an
    empty variable) means no keys."""
    return guarded_csv(value, "key")


def _hosts(value: str) -> tuple[str, ...]:
    return guarded_csv(value, "host")


def guarded_csv(value: str, what: str) -> tuple[str, ...]:
    """A comma-separated list whose empty value means "no restriction" (API keys, allowed
    hosts, SAE roots): a value that holds nothing but blanks and commas is refused rather
    than read as that. ``""`` means none."""
    items = _csv(value)
    if value and not items:
        raise ValueError(f"{value!r} holds no {what}; give one or more, or nothing at all for none")
    return items


def parse_bool(value: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case), for flags and ``MILLM_*`` variables."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _opt_int(value: str) -> int | None:
    return int(value) if value.strip() else None


PARSERS: Mapping[str, object] = {
    "model": str,
    "host": str,
    "port": int,
    "served_name": str,
    "dtype": str,
    "max_model_len": _opt_int,
    "engine": str,
    "plugins": _csv,
    "block_plugins": _csv,
    "log_format": str,
    "log_level": str,
    "max_queue": int,
    "max_body_bytes": int,
    "default_max_tokens": int,
    "max_rows_per_request": int,
    "api_key": _keys,
    "allowed_hosts": _hosts,
    "read_timeout": int,
    "max_inflight": int,
    "max_connections": int,
    "threads": _opt_int,
    "batch_invariant": parse_bool,
    "chat_template": str,
    "cache_dir": str,
    "db": str,
    "model_roots": _csv,
    "graceful_unload_timeout": float,
    "auto_load": parse_bool,
}


def env_name(field: str) -> str:
    return "MILLM_" + field.upper()


def _plugin_values(declared: Sequence[PluginSetting[Any]], overrides: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for setting in declared:
        if setting.name in PARSERS or setting.name in values:
            raise ConfigError(f"plugin setting {setting.name!r} is declared twice or shadows a core setting")
        values[setting.name] = setting.default
        raw = environ.get(env_name(setting.name))
        if raw is not None and raw != "":
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{env_name(setting.name)}={raw!r}: {exc}") from exc
        if overrides.get(setting.name) is not None:
            values[setting.name] = overrides[setting.name]
    return values


def load_settings(
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    plugin_settings: Sequence[PluginSetting[Any]] = (),
) -> Settings:
    """Build settings from ``MILLM_*`` environment variables, then ``overrides`` (flags).
    ``plugin_settings`` are the settings plugins declared; their values land in
    ``Settings.plugin_values``."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    plugin_values = _plugin_values(plugin_settings, overrides, environ)
    values: dict[str, object] = {"plugin_values": plugin_values}
    for field, parse in PARSERS.items():
        raw = environ.get(env_name(field))
        if raw is not None and raw != "":
            try:
                values[field] = parse(raw)  # type: ignore[operator]
            except ValueError as exc:
                raise ConfigError(f"{env_name(field)}={raw!r}: {exc}") from exc
    for key, value in overrides.items():
        if value is not None and key not in plugin_values:
            values[key] = value
    level = values.get("log_level")
    if isinstance(level, str):  # INFO, Warning and warn mean what logging takes them for
        values["log_level"] = {"warn": "warning"}.get(level.lower(), level.lower())
    try:
        settings = msgspec.convert(values, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid setting: {exc}") from exc
    if settings.max_model_len is not None and settings.max_model_len < 1:
        raise ConfigError("--max-model-len must be at least 1")
    if settings.default_max_tokens < 0:
        raise ConfigError("--default-max-tokens must be 0 (up to the context window) or more")
    if settings.max_queue < 1:
        raise ConfigError("--max-queue must be at least 1")
    if settings.max_rows_per_request < 1:
        raise ConfigError("--max-rows-per-request must be at least 1")
    if settings.max_inflight < 1:
        raise ConfigError("--max-inflight must be at least 1")
    if settings.max_connections < 0:
        raise ConfigError("--max-connections must be 0 (no cap) or more")
    if settings.graceful_unload_timeout < 0:
        raise ConfigError("--graceful-unload-timeout must be 0 or more seconds")
    if settings.read_timeout < 1:
        raise ConfigError("--read-timeout must be at least 1 second")
    if not 0 <= settings.port <= 65535:
        raise ConfigError(f"--port must be from 0 (any free port) to 65535, not {settings.port}")
    if settings.max_body_bytes < 1024:
        raise ConfigError(f"--max-body-bytes must be at least 1024 (a request needs room), not {settings.max_body_bytes}")
    if settings.threads is not None and settings.threads < 0:
        raise ConfigError(f"--threads must be 0 (the engine library's own choice) or more, not {settings.threads}")
    if settings.db is not None:
        try:
            check_db(settings.db)
        except ValueError as exc:
            raise ConfigError(f"--db: {exc}") from exc
    return settings


def cache_root(settings: Settings) -> str:
    """Where millm keeps converted models: ``--cache-dir``, else ``$XDG_CACHE_HOME/millm``."""
    if settings.cache_dir:
        return settings.cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "millm")
