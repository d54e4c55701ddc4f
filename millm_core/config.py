"""Server settings. Every CLI flag has a ``MILLM_*`` environment variable; precedence is
flag > environment > default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import msgspec

from .errors import ConfigError


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
    log_level: str = "info"
    max_queue: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024
    threads: int | None = None
    fast_decode: bool = True
    cache_dir: str | None = None


# flag name -> (settings field, parser). One table serves env vars and CLI flags.
def _csv(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


def _bool(value: str) -> bool:
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
    "threads": _opt_int,
    "fast_decode": _bool,
    "cache_dir": str,
}


def env_name(field: str) -> str:
    return "MILLM_" + field.upper()


def load_settings(overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build settings from ``MILLM_*`` environment variables, then ``overrides`` (flags)."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field, parse in PARSERS.items():
        raw = environ.get(env_name(field))
        if raw is not None and raw != "":
            try:
                values[field] = parse(raw)  # type: ignore[operator]
            except ValueError as exc:
                raise ConfigError(f"{env_name(field)}={raw!r}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value
    try:
        settings = msgspec.convert(values, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid setting: {exc}") from exc
    if settings.max_model_len is not None and settings.max_model_len < 1:
        raise ConfigError("--max-model-len must be at least 1")
    if settings.max_queue < 1:
        raise ConfigError("--max-queue must be at least 1")
    return settings


def cache_root(settings: Settings) -> str:
    """Where millm keeps converted models: ``--cache-dir``, else ``$XDG_CACHE_HOME/millm``."""
    if settings.cache_dir:
        return settings.cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "millm")
