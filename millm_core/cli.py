"""``millm serve``, ``millm models`` and the subcommands plugins add."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from . import __version__
from .commands import Command
from .config import PARSERS, PluginSetting, Settings, env_name, load_settings
from .errors import ConfigError
from .logs import configure_logging

log = structlog.get_logger("millm.cli")

_HELP = {
    "model": "local checkpoint directory, a model a plugin offers, or a model in the local HF cache (default: the model a model-source plugin offers as default)",
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to bind (default 8000)",
    "served_name": "name the model is served under (default: derived from --model)",
    "dtype": "auto | float32 | bfloat16 | float16 (default auto: the checkpoint's own)",
    "max_model_len": "context window to serve (at most the model's own)",
    "engine": "engine to use (default: the first that can load the model)",
    "plugins": "comma-separated allow-list of feature plugins (default: all installed)",
    "block_plugins": "comma-separated plugins never to load",
    "log_format": "console | json",
    "log_level": "debug | info | warning | error",
    "max_queue": "requests allowed to wait; more are refused with 503 queue_full (default 64)",
    "max_body_bytes": "largest request body accepted; larger is 413 (default 4 MiB)",
    "default_max_tokens": "completion budget when a request sends no max_tokens (default 1024)",
    "max_rows_per_request": "rows (prompts × n) one request may run at once; more is 400 (default 64)",
    "api_key": "comma-separated bearer keys required on every route but /api/health and /api/health/ready (prefer the env var)",
    "allowed_hosts": "comma-separated Host header values accepted (default: any)",
    "read_timeout": "seconds a client may take to send its request (default 30)",
    "max_inflight": "HTTP requests in flight (reading, queued or running) before new ones get 503 server_busy (default 256)",
    "threads": "CPU threads model code uses (default: the engine library's own choice)",
    "cache_dir": "where converted models are cached (default ~/.cache/millm)",
    "db": "the SQLite database for what persists (default ~/.local/share/millm/millm.db)",
}


def _add_settings_flags(parser: argparse.ArgumentParser, plugin_settings: Sequence[PluginSetting[Any]]) -> None:
    for field in PARSERS:
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, dest=field, default=None, help=f"{_HELP.get(field, '')} [{env_name(field)}]")
    if plugin_settings:
        group = parser.add_argument_group("plugin settings")
        for setting in plugin_settings:
            flag = "--" + setting.name.replace("_", "-")
            help_text = f"{setting.help} (default {setting.default!r}) [{env_name(setting.name)}]"
            group.add_argument(flag, dest=setting.name, default=None, type=setting.parse, help=help_text)


def build_parser(plugin_settings: Sequence[PluginSetting[Any]] = (), commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="millm", description="An OpenAI-compatible model server for interpretability research")
    parser.add_argument("--version", action="version", version=f"millm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_settings_flags(sub.add_parser("serve", help="serve a model over the OpenAI API"), plugin_settings)
    _add_settings_flags(sub.add_parser("models", help="list the models plugins offer and the installed plugins"), plugin_settings)
    for command in commands:
        command.configure(sub.add_parser(command.name, help=command.help), lambda p: _add_settings_flags(p, plugin_settings))
    return parser


def _overrides(args: argparse.Namespace, plugin_settings: Sequence[PluginSetting[Any]]) -> dict[str, object]:
    out: dict[str, object] = {s.name: getattr(args, s.name) for s in plugin_settings if getattr(args, s.name, None) is not None}
    for field, parse in PARSERS.items():
        raw = getattr(args, field, None)
        if raw is not None:
            try:
                out[field] = parse(raw)  # type: ignore[operator]
            except ValueError as exc:
                raise ConfigError(f"--{field.replace('_', '-')} {raw!r}: {exc}") from exc
    return out


async def _serve(settings: Settings) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from .loading import load, locate
    from .registry import ServedModel
    from .server.app import build_host, create_app

    host = build_host(settings)
    location = locate(settings, host)  # fast failure and one-time conversion, before binding

    def loader() -> ServedModel:
        engine = load(location, settings, host)
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=host, loader=loader)
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None  # millm logs one access line per request itself
    config.errorlog = "-"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening", url=f"http://{settings.host}:{settings.port}/v1")
    try:
        await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    except Exception:
        # A start-up failure (database, a plugin's migrations) is the operator's to fix:
        # say what it was, without a traceback.
        error = getattr(app.state, "startup_error", None)
        if error:
            raise ConfigError(f"the server did not start: {error}") from None
        raise


def _models(settings: Settings) -> None:
    from .server.app import build_host

    host = build_host(settings)
    for name, source in sorted(host.model_sources().items()):
        sys.stdout.write(f"{name}\t{source.description}\n")
    for record in host.records:
        state = "loaded" if record.loaded else "not enabled"
        sys.stdout.write(f"plugin {record.name}\t{record.kind}\t{state}\n")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from .plugins import PluginHost

        configure_logging("console", "warning")  # plugin discovery, before the settings are known
        declared = PluginHost.declared_settings()
        commands = {c.name: c for c in PluginHost.declared_commands()}
        args = build_parser(declared, list(commands.values())).parse_args(argv)
        settings = load_settings(_overrides(args, declared), plugin_settings=declared)
        configure_logging(settings.log_format, settings.log_level)
        if args.command == "serve":
            asyncio.run(_serve(settings))
        elif args.command == "models":
            _models(settings)
        else:
            return commands[args.command].run(args, settings)
    except ConfigError as exc:
        sys.stderr.write(f"millm: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
