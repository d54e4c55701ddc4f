"""The live steering state as one immutable snapshot, and how it is persisted.

The live state is what a request with no steering fields runs with: the attachments
``(sae_id, layer)``, the manual values per attachment, the active profile, and the epoch.
It is persisted (the ``attachments``, ``manual_values`` and ``live_state`` tables), so a
restart never silently changes what a steered request gets. A write replaces the snapshot
whole: readers take ``state.live`` once and see one consistent state, never half a write.

``unusable`` is not persisted: it is derived at start-up from the files and the served
model (an attachment whose SAE can no longer be read, or that does not fit the model). Such
an attachment stays listed and is never applied; a request that would need it reports
``unknown;reason=claims_unreadable``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from millm_core.api import Store

Entry = tuple[str, int]  # (sae_id, layer)

# The attachment cannot be applied: its SAE's files cannot be read, its width is not the
# model's, its layer is not in the model, or the model cannot be steered at all.
SAE_UNREADABLE = "sae_unreadable"
WIDTH_MISMATCH = "width_mismatch"
LAYER_OUT_OF_RANGE = "layer_out_of_range"
NOT_STEERABLE = "not_steerable"
CLAIMS_UNREADABLE = "claims_unreadable"  # the X-miLLM-Steering reason for all of them

# Statements appended to the plugin's migrations (see registry.MIGRATIONS).
TABLES: tuple[str, ...] = (
    "CREATE TABLE attachments (position INTEGER PRIMARY KEY, sae_id TEXT NOT NULL, layer INTEGER NOT NULL, UNIQUE (sae_id, layer))",
    "CREATE TABLE manual_values (position INTEGER PRIMARY KEY, sae_id TEXT NOT NULL, layer INTEGER NOT NULL, body BLOB NOT NULL, UNIQUE (sae_id, layer))",
    "CREATE TABLE live_state (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, active_name TEXT, active_sae TEXT, active_layer INTEGER)",
)


@dataclass(frozen=True)
class Unusable:
    """Why an attachment is not applied: ``reason`` is one of the codes above."""

    reason: str
    message: str


@dataclass(frozen=True)
class Live:
    """One snapshot of the live state. Its mappings are never mutated: a write builds new
    ones (``dataclasses.replace``)."""

    attachments: tuple[Entry, ...] = ()
    manual: Mapping[Entry, Mapping[int, float]] = field(default_factory=dict)
    active: tuple[str, Entry] | None = None  # the active profile's name and where it applies
    epoch: int = 0
    unusable: Mapping[Entry, Unusable] = field(default_factory=dict)

    def without(self, gone: list[Entry]) -> Live:
        """The state with the attachments ``gone`` detached: their manual values go with
        them, and the active profile is deactivated if it was bound to one."""
        active = None if self.active is not None and self.active[1] in gone else self.active
        return Live(
            attachments=tuple(a for a in self.attachments if a not in gone),
            manual={e: v for e, v in self.manual.items() if e not in gone},
            active=active,
            epoch=self.epoch,
            unusable={e: u for e, u in self.unusable.items() if e not in gone},
        )


def load(store: Store) -> Live:
    """The persisted live state (an empty one in a new database)."""
    attachments = tuple((str(s), int(str(layer))) for s, layer in store.query("SELECT sae_id, layer FROM attachments ORDER BY position"))
    manual: dict[Entry, Mapping[int, float]] = {}
    for sae_id, layer, body in store.query("SELECT sae_id, layer, body FROM manual_values ORDER BY position"):
        assert isinstance(body, bytes)
        pairs = msgspec.msgpack.decode(body, type=list[tuple[int, float]])
        manual[(str(sae_id), int(str(layer)))] = dict(pairs)
    rows = store.query("SELECT epoch, active_name, active_sae, active_layer FROM live_state WHERE id = 1")
    if not rows:
        return Live(attachments=attachments, manual=manual)
    epoch, name, sae_id, layer = rows[0]
    active = (str(name), (str(sae_id), int(str(layer)))) if name is not None else None
    return Live(attachments=attachments, manual=manual, active=active, epoch=int(str(epoch)))


def save(conn: sqlite3.Connection, live: Live) -> None:
    """Replace the persisted live state with ``live`` (inside the caller's transaction).
    The strengths are stored as msgpack binary64, bit for bit."""
    conn.execute("DELETE FROM attachments")
    conn.executemany("INSERT INTO attachments (position, sae_id, layer) VALUES (?, ?, ?)", [(i, s, layer) for i, (s, layer) in enumerate(live.attachments)])
    conn.execute("DELETE FROM manual_values")
    conn.executemany(
        "INSERT INTO manual_values (position, sae_id, layer, body) VALUES (?, ?, ?, ?)",
        [(i, s, layer, msgspec.msgpack.encode(list(values.items()))) for i, ((s, layer), values) in enumerate(live.manual.items())],
    )
    name: str | None = None
    sae_id: str | None = None
    layer: int | None = None
    if live.active is not None:
        name, (sae_id, layer) = live.active
    conn.execute(
        "INSERT INTO live_state (id, epoch, active_name, active_sae, active_layer) VALUES (1, ?, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET epoch = excluded.epoch, active_name = excluded.active_name, "
        "active_sae = excluded.active_sae, active_layer = excluded.active_layer",
        (live.epoch, name, sae_id, layer),
    )
