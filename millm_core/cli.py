"""``millm serve``, ``millm models`` and the subcommands plugins add."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from . import __version__
from .commands import Command
from .config import PARSERS, PluginSetting, Settings, blocked_plugins, env_name, load_settings
from .errors import ConfigError
from .logs import configure_logging

if TYPE_CHECKING:
    from hypercorn.config import Config

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
    "log_level": "debug | info | warning | error | critical",
    "max_queue": "requests allowed to wait; more are refused with 503 queue_full (default 64)",
    "max_body_bytes": "largest request body accepted; larger is 413 (default 4 MiB)",
    "default_max_tokens": "completion budget when a request sends no max_tokens (default 1024; 0: up to the context window)",
    "max_rows_per_request": "rows (prompts × n) one request may run at once; more is 400 (default 64)",
    "api_key": "comma-separated bearer keys required on every route but /api/health and /api/health/ready (prefer the env var)",
    "allowed_hosts": "comma-separated Host header values accepted, * for any (default: localhost, 127.0.0.1 and [::1] on a loopback address, else any)",
    "read_timeout": "seconds a client may take to send its request (default 30)",
    "max_inflight": "HTTP requests in flight (reading, queued or running) before new ones get 503 server_busy (default 256)",
    "max_connections": "open client connections at once; more wait unaccepted until one closes (default 512, 0: no cap)",
    "chat_template": "a Jinja chat template file to serve instead of the model's own (for example one that takes tools)",
    "threads": "CPU threads model code uses (default: the engine library's own choice)",
    "batch_invariant": "true: a row's tokens never depend on what shares its batch, on every engine (a GGUF file whose shared batches are not invariant then decodes one sequence at a time; default false: the others are invariant anyway, or say they are not)",
    "cache_dir": "where converted models are cached (default ~/.cache/millm)",
    "db": "the SQLite database for what persists (default ~/.local/share/millm/millm.db)",
    "model_roots": "comma-separated directories whose checkpoint folders and GGUF files GET /api/models lists as loadable (default: none)",
    "graceful_unload_timeout": "seconds an unload waits for the model's running requests before cancelling them (default 30)",
    "auto_load": "a request naming a loadable model that is not loaded loads it, unloading the resident first (default true)",
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
            group.add_argument(flag, dest=setting.name, default=None, help=help_text)  # parsed in _overrides, as the core's


def build_parser(plugin_settings: Sequence[PluginSetting[Any]] = (), commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    # No abbreviated flags: which flags exist depends on the installed plugins, so an
    # abbreviation could change meaning, and --block-plugins is read before parsing.
    parser = argparse.ArgumentParser(
        prog="millm", description="An OpenAI-compatible model server for interpretability research", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"millm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API", allow_abbrev=False)
    _add_settings_flags(serve, plugin_settings)
    _add_settings_flags(sub.add_parser("models", help="list the models plugins offer and the installed plugins", allow_abbrev=False), plugin_settings)
    for command in commands:
        if command.serve_option:  # `millm serve --<name>`: another way to serve, with arguments of its own
            serve.add_argument("--" + command.name, dest=command.name.replace("-", "_"), action="store_true", help=command.help)
            command.configure(serve, lambda p: None)
            continue
        command.configure(sub.add_parser(command.name, help=command.help, allow_abbrev=False), lambda p: _add_settings_flags(p, plugin_settings))
    return parser


def _overrides(args: argparse.Namespace, plugin_settings: Sequence[PluginSetting[Any]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for setting in plugin_settings:
        raw = getattr(args, setting.name, None)
        if raw is not None:
            try:
                out[setting.name] = setting.parse(raw)
            except ValueError as exc:  # the setting's own words, as for its MILLM_* variable
                raise ConfigError(f"--{setting.name.replace('_', '-')} {raw!r}: {exc}") from exc
    for field, parse in PARSERS.items():
        raw = getattr(args, field, None)
        if raw is not None:
            try:
                out[field] = parse(raw)  # type: ignore[operator]
            except ValueError as exc:
                raise ConfigError(f"--{field.replace('_', '-')} {raw!r}: {exc}") from exc
    return out


# hypercorn's idle timer runs from the moment a connection is accepted until a request's
# headers are complete, and again between keep-alive requests: it is what bounds a client
# that trickles its headers (or sends nothing). hypercorn's own ``read_timeout`` is the gap
# allowed between two reads on the whole connection, a long non-streamed answer included
# (the client sends nothing while it waits), so it stays unset: millm bounds the body itself
# (``--read-timeout``).
HEADER_TIMEOUT_S = 5
MAX_HEADER_BYTES = 16 * 1024  # request line and headers; larger is 431 from h11
ACCEPT_RETRY_S = 0.5  # after accept() fails (out of descriptors, say)


def hypercorn_config(settings: Settings, *, bind: str | None = None, errorlog: str | None = "-") -> Config:
    """hypercorn's settings for a millm server on ``bind`` (``host:port`` from
    ``settings`` by default)."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [bind or f"{settings.host}:{settings.port}"]
    config.accesslog = None  # millm logs one access line per request itself
    config.errorlog = errorlog
    config.keep_alive_timeout = HEADER_TIMEOUT_S
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.read_timeout = None  # see HEADER_TIMEOUT_S
    return config


def _cap_of(app: object) -> int:
    """The app's ``--max-connections``, read once its lifespan has started."""
    settings = getattr(getattr(getattr(app, "state", None), "millm", None), "settings", None)
    return settings.max_connections if isinstance(settings, Settings) else Settings().max_connections


async def serve_app(
    app: object, config: Config, *, shutdown_trigger: Callable[[], Awaitable[object]], max_connections: int | None = None
) -> None:
    """Serve the ASGI ``app`` on ``config.bind`` with hypercorn's protocol code, holding at
    most ``max_connections`` client connections open at once (0: no cap; None: the app's
    own ``--max-connections``), until ``shutdown_trigger`` returns.

    hypercorn's ``serve`` accepts every connection it is offered, so a client opening
    thousands of them can use up the process's descriptors. Here the accept loop takes a
    free slot before it accepts: past the cap, new connections wait in the kernel's listen
    backlog (``config.backlog``), costing this process nothing, and are accepted in turn as
    open ones close. Open connections are served as usual. Lifespan and graceful shutdown
    follow hypercorn's own ``serve``.
    """
    from hypercorn.asyncio.lifespan import Lifespan
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.asyncio.worker_context import WorkerContext
    from hypercorn.typing import LifespanState
    from hypercorn.utils import wrap_app

    class Connection(TCPServer):
        async def _read_data(self) -> None:
            await super()._read_data()
            # The client closed its side: hypercorn has ended the request already, but its
            # idle timer would keep the connection (and a slot) until it fires.
            await self.idle_task.stop()

    loop = asyncio.get_running_loop()
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, loop, lifespan_state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    failed = lifespan_task.exception() if lifespan_task.done() else None
    if failed is not None:
        raise failed
    cap = _cap_of(app) if max_connections is None else max_connections
    slots = asyncio.Semaphore(cap) if cap > 0 else None
    context = WorkerContext(None)
    connections: set[asyncio.Task[None]] = set()

    async def connection(conn: socket.socket) -> None:
        try:
            reader = asyncio.StreamReader(loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            try:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
            except BaseException:
                conn.close()
                raise
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await Connection(wrapped, loop, config, context, lifespan_state, reader, writer)
        finally:
            if slots is not None:
                slots.release()

    async def accept(listener: socket.socket) -> None:
        while True:
            if slots is not None:
                await slots.acquire()  # at the cap: accept nothing until a connection closes
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if slots is not None:
                    slots.release()
                log.warning("accept_failed", error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            except BaseException:
                if slots is not None:
                    slots.release()
                raise
            task = loop.create_task(connection(conn))
            connections.add(task)
            task.add_done_callback(connections.discard)

    listeners: list[socket.socket] = []
    tasks: list[asyncio.Future[Any]] = []
    accepting: list[asyncio.Task[None]] = []
    try:
        try:
            listeners = config.create_sockets().insecure_sockets
            for listener in listeners:
                listener.listen(config.backlog)
                listener.setblocking(False)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {', '.join(config.bind)}: {exc}") from exc
        accepting = [loop.create_task(accept(listener)) for listener in listeners]
        tasks = [asyncio.ensure_future(shutdown_trigger()), *accepting]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for listener in listeners:
            listener.close()
        await context.terminated.set()  # idle keep-alive connections close now
        if connections:
            _, late = await asyncio.wait(set(connections), timeout=config.graceful_timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lifespan_task
    for task in accepting:  # an accept loop that died for another reason than the shutdown
        died = None if task.cancelled() else task.exception()
        if died is not None:
            raise died


DESCRIPTORS_SPARE = 64  # for model files, the database, logs and worker threads


def _check_descriptors(cap: int) -> None:
    """Warn when the connection cap does not leave the process descriptors to spare."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Unix
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (cap == 0 or cap > soft - DESCRIPTORS_SPARE):
        log.warning("connection_cap_above_descriptor_limit", max_connections=cap or "none", descriptor_limit=soft, spare=DESCRIPTORS_SPARE)


async def _serve(settings: Settings) -> None:
    from .serving import serving_app

    app = serving_app(settings)  # the model is located now: a fast failure and one-time conversion, before binding
    config = hypercorn_config(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _check_descriptors(settings.max_connections)
    log.info("listening", url=f"http://{settings.host}:{settings.port}/v1", max_connections=settings.max_connections or None)
    failed: list[str] = []

    async def watch_startup_load() -> None:
        """A model that cannot be loaded at start-up stops the server (exit 2), as a bad
        setting does, rather than leaving it up with nothing to serve."""
        from .serving import startup_load

        while getattr(app.state, "millm", None) is None and not stop.is_set():
            await asyncio.sleep(0.05)
        if stop.is_set():
            return
        error = await startup_load(app)
        if error is not None and not stop.is_set():  # a load cut short by a shutdown is no failure
            failed.append(error)
            stop.set()

    watcher = asyncio.create_task(watch_startup_load())
    try:
        await serve_app(app, config, shutdown_trigger=stop.wait, max_connections=settings.max_connections)
    except Exception:
        # A start-up failure (database, a plugin's migrations) is the operator's to fix:
        # say what it was, without a traceback.
        error = getattr(app.state, "startup_error", None)
        if error:
            raise ConfigError(f"the server did not start: {error}") from None
        raise
    finally:
        watcher.cancel()
    if failed:
        raise ConfigError(f"the model could not be loaded at start-up: {failed[0]}")


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
        blocked = blocked_plugins(sys.argv[1:] if argv is None else argv)
        declared = PluginHost.declared_settings(blocked)
        commands = {c.name: c for c in PluginHost.declared_commands(blocked)}
        args = build_parser(declared, list(commands.values())).parse_args(argv)
        settings = load_settings(_overrides(args, declared), plugin_settings=declared)
        configure_logging(settings.log_format, settings.log_level)
        option = next((c for c in commands.values() if c.serve_option and getattr(args, c.name.replace("-", "_"), False)), None)
        if args.command == "serve" and option is not None:
            return option.run(args, settings)
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
