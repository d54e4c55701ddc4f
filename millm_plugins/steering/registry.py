"""Registered SAEs (persisted) and where they are attached (runtime state of one app)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from millm_core.errors import InvalidRequest, MillmError, NotFound
from millm_core.store import Store

from .sae import SAE, load_sae

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
    """Per-app steering state: loaded SAEs and attachments ``(sae_id, layer)``."""

    store: Store
    loaded: dict[str, SAE] = field(default_factory=dict)
    attachments: list[tuple[str, int]] = field(default_factory=list)

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
        self.attachments = [a for a in self.attachments if a[0] != sae_id]

    def attach(self, sae_id: str, layer: int, d_model: int, n_layers: int) -> None:
        sae = self.get(sae_id)
        sae.check_model(d_model)
        if not 0 <= layer < n_layers:
            raise InvalidRequest(f"layer must be 0–{n_layers - 1} for the served model", param="layer")
        if (sae_id, layer) not in self.attachments:
            self.attachments.append((sae_id, layer))

    def detach(self, sae_id: str, layer: int | None) -> int:
        self.get(sae_id)
        before = len(self.attachments)
        self.attachments = [a for a in self.attachments if not (a[0] == sae_id and (layer is None or a[1] == layer))]
        return before - len(self.attachments)

    def layers_of(self, sae_id: str) -> list[int]:
        return sorted(layer for s, layer in self.attachments if s == sae_id)
