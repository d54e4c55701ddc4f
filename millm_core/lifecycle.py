"""Model lifecycle state: which models are loading, unloading or locked, the requests
running on each (so an unload can wait for them), and the catalogue of models this
server could load (``GET /api/models``).

One :class:`ModelLifecycle` lives in the app's state (no global). It runs on the event
loop only; the model thread never touches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from .config import Settings
from .engine import ModelLocation
from .errors import ConfigError, MillmError, ModelBusy, ModelLocked
from .loading import choose_engine, engine_takes, local_revision
from .plugins import PluginHost
from .registry import ModelRegistry, ServedModel

T = TypeVar("T")
ModelState = Literal["available", "loading", "loaded", "unloading"]
# What a client is told to wait before retrying a model that is loading or unloading.
BUSY_RETRY_AFTER_S = 2
# How often an unload looks whether the model's requests have ended.
DRAIN_POLL_S = 0.02
# How long a failed load is answered from memory instead of being tried again.
LOAD_FAILURE_MEMORY_S = 30.0


class ModelEntry(msgspec.Struct, kw_only=True):
    """One model ``GET /api/models`` lists: ``engine`` is the engine that serves it or
    would (None when that is not known before loading, or none can); ``source`` says where
    it was found (``loaded``: served but in no catalogue, ``plugin``: a model-source
    plugin, ``directory``: under ``--model-roots``)."""

    id: str
    object: Literal["model"] = "model"
    engine: str | None = None
    state: ModelState = "available"
    locked: bool = False
    source: Literal["loaded", "plugin", "directory"] = "loaded"


class ModelCatalog(msgspec.Struct, kw_only=True):
    """``GET /api/models``: every model this server can serve, loaded or not."""

    object: Literal["list"] = "list"
    data: list[ModelEntry] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    """A model that can be loaded: ``locate`` gives its location (it may convert files
    once: run it on the model thread). ``path`` is known without locating for a model
    under ``--model-roots`` or one this server loaded before (``source: "loaded"``)."""

    id: str
    source: Literal["plugin", "directory", "loaded"]
    locate: Callable[[], ModelLocation]
    path: str | None = None


def _root_candidates(root: str, loadable: Callable[[str], bool]) -> Iterator[tuple[str, str]]:
    """``(id, path)`` for each entry of ``root`` that some engine can load (``loadable``:
    a checkpoint directory, a GGUF file, whatever the installed engines take), and for
    each such entry one level below a folder that is not one itself (``org/model``
    layouts). Ids are the paths relative to the root."""
    root = os.path.expanduser(root)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if loadable(path):
            yield name, path
        elif os.path.isdir(path):
            with contextlib.suppress(OSError):
                for inner in sorted(os.listdir(path)):
                    if loadable(os.path.join(path, inner)):
                        yield f"{name}/{inner}", os.path.join(path, inner)


def remembered_candidate(name: str, location: ModelLocation) -> Candidate:
    """A model this server served before (the one ``--model`` named, say), loadable again
    by the name it was served under."""
    return Candidate(name, "loaded", lambda: location, location.path)


def candidates(settings: Settings, host: PluginHost, remembered: Mapping[str, ModelLocation] | None = None) -> dict[str, Candidate]:
    """Every model this server could load, by id: the model sources plugins offer (not
    their aliases, nor those for another engine than ``--engine``), then what ``--model-roots`` holds (a plugin's name wins a clash), then
    the models it served before under their names (``remembered``). Never downloads
    anything and never converts: nothing is located until it is loaded."""
    found: dict[str, Candidate] = {}
    engines = host.engines() if settings.model_roots else []

    def loadable(path: str) -> bool:
        location = ModelLocation(path=path, served_name=os.path.basename(path))
        return any(engine_takes(engine, location) for engine in engines)

    for root in settings.model_roots:
        for model_id, path in _root_candidates(root, loadable):
            location = ModelLocation(path=os.path.abspath(path), served_name=model_id)

            def locate(location: ModelLocation = location) -> ModelLocation:
                folder = location.path if os.path.isdir(location.path) else os.path.dirname(location.path)
                return dataclasses.replace(location, revision=local_revision(folder))

            found.setdefault(model_id, Candidate(model_id, "directory", locate, location.path))
    for name, source in host.model_sources().items():
        if source.alias or (source.engine and settings.engine and source.engine != settings.engine):
            continue  # an alias loads nothing; a source for another engine than the one forced cannot load

        def materialise(name: str = name, materialise: Callable[[Settings], ModelLocation] = source.materialise) -> ModelLocation:
            return dataclasses.replace(materialise(settings), served_name=name)

        found[name] = Candidate(name, "plugin", materialise)
    for name, location in (remembered or {}).items():
        found.setdefault(name, remembered_candidate(name, location))
    return found


def engine_for(candidate: Candidate, settings: Settings, host: PluginHost) -> str | None:
    """The engine that would load ``candidate``, when its files are known without
    locating it (a model under ``--model-roots``); else None."""
    if candidate.path is None:
        return None
    try:
        return choose_engine(ModelLocation(path=candidate.path, served_name=candidate.id), settings, host).name
    except ConfigError:
        return None


class Hold(Protocol):
    """Hands a request's count to its streamed response (released when the stream ends)."""

    def __call__(self, response: T) -> T: ...


class Lease:
    """One admitted request on a model, counted until it ends: :meth:`release` (once) for
    a reply, or :meth:`hold` hands a stream's end the release."""

    __slots__ = ("_usage", "_name", "_released")

    def __init__(self, usage: dict[str, int], name: str) -> None:
        self._usage = usage
        self._name = name
        self._released = False
        usage[name] = usage.get(name, 0) + 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            left = self._usage.get(self._name, 1) - 1
            if left > 0:
                self._usage[self._name] = left
            else:
                self._usage.pop(self._name, None)


class _Releasing:
    """A stream's body, releasing its lease when the stream ends or is closed, even when
    it never started (the response closes its body however it ends)."""

    def __init__(self, body: Any, lease: Lease) -> None:
        self._body = body
        self._iterator: Any = None
        self._lease = lease

    def __aiter__(self) -> _Releasing:
        return self

    async def __anext__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._body.__aiter__()
        try:
            return await self._iterator.__anext__()
        except BaseException:
            self._lease.release()
            raise

    async def aclose(self) -> None:
        try:
            close = getattr(self._iterator if self._iterator is not None else self._body, "aclose", None)
            if close is not None:
                await close()
        finally:
            self._lease.release()


@dataclass
class ModelLifecycle:
    """Loads and unloads in progress, the lock, the requests running per model, the
    models served before (loadable again by their names) and recent load failures."""

    loading: set[str] = field(default_factory=set)
    unloading: set[str] = field(default_factory=set)
    locked: str | None = None
    running: dict[str, int] = field(default_factory=dict)  # served name -> admitted requests not ended
    remembered: dict[str, ModelLocation] = field(default_factory=dict)  # served name -> where its files are
    failed: dict[str, tuple[float, MillmError]] = field(default_factory=dict)  # id -> (when, why) of a failed load
    switching: asyncio.Task[None] | None = None  # the switch in progress, owned by no request
    # The last catalogue read: (when, candidates, their engines); see routes/lifecycle.scan.
    scanned: tuple[float, dict[str, Candidate], dict[str, str | None]] | None = None

    def remember(self, model: ServedModel) -> None:
        """Keep where ``model``'s files are, so that its name stays loadable after it goes."""
        if model.location is not None:
            self.remembered[model.info.served_name] = model.location

    def recent_failure(self, name: str) -> MillmError | None:
        """The error of a load of ``name`` that failed in the last ``LOAD_FAILURE_MEMORY_S``
        seconds: a request naming it gets that answer again instead of another attempt
        (and another eviction)."""
        seen = self.failed.get(name)
        if seen is None:
            return None
        when, error = seen
        if time.monotonic() - when > LOAD_FAILURE_MEMORY_S:
            del self.failed[name]
            return None
        return error

    @property
    def busy(self) -> bool:
        """A load or an unload is in progress."""
        return bool(self.loading or self.unloading)

    def state_of(self, name: str, models: ModelRegistry) -> ModelState:
        if name in self.unloading:
            return "unloading"
        if name in self.loading:
            return "loading"
        return "loaded" if models.get(name) is not None else "available"

    def check_lock(self, name: str, what: str) -> None:
        """Refuse ``what`` (a request, a load) concerning ``name`` while another model is locked."""
        if self.locked is not None and self.locked != name:
            raise ModelLocked(
                f"'{self.locked}' is locked on this server; {what} '{name}' is refused until it is unlocked "
                f"(POST /api/models/{self.locked}/unlock)",
                param="model",
            )

    def busy_error(self, message: str) -> ModelBusy:
        return ModelBusy(message, headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})

    @contextlib.contextmanager
    def admitted(self, model: ServedModel) -> Iterator[Hold]:
        """Count a request on ``model`` while the block runs; refused first with 503
        ``model_busy`` while the model unloads and 409 ``model_locked`` while another is
        locked. The block's ``hold(response)`` hands the count to a stream, released when
        the stream ends."""
        name = model.info.served_name
        if name in self.unloading:
            raise self.busy_error(f"The model '{name}' is being unloaded; retry shortly")
        self.check_lock(name, "a request for")
        lease = Lease(self.running, name)
        held = False

        def hold(response: T) -> T:
            nonlocal held
            body = getattr(response, "body_iterator", None)
            if body is not None:
                response.body_iterator = _Releasing(body, lease)  # type: ignore[attr-defined]
                held = True
            return response

        try:
            yield hold
        finally:
            if not held:
                lease.release()

    async def drain(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the requests running on ``name`` to end; whether they did."""
        deadline = time.monotonic() + timeout_s
        while self.running.get(name, 0) > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True


@contextlib.asynccontextmanager
async def marked(names: set[str], name: str) -> AsyncIterator[None]:
    """``name`` is in ``names`` (loading or unloading) while the block runs."""
    names.add(name)
    try:
        yield
    finally:
        names.discard(name)
