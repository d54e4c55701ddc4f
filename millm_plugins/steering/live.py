"""The steering state as one immutable snapshot, and how it is persisted.

The live state is what a request with no steering fields runs with: the attachments
``(sae_id, layer)``, the manual values per attachment, the active profile, and the epoch.
A snapshot also holds the saved profiles (a request may name any of them) and the SAE of
each attachment, so that deciding a request's steering reads memory only, never the
database or SAE files. A write replaces the snapshot whole: readers take ``state.live``
once and see one consistent state, never half a write.

Everything but the loaded SAEs and ``unusable`` is persisted (the ``attachments``,
``manual_values``, ``profiles`` and ``live_state`` tables). ``live_state.version`` moves
with every write of the steering tables, in the same transaction, whichever server makes
it: a server whose snapshot has an older version re-reads the database (two servers may
share one file). The epoch moves only when what a request with no steering fields runs
with changes.

``unusable`` is derived from the files and the served model (an attachment whose SAE can
no longer be read, or that does not fit the model). Such an attachment stays listed and is
never applied; a request that would need it reports ``unknown;reason=claims_unreadable``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec

from . import profiles as book
from .profiles import Profile
from .sae import SAE

Entry = tuple[str, int]  # (sae_id, layer)
Query = Callable[[str, Sequence[object]], list[tuple[object, ...]]]

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
VERSIONING: tuple[str, ...] = ("ALTER TABLE live_state ADD COLUMN version INTEGER NOT NULL DEFAULT 0",)


@dataclass(frozen=True)
class Unusable:
    """Why an attachment is not applied: ``reason`` is one of the codes above."""

    reason: str
    message: str


@dataclass(frozen=True)
class Live:
    """One snapshot of the steering state. Its mappings are never mutated: a write builds
    new ones (``dataclasses.replace``).

    ``saes`` holds the loaded SAE of each attached SAE that could be read, ``unreadable``
    why the others could not; ``version`` is the database's steering version this
    snapshot reflects."""

    attachments: tuple[Entry, ...] = ()
    manual: Mapping[Entry, Mapping[int, float]] = field(default_factory=dict)
    active: tuple[str, Entry] | None = None  # the active profile's name and where it applies
    epoch: int = 0
    unusable: Mapping[Entry, Unusable] = field(default_factory=dict)
    profiles: Mapping[str, Profile] = field(default_factory=dict)
    saes: Mapping[str, SAE] = field(default_factory=dict)
    unreadable: Mapping[str, str] = field(default_factory=dict)
    version: int = 0

    def without(self, gone: list[Entry]) -> Live:
        """The state with the attachments ``gone`` detached: their manual values go with
        them, and the active profile is deactivated if it was bound to one."""
        active = None if self.active is not None and self.active[1] in gone else self.active
        return replace(
            self,
            attachments=tuple(a for a in self.attachments if a not in gone),
            manual={e: v for e, v in self.manual.items() if e not in gone},
            active=active,
            unusable={e: u for e, u in self.unusable.items() if e not in gone},
        )

    def active_profile(self) -> Profile | None:
        return self.profiles.get(self.active[0]) if self.active is not None else None

    def steers_like(self, other: Live) -> bool:
        """Whether a request with no steering fields runs the same under both: the same
        attachments (and the same ones unusable), manual values, active profile and
        active strengths. The epoch moves when this changes."""
        return (
            (self.attachments, self.active) == (other.attachments, other.active)
            and dict(self.manual) == dict(other.manual)
            and dict(self.unusable) == dict(other.unusable)
            and self.active_profile() == other.active_profile()  # by value: a write that rewrites it as it was changes nothing
        )


def version(query: Query) -> int:
    """The database's steering version (0 in a new database)."""
    rows = query("SELECT version FROM live_state WHERE id = 1", ())
    return int(str(rows[0][0])) if rows else 0


def load(query: Query) -> tuple[Live, dict[str, str]]:
    """The persisted state (SAEs not loaded) and the registered SAEs' paths by id. Read
    inside a transaction, or check that ``version`` did not move meanwhile."""
    rows = query("SELECT epoch, active_name, active_sae, active_layer, version FROM live_state WHERE id = 1", ())
    attachments = tuple((str(s), int(str(layer))) for s, layer in query("SELECT sae_id, layer FROM attachments ORDER BY position", ()))
    manual: dict[Entry, Mapping[int, float]] = {}
    for sae_id, layer, body in query("SELECT sae_id, layer, body FROM manual_values ORDER BY position", ()):
        assert isinstance(body, bytes)
        pairs = msgspec.msgpack.decode(body, type=list[tuple[int, float]])
        manual[(str(sae_id), int(str(layer)))] = dict(pairs)
    profiles = {p.name: p for p in (book.decode(body) for (body,) in query("SELECT body FROM profiles ORDER BY name", ()))}
    registered = {str(i): str(p) for i, p in query("SELECT id, path FROM saes", ())}
    live = Live(attachments=attachments, manual=manual, profiles=profiles)
    if rows:
        epoch, name, sae_id, layer, stored_version = rows[0]
        active = (str(name), (str(sae_id), int(str(layer)))) if name is not None else None
        live = replace(live, active=active, epoch=int(str(epoch)), version=int(str(stored_version)))
    return live, registered


def save(conn: sqlite3.Connection, live: Live, before: Live) -> None:
    """Persist ``live`` over ``before`` (what the database held) inside the caller's
    transaction: the live tables whole, the profiles that changed, the epoch and the
    version. The strengths are stored as msgpack binary64, bit for bit."""
    conn.execute("DELETE FROM attachments")
    conn.executemany(
        "INSERT INTO attachments (position, sae_id, layer) VALUES (?, ?, ?)",
        [(i, s, layer) for i, (s, layer) in enumerate(live.attachments)],
    )
    conn.execute("DELETE FROM manual_values")
    conn.executemany(
        "INSERT INTO manual_values (position, sae_id, layer, body) VALUES (?, ?, ?, ?)",
        [(i, s, layer, msgspec.msgpack.encode(list(values.items()))) for i, ((s, layer), values) in enumerate(live.manual.items())],
    )
    for name, profile in live.profiles.items():
        if before.profiles.get(name) is not profile:
            book.write(conn, profile)
    for name in before.profiles:
        if name not in live.profiles:
            book.remove(conn, name)
    name_: str | None = None
    sae_id: str | None = None
    layer: int | None = None
    if live.active is not None:
        name_, (sae_id, layer) = live.active
    conn.execute(
        "INSERT INTO live_state (id, epoch, active_name, active_sae, active_layer, version) VALUES (1, ?, ?, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET epoch = excluded.epoch, active_name = excluded.active_name, "
        "active_sae = excluded.active_sae, active_layer = excluded.active_layer, version = excluded.version",
        (live.epoch, name_, sae_id, layer, live.version),
    )
