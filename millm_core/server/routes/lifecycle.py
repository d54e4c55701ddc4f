"""The model lifecycle routes: ``GET /api/models`` (every model this server can serve)
and ``POST /api/models/{id}/load | unload | lock | unlock``.

A load runs on the model thread, as the start-up load does, then ``millm_model_loaded``;
an unload refuses new requests for the model (503 ``model_busy``), waits for its running
ones up to ``--graceful-unload-timeout`` (then cancels them), drops it from the registry
and runs ``millm_model_unloaded``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response

from ...codec import encode
from ...engine import Engine, EngineFactory, LoadPlan, ModelLocation
from ...errors import ConfigError, MillmError, ModelDoesNotFit, ModelLoadFailed, ModelLocked, ModelNotFound
from ...lifecycle import Candidate, ModelCatalog, ModelEntry, candidates, engine_for, marked, remembered_candidate
from ...loading import choose_engine
from ...openapi import RouteDoc
from ...registry import ServedModel
from ..state import AppState, app_state

log = structlog.get_logger("millm.lifecycle")
T = TypeVar("T")

# Cancelled requests leave the model within a decode step; this long at most is waited for them.
CANCEL_GRACE_S = 5.0
# The catalogue (model roots, plugins' sources) is read again at most this often.
SCAN_TTL_S = 2.0


def _json(entry: ModelEntry | ModelCatalog) -> Response:
    return Response(encode(entry), media_type="application/json")


def _entry(state: AppState, name: str, candidate: Candidate | None, engine: str | None = None) -> ModelEntry:
    lifecycle = state.lifecycle
    model = state.models.get(name)
    return ModelEntry(
        id=name,
        engine=model.info.engine if model is not None else engine,
        state=lifecycle.state_of(name, state.models),
        locked=lifecycle.locked == name,
        source=candidate.source if candidate is not None else "loaded",
    )


def _scan(state: AppState) -> tuple[dict[str, Candidate], dict[str, str | None]]:
    """The loadable models and the engine each would use (off the event loop: it reads
    directories, and an engine's check may import its library). A catalogue that cannot
    be read (a directory gone mid-scan, a plugin's failure) is logged and counts as empty:
    listing models never fails a request."""
    try:
        found = candidates(state.settings, state.host)
        return found, {name: engine_for(c, state.settings, state.host) for name, c in found.items()}
    except Exception:  # noqa: BLE001 - a broken catalogue must not turn /v1/models into a 500
        log.exception("model_catalogue_unreadable")
        return {}, {}


async def scan(state: AppState) -> tuple[dict[str, Candidate], dict[str, str | None]]:
    """:func:`_scan`, read again at most every ``SCAN_TTL_S`` seconds, and the models this
    server served before under their names."""
    lifecycle = state.lifecycle
    cached = lifecycle.scanned
    if cached is None or time.monotonic() - cached[0] > SCAN_TTL_S:
        found, engines = await asyncio.to_thread(_scan, state)
        lifecycle.scanned = cached = (time.monotonic(), found, engines)
    found, engines = dict(cached[1]), dict(cached[2])
    for name, location in lifecycle.remembered.items():
        if name not in found:
            found[name] = remembered_candidate(name, location)
            engines[name] = engine_for(found[name], state.settings, state.host)
    return found, engines


async def catalog(state: AppState) -> ModelCatalog:
    """The loaded models first, then every other model the server could load, by id."""
    found, engines = await scan(state)
    names = [m.info.served_name for m in state.models]
    names += sorted(n for n in {*found, *state.lifecycle.loading} if n not in names)
    return ModelCatalog(data=[_entry(state, name, found.get(name), engines.get(name)) for name in names])


async def list_catalog(request: Request) -> Response:
    """``GET /api/models``."""
    return _json(await catalog(app_state(request)))


def _model_id(request: Request) -> str:
    return str(request.path_params["model_id"])


def _files_mib(path: str) -> float:
    """What the model's files take on disk, in MiB (the figure an out-of-memory load
    reports; its weights are nearly all of it, whatever format an engine reads)."""
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    total = 0
    for folder, _dirs, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total / 2**20


def _mib(count: int) -> str:
    return f"{count / 2**20:.0f} MiB"


def check_memory(name: str, plan: LoadPlan, released: Mapping[str, int], residents: Sequence[str]) -> None:
    """Refuse (``503 insufficient_memory``, with the figures for each device) a load whose
    weights need more than is free plus what unloading ``residents`` gives back."""
    short = [device for device, need in plan.need.items() if need > plan.free.get(device, 0) + released.get(device, 0)]
    if not short:
        return
    figures = []
    for device in short:
        back = released.get(device, 0)
        beside = f" and unloading {', '.join(repr(r) for r in residents)} gives back about {_mib(back)}" if back else ""
        figures.append(f"{_mib(plan.need[device])} needed on {device}, {_mib(plan.free.get(device, 0))} free{beside}")
    raise ModelDoesNotFit(f"'{name}' does not fit in memory: {'; '.join(figures)}; nothing was unloaded", param="model")


def _released(state: AppState, residents: Sequence[ServedModel]) -> dict[str, int]:
    """What unloading ``residents`` would give back per device, estimated like a load
    (from their files); a model loaded without a known location counts for nothing."""
    back: dict[str, int] = {}
    for model in residents:
        if model.location is None:
            continue
        try:
            factory = choose_engine(model.location, state.settings, state.host)
            if factory.preflight is None:
                continue
            plan = factory.preflight(model.location, state.settings)
        except (ConfigError, MillmError, OSError):
            continue
        for device, need in plan.need.items():
            back[device] = back.get(device, 0) + need
    return back


def locate_engine(state: AppState, candidate: Candidate) -> tuple[ModelLocation, EngineFactory]:
    """Where ``candidate``'s files are and the engine that would load them. On the model
    thread (locating may convert files once)."""
    try:
        location = candidate.locate()
    except MillmError:
        raise
    except Exception as exc:
        log.warning("model_locate_failed", model=candidate.id, error=str(exc))
        raise ModelLoadFailed(f"'{candidate.id}' cannot be located ({type(exc).__name__}); the server log has the details") from exc
    try:
        return location, choose_engine(location, state.settings, state.host)
    except ConfigError as exc:
        raise ModelLoadFailed(f"'{candidate.id}' cannot be loaded: no installed engine serves it") from exc


def check_loadable(state: AppState, name: str, location: ModelLocation, factory: EngineFactory, residents: Sequence[ServedModel] = ()) -> None:
    """Before anything is unloaded: the engine's preflight passes (a quantization it
    cannot load is its typed refusal) and the weights fit in what is free plus what
    unloading ``residents`` gives back. Reads files: off the event loop. A preflight that
    fails otherwise is ``model_load_failed``, still before anything is unloaded."""
    if factory.preflight is None:
        return
    try:
        plan = factory.preflight(location, state.settings)
    except MillmError:
        raise
    except Exception as exc:
        log.warning("model_preflight_failed", model=name, error=str(exc))
        raise ModelLoadFailed(f"'{name}' cannot be loaded: its files could not be read ({type(exc).__name__})") from exc
    check_memory(name, plan, _released(state, residents), [m.info.served_name for m in residents])


def _load_on_model_thread(state: AppState, candidate: Candidate, location: ModelLocation, factory: EngineFactory) -> ServedModel:
    """Load ``candidate`` (on the model thread), typed errors out."""
    log.info("model_loading", model=candidate.id, engine=factory.name)
    try:
        engine = factory.load(location, state.settings)
    except MillmError:
        raise  # an engine's own typed refusal (unsupported_quantization, insufficient_memory, …)
    except MemoryError as exc:
        raise ModelDoesNotFit(
            f"'{candidate.id}' does not fit in memory: its files take {_files_mib(location.path):.0f} MiB on disk"
        ) from exc
    except Exception as exc:
        # torch's OutOfMemoryError is no MemoryError; the core never imports torch, so the class is told by name.
        if type(exc).__name__ == "OutOfMemoryError":
            raise ModelDoesNotFit(
                f"'{candidate.id}' does not fit in the device's memory: its files take {_files_mib(location.path):.0f} MiB on disk"
            ) from exc
        if isinstance(exc, ConfigError):  # the server's settings do not fit this model: the log says which (it may name paths)
            log.warning("model_load_failed", model=candidate.id, error=str(exc))
            raise ModelLoadFailed(
                f"loading '{candidate.id}' with the {factory.name} engine failed: the server's settings do not fit this model "
                "(ConfigError); the server log says which"
            ) from exc
        log.exception("model_load_failed", model=candidate.id, engine=factory.name)
        raise ModelLoadFailed(
            f"loading '{candidate.id}' with the {factory.name} engine failed ({type(exc).__name__}); the server log has the details"
        ) from exc
    if not isinstance(engine, Engine):
        raise ModelLoadFailed(f"the {factory.name} engine plugin's load() returned no Engine for '{candidate.id}'")
    # Served under the name it was asked for, whatever its engine would call it.
    return ServedModel(info=msgspec.structs.replace(engine.info, served_name=candidate.id), engine=engine, location=location)


def on_model_thread(state: AppState, fn: Callable[[], T]) -> Awaitable[T]:
    """``fn`` on the model thread, as the start-up load; never refused as queue_full."""
    return asyncio.wrap_future(state.scheduler.call(fn, counted=False))


async def find_candidate(state: AppState, name: str) -> Candidate | None:
    """The loadable model ``name`` names (directories are read off the event loop)."""
    return (await scan(state))[0].get(name)


async def load_planned(state: AppState, candidate: Candidate, location: ModelLocation, factory: EngineFactory) -> ServedModel:
    """Load a planned model and serve it (the caller marks it loading): the plugins'
    ``millm_model_loaded`` hooks run before it joins the registry."""
    name = candidate.id
    lifecycle = state.lifecycle
    try:
        model = await on_model_thread(state, lambda: _load_on_model_thread(state, candidate, location, factory))
        state.host.model_loaded(state.app, model)
        if state.models.get(name) is not None:  # never replace a served model behind its hooks' back
            raise ModelLoadFailed(f"'{name}' was loaded meanwhile; this load was dropped")
    except MillmError as exc:
        log.warning("model_load_failed", model=name, code=exc.code)
        lifecycle.failed[name] = (time.monotonic(), exc)
        raise
    except Exception as exc:
        log.exception("model_load_failed", model=name)
        error = ModelLoadFailed(f"loading '{name}' failed ({type(exc).__name__}); the server log has the details")
        lifecycle.failed[name] = (time.monotonic(), error)
        raise error from exc
    lifecycle.failed.pop(name, None)
    state.models.add(model)
    log.info("model_loaded", model=name, engine=model.info.engine)
    return model


async def load_model(state: AppState, name: str) -> ModelEntry:
    """Load the model ``name`` names and serve it beside the loaded ones; its entry.
    Idempotent for a loaded model."""
    lifecycle = state.lifecycle
    if state.models.get(name) is not None and name not in lifecycle.unloading:
        return _entry(state, name, None)
    lifecycle.check_lock(name, "loading")
    if lifecycle.busy:
        doing = ", ".join(sorted(lifecycle.loading | lifecycle.unloading))
        raise lifecycle.busy_error(f"Another load or unload is in progress ({doing}); retry once it finishes")
    candidate = await find_candidate(state, name)
    if candidate is None:
        raise ModelNotFound(f"The model '{name}' is neither loaded nor loadable on this server (GET /api/models lists them)", param="model")
    if lifecycle.busy or state.models.get(name) is not None:  # another call got there while the directories were read
        raise lifecycle.busy_error(f"Another load or unload began meanwhile ({name}); retry once it finishes")
    lifecycle.check_lock(name, "loading")
    async with marked(lifecycle.loading, name):
        location, factory = await on_model_thread(state, lambda: locate_engine(state, candidate))
        await asyncio.to_thread(check_loadable, state, name, location, factory)
        await load_planned(state, candidate, location, factory)
    return _entry(state, name, candidate)


async def unload_now(state: AppState, model: ServedModel) -> None:
    """Unload ``model``: refused to new requests from now on (503 ``model_busy``), its
    running requests waited for up to ``--graceful-unload-timeout`` then cancelled, out
    of the registry, the plugins' ``millm_model_unloaded`` hooks, its memory freed."""
    lifecycle = state.lifecycle
    name = model.info.served_name
    lifecycle.remember(model)  # its name stays loadable
    async with marked(lifecycle.unloading, name):
        timeout = state.settings.graceful_unload_timeout
        if not await lifecycle.drain(name, timeout):
            cancelled = state.scheduler.cancel_jobs(model.engine)
            log.warning("unload_cancelled_requests", model=name, after_s=timeout, jobs=cancelled)
            await lifecycle.drain(name, CANCEL_GRACE_S)
        state.models.remove(name)
        if lifecycle.locked == name:
            lifecycle.locked = None
        state.host.model_unloaded(state.app, model)
        del model
        await on_model_thread(state, gc.collect)  # the weights go now, not whenever the collector runs
    log.info("model_unloaded", model=name)


async def unload_model(state: AppState, name: str) -> ModelEntry:
    """Stop serving ``name`` gracefully; its entry afterwards."""
    lifecycle = state.lifecycle
    model = state.models.get(name)
    if model is None:
        raise ModelNotFound(f"The model '{name}' is not loaded on this server", param="model")
    if lifecycle.locked == name:
        raise ModelLocked(f"'{name}' is locked; unlock it first (POST /api/models/{name}/unlock)", param="model")
    if lifecycle.busy:
        raise lifecycle.busy_error("Another load or unload is in progress; retry once it finishes")
    state.host.model_unloading(state.app, model)  # a plugin may keep it (409 weights_unsaved, …)
    await unload_now(state, model)
    found, engines = await scan(state)
    return _entry(state, name, found.get(name), engines.get(name))


class NoFields(msgspec.Struct, forbid_unknown_fields=True):
    """The body of a route that takes none: empty or ``{}``; any field is refused, naming it."""


async def _no_fields(request: Request) -> None:
    from ..web import read_json  # the web helpers import the routes: read at call time

    await read_json(request, NoFields)


async def load(request: Request) -> Response:
    """``POST /api/models/{model_id}/load``."""
    await _no_fields(request)
    state = app_state(request)
    return _json(await load_model(state, _model_id(request)))


async def unload(request: Request) -> Response:
    """``POST /api/models/{model_id}/unload``."""
    await _no_fields(request)
    state = app_state(request)
    return _json(await unload_model(state, _model_id(request)))


def _loaded(state: AppState, name: str) -> None:
    """A lock or unlock concerns a loaded model, and waits out any load or unload."""
    if state.models.get(name) is None:
        raise ModelNotFound(f"The model '{name}' is not loaded on this server; load it first", param="model")
    if state.lifecycle.busy:
        raise state.lifecycle.busy_error("A load or unload is in progress; retry once it finishes")


async def lock(request: Request) -> Response:
    """``POST /api/models/{model_id}/lock``: only this model is listed and served."""
    await _no_fields(request)
    state = app_state(request)
    name = _model_id(request)
    _loaded(state, name)
    state.lifecycle.check_lock(name, "locking")
    state.lifecycle.locked = name
    log.info("model_locked", model=name)
    return _json(_entry(state, name, None))


async def unlock(request: Request) -> Response:
    """``POST /api/models/{model_id}/unlock``; a no-op for a model that is not locked."""
    await _no_fields(request)
    state = app_state(request)
    name = _model_id(request)
    _loaded(state, name)
    state.lifecycle.check_lock(name, "unlocking")
    if state.lifecycle.locked == name:
        state.lifecycle.locked = None
        log.info("model_unlocked", model=name)
    return _json(_entry(state, name, None))


_PATH = "/api/models/{model_id:path}"
ROUTES = [
    ("/api/models", list_catalog, ["GET"], RouteDoc("Every model this server can serve, loaded or not", response=ModelCatalog, errors=())),
    (f"{_PATH}/load", load, ["POST"], RouteDoc("Load a model and serve it", response=ModelEntry, errors=("404", "409", "500", "503"))),
    (
        f"{_PATH}/unload",
        unload,
        ["POST"],
        RouteDoc("Unload a model once its running requests end", response=ModelEntry, errors=("404", "409", "503")),
    ),
    (f"{_PATH}/lock", lock, ["POST"], RouteDoc("Serve and list only this model", response=ModelEntry, errors=("404", "409"))),
    (f"{_PATH}/unlock", unlock, ["POST"], RouteDoc("Serve every loaded model again", response=ModelEntry, errors=("404", "409"))),
]
