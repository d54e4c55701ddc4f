"""The steering plugin's state for one app: the snapshot (:class:`~.live.Live`: attachments,
manual values, the active profile, the epoch, the saved profiles and the attached SAEs) and
a cache of the SAEs read from files. All of it but the loaded SAEs is persisted.

Every write goes through :meth:`SteeringState.commit`, in one transaction off the event
loop: it reads the database's version first and, when another server wrote since this one
last looked, computes the write from the state re-read in that transaction, never from a
stale copy. It then persists the new state, moves the version (and the epoch when a plain
request would run differently) and only then makes the snapshot current. A write the
database refuses (``database_busy``) changes nothing. The epoch resumes above the persisted
one after a restart, so it never goes back; servers sharing a database share it.

Requests read the snapshot only (no SQLite, no files on the event loop). It is kept fresh
by :meth:`SteeringState.watch`, which checks the database's version every ``REFRESH_S`` off
the loop and re-reads the state when another server moved it; management routes check at
once (:meth:`SteeringState.refresh`) before they answer.
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import structlog

from millm_core.api import Capability, InvalidRequest, MillmError, ModelInfo, NotFound, ServedModel, Store, watching

from . import live as persisted
from .inline import SAENotAttached
from .live import Entry, Live, Unusable
from .sae import SAE, load_sae

# Append-only: each statement runs once per database (namespace "steering").
MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS saes (id TEXT PRIMARY KEY, path TEXT NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE profiles (name TEXT PRIMARY KEY, body BLOB NOT NULL, created REAL NOT NULL)",
    *persisted.TABLES,
    *persisted.VERSIONING,
)
STARTUP_WAIT_S = 10.0  # start-up writes may wait for another server's lock this long
REFRESH_S = watching.REFRESH_S  # how often a server looks for another server's writes

_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")

log = structlog.get_logger("millm.steering")

Change = Callable[[Live], Live | None]
Write = Callable[[sqlite3.Connection], object]


class SAEExists(MillmError):
    status = 409
    type = "invalid_request_error"
    code = "sae_exists"


class AttachmentUnusable(MillmError):
    """409: the attachment is listed but cannot be applied (see ``GET /api/steering``);
    detach it, or restore its files and attach it again."""

    status = 409
    type = "invalid_request_error"
    code = "attachment_unusable"


@dataclass(frozen=True)
class Detached:
    """What detaching an SAE took with it: the attachments removed, the active profile
    deactivated because it was bound to one of them (its name, else None), and the manual
    values erased there (feature values, over all those attachments)."""

    attachments: int = 0
    deactivated_profile: str | None = None
    manual_values_removed: int = 0

    @classmethod
    def of(cls, live: Live, gone: list[Entry]) -> Detached:
        """What detaching ``gone`` from ``live`` removes (see :meth:`Live.without`)."""
        deactivated = live.active[0] if live.active is not None and live.active[1] in gone else None
        values = sum(len(v) for e, v in live.manual.items() if e in gone)
        return cls(attachments=len(gone), deactivated_profile=deactivated, manual_values_removed=values)


def derive_id(path: str) -> str:
    """A readable id from a path: the last two path parts joined by ``--``."""
    parts = [p for p in os.path.normpath(os.path.abspath(path)).split(os.sep) if p][-2:]
    raw = "--".join(parts).removesuffix(".npz")
    return re.sub(r"[^A-Za-z0-9._\-]", "_", raw)[:128] or "sae"


def entry_of(live: Live, sae_id: str, layer: int | None) -> Entry:
    """The attachment ``(sae_id, layer)`` a write names; ``layer`` may be omitted when the
    SAE is attached at exactly one layer. (The caller checks that the SAE exists.)"""
    layers = sorted(layer_ for s, layer_ in live.attachments if s == sae_id)
    if layer is None:
        if len(layers) != 1:
            where = f"at layers {layers}; name one with layer" if layers else "nowhere"
            raise (InvalidRequest if layers else SAENotAttached)(f"SAE {sae_id!r} is attached {where}", param="layer")
        return sae_id, layers[0]
    if layer not in layers:
        raise SAENotAttached(f"SAE {sae_id!r} is not attached at layer {layer}", param="layer")
    return sae_id, layer


def require_usable(live: Live, entry: Entry) -> None:
    """Refuse a write that needs ``entry`` applied when it cannot be."""
    broken = live.unusable.get(entry)
    if broken is not None:
        raise AttachmentUnusable(
            f"SAE {entry[0]!r} at layer {entry[1]} is attached but unusable ({broken.reason}: {broken.message}); detach it, or fix it and attach it again",
            param="layer",
        )


def _in(conn: sqlite3.Connection) -> persisted.Query:
    return lambda sql, args: list(conn.execute(sql, args).fetchall())


@dataclass
class SteeringState:
    """Per-app steering state: the current snapshot, the SAE cache and the served model."""

    store: Store
    loaded: dict[str, SAE] = field(default_factory=dict)  # SAEs read from files, by id
    live: Live = field(default_factory=Live)
    model: ServedModel | None = None  # the resident model, once loaded
    writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    watcher: asyncio.Task[None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.store.migrate("steering", MIGRATIONS)
        self.restore()

    # ------------------------------------------------------------------ reads of the snapshot

    @property
    def attachments(self) -> tuple[Entry, ...]:
        return self.live.attachments

    @property
    def epoch(self) -> int:
        return self.live.epoch

    @property
    def active(self) -> tuple[str, Entry] | None:
        return self.live.active

    def layers_of(self, sae_id: str) -> list[int]:
        return sorted(layer for s, layer in self.live.attachments if s == sae_id)

    # ------------------------------------------------------------------ SAEs (blocking)

    def registered(self) -> list[tuple[str, str]]:
        return [(str(i), str(p)) for i, p in self.store.query("SELECT id, path FROM saes ORDER BY id")]

    def path_of(self, sae_id: str) -> str:
        rows = self.store.query("SELECT path FROM saes WHERE id = ?", (sae_id,))
        if not rows:
            raise NotFound(f"no SAE with id {sae_id!r} is registered", code="sae_not_found", param="id")
        return str(rows[0][0])

    def get(self, sae_id: str) -> SAE:
        """The SAE, loaded from its files the first time (404 unregistered; 400
        ``invalid_sae`` when its files cannot be read)."""
        sae = self.loaded.get(sae_id)
        if sae is None:
            sae = self.loaded[sae_id] = load_sae(self.path_of(sae_id))
        return sae

    async def sae(self, sae_id: str) -> SAE:
        """:meth:`get`, off the event loop unless it is already loaded."""
        sae = self.loaded.get(sae_id)
        return sae if sae is not None else await asyncio.to_thread(self.get, sae_id)

    # ------------------------------------------------------------------ snapshots

    def _complete(self, live: Live, registered: Mapping[str, str]) -> Live:
        """``live`` with the SAE of each attachment (from the cache when it holds the
        registered files, else read now: blocking) and its unusable attachments derived.
        Drops from the cache the SAEs no longer registered, or registered anew elsewhere."""
        for sae_id, sae in list(self.loaded.items()):
            if registered.get(sae_id) != os.path.abspath(sae.path):
                self.loaded.pop(sae_id, None)
        saes: dict[str, SAE] = {}
        unreadable: dict[str, str] = {}
        for sae_id in dict.fromkeys(s for s, _ in live.attachments):
            path = registered.get(sae_id)
            try:
                if path is None:
                    raise NotFound(f"SAE {sae_id!r} is not registered", code="sae_not_found")
                sae = self.loaded.get(sae_id) or load_sae(path)
            except MillmError as exc:
                unreadable[sae_id] = exc.message
                continue
            saes[sae_id] = self.loaded[sae_id] = sae
        return self._derived(replace(live, saes=saes, unreadable=unreadable))

    def _derived(self, live: Live) -> Live:
        """``live`` with ``unusable`` derived from its SAEs and the served model (quick: no
        I/O). An attachment whose SAE is not loaded, or that the model cannot take, is
        unusable."""
        served = self.model
        unusable: dict[Entry, Unusable] = {}
        for entry in live.attachments:
            sae_id, layer = entry
            sae = live.saes.get(sae_id)
            if sae is None:
                unusable[entry] = Unusable(persisted.SAE_UNREADABLE, live.unreadable.get(sae_id, f"SAE {sae_id!r} is not loaded"))
            elif served is None:
                continue
            elif Capability.STEERING not in served.capabilities:
                unusable[entry] = Unusable(
                    persisted.NOT_STEERABLE, f"the {served.info.engine} engine serving {served.info.served_name!r} cannot be steered"
                )
            elif sae.d_in != served.info.d_model:
                unusable[entry] = Unusable(
                    persisted.WIDTH_MISMATCH, f"the SAE reads width {sae.d_in}; {served.info.served_name!r} has width {served.info.d_model}"
                )
            elif not 0 <= layer < served.info.n_layers:
                unusable[entry] = Unusable(
                    persisted.LAYER_OUT_OF_RANGE, f"{served.info.served_name!r} has layers 0–{served.info.n_layers - 1}"
                )
        return replace(live, unusable=unusable)

    def _install(self, new: Live | None) -> None:
        """Make ``new`` current (on the event loop) unless the current snapshot is as
        recent; the unusable marks are derived again for the model served now."""
        if new is not None and new.version > self.live.version:
            self.live = self._derived(new)

    def _read(self) -> Live | None:
        """The state in the database when its version is not the snapshot's, else None
        (blocking). Consistent without a write lock: the reads count only if the version
        did not move while they ran (every write moves it)."""
        query: persisted.Query = self.store.query
        read = watching.consistent_read(lambda: persisted.version(query), self.live.version, lambda: persisted.load(query), lambda s: s[0].version)
        return self._complete(*read) if read is not None else None  # None: unchanged, or written to without a pause

    async def refresh(self) -> Live:
        """The current snapshot, after re-reading the database (off the event loop) if
        another server wrote since this one last looked."""
        self._install(await asyncio.to_thread(self._read))
        return self.live

    async def watch(self) -> None:
        """Pick up other servers' writes every ``REFRESH_S`` for as long as the app runs,
        so that a request (which reads the snapshot only) runs with them."""
        await watching.watch(self.refresh, log, "steering_refresh_failed", REFRESH_S)

    # ------------------------------------------------------------------ writes

    async def commit(self, change: Change | None = None, also: Write | None = None) -> Live:
        """Apply one operator write and return the snapshot it made current. ``change``
        gets the current state (the database's, re-read if another server wrote; it runs
        in a worker thread inside the write transaction: keep it pure and quick, and
        raise to refuse) and returns the new one, or None when nothing changes. ``also`` is
        more SQL for the same transaction."""
        async with self.writing:
            work = asyncio.ensure_future(asyncio.to_thread(self._transact, change, also))
            try:
                new = await asyncio.shield(work)
            except asyncio.CancelledError:
                # The write goes on in its thread: memory must follow the database even
                # when the request that asked for it is gone.
                self._install(await work)
                raise
            self._install(new)
            return self.live

    def _transact(self, change: Change | None, also: Write | None) -> Live | None:
        with self.store.transaction() as conn:
            query = _in(conn)
            held = self.live
            version = persisted.version(query)
            current = held if version == held.version else self._complete(*persisted.load(query))
            new = change(current) if change is not None else None
            if also is not None:
                also(conn)
            elif new is None:
                return current if current is not held else None  # nothing to write
            new = new if new is not None else current
            epoch = current.epoch if new.steers_like(current) else current.epoch + 1
            registered = {str(i): str(p) for i, p in query("SELECT id, path FROM saes", ())}
            new = self._complete(replace(new, epoch=epoch, version=version + 1), registered)
            persisted.save(conn, new, current)
            return new

    async def register(self, path: str, sae_id: str | None) -> tuple[str, SAE]:
        """Register the SAE at ``path`` under ``sae_id`` (None: derived from the path; a
        sent id, an empty one too, is checked as sent)."""
        sae_id = derive_id(path) if sae_id is None else sae_id
        if not _ID.match(sae_id):
            raise InvalidRequest("id must be 1–128 characters of A-Z a-z 0-9 . _ -", param="id")
        sae = await asyncio.to_thread(load_sae, path)  # validates the files before anything is recorded

        def insert(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM saes WHERE id = ?", (sae_id,)).fetchone():
                raise SAEExists(f"an SAE with id {sae_id!r} is already registered", param="id")
            conn.execute("INSERT INTO saes (id, path, created) VALUES (?, ?, ?)", (sae_id, os.path.abspath(path), time.time()))

        await self.commit(also=insert)
        self.loaded[sae_id] = sae
        return sae_id, sae

    async def delete(self, sae_id: str) -> Detached:
        """Forget the SAE, detaching it everywhere (one transaction, with what
        :meth:`detach` removes). Returns what the detaching removed."""
        await asyncio.to_thread(self.path_of, sae_id)
        detached = Detached()

        def change(live: Live) -> Live | None:
            nonlocal detached
            gone = [a for a in live.attachments if a[0] == sae_id]
            detached = Detached.of(live, gone)
            return live.without(gone) if gone else None

        await self.commit(change, also=lambda conn: conn.execute("DELETE FROM saes WHERE id = ?", (sae_id,)))
        self.loaded.pop(sae_id, None)
        return detached

    async def attach(self, sae_id: str, layer: int, model: ModelInfo) -> None:
        """Attach at ``layer`` of the resident model. Attaching an unusable attachment
        again checks it again, and makes it usable when it now fits."""
        sae = await self.sae(sae_id)
        sae.check_model(model.d_model)
        if not 0 <= layer < model.n_layers:
            raise InvalidRequest(f"layer must be 0–{model.n_layers - 1} for the served model", param="layer")
        entry = (sae_id, layer)

        def change(live: Live) -> Live | None:
            if entry in live.attachments and entry not in live.unusable:
                return None
            attachments = live.attachments if entry in live.attachments else (*live.attachments, entry)
            return replace(live, attachments=attachments, unusable={e: u for e, u in live.unusable.items() if e != entry})

        await self.commit(change)

    async def detach(self, sae_id: str, layer: int | None) -> Detached:
        """Detach ``sae_id`` at ``layer`` (all layers for None). Manual values there go
        with it, and the active profile is deactivated if it was bound there. Returns what
        was removed (the route reports it: nothing goes silently)."""
        detached = Detached()

        def change(live: Live) -> Live | None:
            nonlocal detached
            gone = [a for a in live.attachments if a[0] == sae_id and (layer is None or a[1] == layer)]
            detached = Detached.of(live, gone)
            return live.without(gone) if gone else None

        await self.commit(change)
        return detached

    # ------------------------------------------------------------------ start-up

    def restore(self) -> None:
        """Read the persisted state (at start-up, before the server answers). The epoch
        resumes one above the persisted one: a restart may change what a request gets, and
        the epoch never goes back. Each attached SAE is loaded now; one whose files cannot
        be read stays attached, marked unusable."""
        self._complete(*persisted.load(self.store.query))  # read the files before taking the lock
        with self.store.transaction(wait=STARTUP_WAIT_S) as conn:
            stored, registered = persisted.load(_in(conn))
            self.live = self._complete(replace(stored, epoch=stored.epoch + 1, version=stored.version + 1), registered)
            persisted.save(conn, self.live, stored)

    def check_model(self, served: ServedModel | None) -> None:
        """The resident model is loaded (or, None, unloaded): mark the attachments it
        cannot take (not steerable, another residual width, a layer it does not have).
        Quick: no I/O."""
        self.model = served
        self.live = self._derived(self.live)
        if served is not None and self.live.attachments:  # say which attachments the new resident takes
            log.info(
                "steering_attachments_checked",
                model=served.info.served_name,
                usable=[f"{s}@{layer}" for s, layer in self.live.attachments if (s, layer) not in self.live.unusable],
                unusable={f"{s}@{layer}": u.reason for (s, layer), u in self.live.unusable.items()},
            )

    def start_watching(self) -> None:
        """Start :meth:`watch` on the running event loop (a database file only: nothing
        else can write to a ``:memory:`` one)."""
        if self.watcher is None:  # stays None outside a server (a script: nothing serves requests)
            self.watcher = watching.start(self.store, self.watch, "millm-steering-watch")

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
