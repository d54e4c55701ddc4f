"""The steering plugin's state for one app: registered SAEs (persisted), where they are
attached, the live manual values, the active profile and the steering epoch.

Attachments, manual values and the active profile are the running server's state; SAE
registrations, profiles and clusters live in the database. Every operator write to the live
state moves ``epoch``, so a request can tell whether global steering changed while it ran.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from millm_core.api import InvalidRequest, MillmError, NotFound, Store

from .inline import SAENotAttached
from .profiles import ProfileBook
from .sae import SAE, load_sae

# Append-only: each statement runs once per database (namespace "steering").
MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS saes (id TEXT PRIMARY KEY, path TEXT NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE profiles (name TEXT PRIMARY KEY, body BLOB NOT NULL, created REAL NOT NULL)",
)

Entry = tuple[str, int]  # (sae_id, layer)

_ID = re.compile(r"^[A-Za-z0-9._\-]{1,128}$")


class SAEExists(MillmError):
    status = 409
    type = "invalid_request_error"
    code = "sae_exists"


def derive_id(path: str) -> str:
    """A readable id from a path: the last two path parts joined by ``--``."""
    parts = [p for p in os.path.normpath(os.path.abspath(path)).split(os.sep) if p][-2:]
    raw = "--".join(parts).removesuffix(".npz")
    return re.sub(r"[^A-Za-z0-9._\-]", "_", raw)[:128] or "sae"


@dataclass
class SteeringState:
    """Per-app steering state: loaded SAEs, attachments ``(sae_id, layer)``, the manual
    values per attachment, the active profile, and the epoch."""

    store: Store
    loaded: dict[str, SAE] = field(default_factory=dict)
    attachments: list[Entry] = field(default_factory=list)
    manual: dict[Entry, dict[int, float]] = field(default_factory=dict)
    active: tuple[str, Entry] | None = None  # the active profile's name and where it applies
    epoch: int = 0
    book: ProfileBook = field(init=False)

    def __post_init__(self) -> None:
        self.store.migrate("steering", MIGRATIONS)
        self.book = ProfileBook(self.store)

    def bump(self) -> None:
        """An operator changed the live state."""
        self.epoch += 1

    def entry(self, sae_id: str, layer: int | None) -> Entry:
        """The attachment ``(sae_id, layer)`` a write names; ``layer`` may be omitted when
        the SAE is attached at exactly one layer."""
        self.get(sae_id)
        layers = self.layers_of(sae_id)
        if layer is None:
            if len(layers) != 1:
                where = f"at layers {layers}; name one with layer" if layers else "nowhere"
                raise (InvalidRequest if layers else SAENotAttached)(f"SAE {sae_id!r} is attached {where}", param="layer")
            return sae_id, layers[0]
        if layer not in layers:
            raise SAENotAttached(f"SAE {sae_id!r} is not attached at layer {layer}", param="layer")
        return sae_id, layer

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

    def get(self, sae_id: str) -> SAE:
        if sae_id not in self.loaded:
            rows = self.store.query("SELECT path FROM saes WHERE id = ?", (sae_id,))
            if not rows:
                raise NotFound(f"no SAE with id {sae_id!r} is registered", code="sae_not_found", param="id")
            self.loaded[sae_id] = load_sae(str(rows[0][0]))
        return self.loaded[sae_id]

    def delete(self, sae_id: str) -> None:
        self.get(sae_id)
        with self.store.transaction() as conn:
            conn.execute("DELETE FROM saes WHERE id = ?", (sae_id,))
        self.loaded.pop(sae_id, None)
        self.detach(sae_id, None)

    def attach(self, sae_id: str, layer: int, d_model: int, n_layers: int) -> None:
        sae = self.get(sae_id)
        sae.check_model(d_model)
        if not 0 <= layer < n_layers:
            raise InvalidRequest(f"layer must be 0–{n_layers - 1} for the served model", param="layer")
        if (sae_id, layer) not in self.attachments:
            self.attachments.append((sae_id, layer))
            self.bump()

    def detach(self, sae_id: str, layer: int | None) -> int:
        """Detach ``sae_id`` at ``layer`` (all layers for None). Manual values there go
        with it, and the active profile is deactivated if it was bound there. Returns how
        many attachments were removed."""
        gone = [a for a in self.attachments if a[0] == sae_id and (layer is None or a[1] == layer)]
        self.attachments = [a for a in self.attachments if a not in gone]
        for entry in gone:
            self.manual.pop(entry, None)
            if self.active is not None and self.active[1] == entry:
                self.active = None
        if gone:
            self.bump()
        return len(gone)

    def layers_of(self, sae_id: str) -> list[int]:
        return sorted(layer for s, layer in self.attachments if s == sae_id)
