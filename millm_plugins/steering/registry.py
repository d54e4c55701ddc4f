"""The steering plugin's state for one app: registered SAEs (persisted), and the live state
(:class:`~.live.Live`: attachments, manual values, the active profile, the epoch), also
persisted.

Every operator write to the live state goes through :meth:`SteeringState.commit`: under one
write lock it computes the new snapshot from the current one, persists it (with any other
write of the same operation) in one transaction off the event loop, and only then makes it
current and moves the epoch. A write the database refuses (``database_busy``) changes
nothing. The epoch resumes above the persisted one after a restart, so it never goes back.

Blocking work (SAE files, SQLite) is done by the plain methods here; routes call them with
``asyncio.to_thread`` (or through the ``async`` helpers), never on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from millm_core.api import Capability, InvalidRequest, MillmError, ModelInfo, NotFound, ServedModel, Store

from . import live as persisted
from .inline import SAENotAttached
from .live import Entry, Live, Unusable
from .profiles import ProfileBook
from .sae import SAE, load_sae

# Append-only: each statement runs once per database (namespace "steering").
MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS saes (id TEXT PRIMARY KEY, path TEXT NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE profiles (name TEXT PRIMARY KEY, body BLOB NOT NULL, created REAL NOT NULL)",
    *persisted.TABLES,
)
STARTUP_WAIT_S = 10.0  # start-up writes may wait for another server's lock this long

_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")

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


def derive_id(path: str) -> str:
    """A readable id from a path: the last two path parts joined by ``--``."""
    parts = [p for p in os.path.normpath(os.path.abspath(path)).split(os.sep) if p][-2:]
    raw = "--".join(parts).removesuffix(".npz")
    return re.sub(r"[^A-Za-z0-9._\-]", "_", raw)[:128] or "sae"


@dataclass
class SteeringState:
    """Per-app steering state: loaded SAEs, the live snapshot and the profile book."""

    store: Store
    loaded: dict[str, SAE] = field(default_factory=dict)
    live: Live = field(default_factory=Live)
    book: ProfileBook = field(init=False)
    writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.store.migrate("steering", MIGRATIONS)
        self.book = ProfileBook(self.store)
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

    def entry(self, sae_id: str, layer: int | None) -> Entry:
        """The attachment ``(sae_id, layer)`` a write names; ``layer`` may be omitted when
        the SAE is attached at exactly one layer. (The caller checks that the SAE exists.)"""
        layers = self.layers_of(sae_id)
        if layer is None:
            if len(layers) != 1:
                where = f"at layers {layers}; name one with layer" if layers else "nowhere"
                raise (InvalidRequest if layers else SAENotAttached)(f"SAE {sae_id!r} is attached {where}", param="layer")
            return sae_id, layers[0]
        if layer not in layers:
            raise SAENotAttached(f"SAE {sae_id!r} is not attached at layer {layer}", param="layer")
        return sae_id, layer

    def usable(self, entry: Entry) -> None:
        """Refuse a write that needs ``entry`` applied when it cannot be."""
        broken = self.live.unusable.get(entry)
        if broken is not None:
            raise AttachmentUnusable(
                f"SAE {entry[0]!r} at layer {entry[1]} is attached but unusable ({broken.reason}: {broken.message}); detach it, or fix it and attach it again",
                param="layer",
            )

    def layers_of(self, sae_id: str) -> list[int]:
        return sorted(layer for s, layer in self.live.attachments if s == sae_id)

    # ------------------------------------------------------------------ SAEs (blocking)

    def register(self, path: str, sae_id: str | None) -> tuple[str, SAE]:
        sae_id = sae_id or derive_id(path)
        if not _ID.match(sae_id):
            raise InvalidRequest("id must be 1–128 characters of A-Z a-z 0-9 . _ -", param="id")
        sae = load_sae(path)  # validates the files before anything is recorded
        with self.store.transaction() as conn:
            if conn.execute("SELECT 1 FROM saes WHERE id = ?", (sae_id,)).fetchone():
                raise SAEExists(f"an SAE with id {sae_id!r} is already registered", param="id")
            conn.execute("INSERT INTO saes (id, path, created) VALUES (?, ?, ?)", (sae_id, os.path.abspath(path), time.time()))
        self.loaded[sae_id] = sae
        return sae_id, sae

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

    # ------------------------------------------------------------------ writes

    async def commit(self, change: Callable[[Live], Live | None], also: Write | None = None) -> bool:
        """Apply one operator write. ``change`` gets the current snapshot (under the write
        lock, on the event loop: keep it pure and quick) and returns the new one, or None
        when the live state does not change. ``also`` is more SQL for the same transaction.
        Returns whether the live state changed (and the epoch moved)."""
        async with self.writing:
            before = self.live
            new = change(before)
            if new is not None:
                unusable = {e: u for e, u in new.unusable.items() if e in new.attachments}
                new = replace(new, epoch=before.epoch + 1, unusable=unusable)
            if new is not None or also is not None:
                write = asyncio.ensure_future(asyncio.to_thread(self._write, new, also))
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    # The write goes on in its thread: memory must follow the database
                    # even when the request that asked for it is gone.
                    await write
                    self._apply(before, new)
                    raise
            self._apply(before, new)
            return new is not None

    def _apply(self, before: Live, new: Live | None) -> None:
        """Make ``new`` current, keeping the marks the model load (``check_model``) put on
        attachments while the write was in flight, except those ``new`` itself cleared."""
        if new is None:
            return
        if self.live is not before:
            cleared = set(before.unusable) - set(new.unusable)
            marks = {e: u for e, u in self.live.unusable.items() if e in new.attachments and e not in cleared}
            new = replace(new, unusable={**marks, **new.unusable})
        self.live = new

    def _write(self, new: Live | None, also: Write | None) -> None:
        with self.store.transaction() as conn:
            if also is not None:
                also(conn)
            if new is not None:
                persisted.save(conn, new)

    async def delete(self, sae_id: str) -> None:
        """Forget the SAE, detaching it everywhere (one transaction)."""
        await asyncio.to_thread(self.path_of, sae_id)

        def change(live: Live) -> Live | None:
            gone = [a for a in live.attachments if a[0] == sae_id]
            return live.without(gone) if gone else None

        await self.commit(change, also=lambda conn: conn.execute("DELETE FROM saes WHERE id = ?", (sae_id,)))
        self.loaded.pop(sae_id, None)

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

    async def detach(self, sae_id: str, layer: int | None) -> int:
        """Detach ``sae_id`` at ``layer`` (all layers for None). Manual values there go
        with it, and the active profile is deactivated if it was bound there. Returns how
        many attachments were removed."""
        removed = 0

        def change(live: Live) -> Live | None:
            nonlocal removed
            gone = [a for a in live.attachments if a[0] == sae_id and (layer is None or a[1] == layer)]
            removed = len(gone)
            return live.without(gone) if gone else None

        await self.commit(change)
        return removed

    # ------------------------------------------------------------------ start-up

    def restore(self) -> None:
        """Read the persisted live state (at start-up, before the server answers). The
        epoch resumes one above the persisted one: a restart may change what a request
        gets, and the epoch never goes back. Each attached SAE is loaded now; one whose
        files cannot be read stays attached, marked unusable."""
        live = persisted.load(self.store)
        unusable: dict[Entry, Unusable] = {}
        for entry in live.attachments:
            try:
                self.get(entry[0])
            except MillmError as exc:
                unusable[entry] = Unusable(persisted.SAE_UNREADABLE, exc.message)
        self.live = replace(live, epoch=live.epoch + 1, unusable=unusable)
        with self.store.transaction(wait=STARTUP_WAIT_S) as conn:
            persisted.save(conn, self.live)

    def check_model(self, served: ServedModel) -> None:
        """The resident model is loaded: mark the attachments it cannot take (not
        steerable, another residual width, a layer it does not have). Quick: no I/O."""
        model = served.info
        unusable: dict[Entry, Unusable] = {}
        for entry in self.live.attachments:
            sae_id, layer = entry
            sae = self.loaded.get(sae_id)
            known = self.live.unusable.get(entry)
            if sae is None or (known is not None and known.reason == persisted.SAE_UNREADABLE):
                unusable[entry] = known or Unusable(persisted.SAE_UNREADABLE, f"SAE {sae_id!r} is not loaded")
            elif Capability.STEERING not in served.capabilities:
                unusable[entry] = Unusable(persisted.NOT_STEERABLE, f"the {model.engine} engine serving {model.served_name!r} cannot be steered")
            elif sae.d_in != model.d_model:
                unusable[entry] = Unusable(persisted.WIDTH_MISMATCH, f"the SAE reads width {sae.d_in}; {model.served_name!r} has width {model.d_model}")
            elif not 0 <= layer < model.n_layers:
                unusable[entry] = Unusable(persisted.LAYER_OUT_OF_RANGE, f"{model.served_name!r} has layers 0–{model.n_layers - 1}")
        self.live = replace(self.live, unusable=unusable)
