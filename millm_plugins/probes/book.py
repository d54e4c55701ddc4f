"""The probes a server holds: their documents and which are armed, persisted in SQLite
(namespace ``probes``) and mirrored in memory.

Requests read the in-memory :attr:`ProbeBook.armed` tuple only (no SQLite on the request
path); a write goes to the database first, off the event loop, and only then replaces the
snapshot, so a write the database refuses changes nothing. Writes are serialised by one
lock, which is also what keeps the armed-probe limit exact. The events log's table is
created here with the others (see :mod:`.events`).

One server per database file: a second server on the same file sees the probes as they
were when it started (the snapshot is read once, at start-up).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from millm_core.api import MillmError, NotFound, Store

from .detector import Detector
from .document import ProbeDocument, Window

MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE probe_documents (id TEXT PRIMARY KEY, name TEXT NOT NULL, body BLOB NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE probe_arms (probe_id TEXT PRIMARY KEY, body BLOB NOT NULL)",
    "CREATE TABLE probe_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, probe_id TEXT NOT NULL, "
    "request_id TEXT NOT NULL, trace_id TEXT NOT NULL, outcome TEXT NOT NULL, created REAL NOT NULL, body BLOB NOT NULL)",
    "CREATE INDEX probe_events_by_probe ON probe_events (probe_id, seq)",
    "CREATE INDEX probe_events_by_request ON probe_events (request_id, seq)",
)
STARTUP_WAIT_S = 10.0


class ProbeExists(MillmError):
    status = 409
    type = "invalid_request_error"
    code = "probe_exists"


class VectorCheck(msgspec.Struct, kw_only=True):
    """One test vector re-scored at arming."""

    index: int
    tokens: int
    expected: float
    got: float | None
    abs_error: float | None
    ok: bool


class ParityReport(msgspec.Struct, kw_only=True):
    """The parity gate's measurement: every test vector re-scored on this server."""

    tolerance: float
    max_abs_error: float | None
    vectors: list[VectorCheck]


class Arming(msgspec.Struct, kw_only=True):
    """How a probe is armed: its windows, whether a rung below 2 was acknowledged, the
    model and parity it was armed with, and when."""

    windows: list[Window]
    acknowledged_below_rung2: bool
    model: str
    parity: ParityReport
    armed_at: float


@dataclass(frozen=True)
class Stored:
    """A probe as held: its document, its compiled detector, when it was imported."""

    doc: ProbeDocument
    detector: Detector
    created: float


@dataclass(frozen=True)
class Armed:
    """An armed probe, as requests see it."""

    detector: Detector
    windows: tuple[Window, ...]


_decode_doc = msgspec.json.Decoder(ProbeDocument)


def blob(value: object) -> bytes:
    """A BLOB column's value."""
    assert isinstance(value, bytes | bytearray | memoryview), type(value)
    return bytes(value)


_decode_arming = msgspec.json.Decoder(Arming)


@dataclass
class ProbeBook:
    """Per-app probe state: documents and arms (persisted), and the armed snapshot."""

    store: Store
    probes: dict[str, Stored] = field(default_factory=dict)
    arms: dict[str, Arming] = field(default_factory=dict)
    armed: tuple[Armed, ...] = ()
    writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.store.migrate("probes", MIGRATIONS)
        self._load()

    def _load(self) -> None:
        for probe_id, body, created in self.store.query("SELECT id, body, created FROM probe_documents"):
            doc = _decode_doc.decode(blob(body))
            self.probes[str(probe_id)] = Stored(doc, Detector.of(doc), float(str(created)))
        for probe_id, body in self.store.query("SELECT probe_id, body FROM probe_arms"):
            if str(probe_id) in self.probes:
                self.arms[str(probe_id)] = _decode_arming.decode(blob(body))
        self._snapshot()

    def _snapshot(self) -> None:
        armed = [Armed(self.probes[i].detector, tuple(a.windows)) for i, a in self.arms.items() if i in self.probes]
        self.armed = tuple(sorted(armed, key=lambda a: (a.detector.name, a.detector.probe_id)))

    def get(self, probe_id: str) -> Stored:
        stored = self.probes.get(probe_id)
        if stored is None:
            raise NotFound(f"no probe with id {probe_id!r}", code="probe_not_found", param="id")
        return stored

    async def _write(self, work: Callable[[sqlite3.Connection], None], then: Callable[[], None]) -> None:
        """Run ``work`` in one transaction off the event loop, then ``then`` (the memory
        update). The write goes on in its thread even if the request that asked is gone,
        and memory follows it then too."""

        def run() -> None:
            with self.store.transaction() as conn:
                work(conn)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            then()
            raise
        then()

    async def add(self, doc: ProbeDocument) -> Stored:
        assert doc.id is not None
        probe_id = doc.id
        stored = Stored(doc, Detector.of(doc), time.time())
        async with self.writing:
            if probe_id in self.probes:
                raise ProbeExists(f"a probe with id {probe_id!r} exists; delete it first, or import under another id", param="id")

            def insert(conn: sqlite3.Connection) -> None:
                conn.execute(
                    "INSERT INTO probe_documents (id, name, body, created) VALUES (?, ?, ?, ?)",
                    (probe_id, doc.name, msgspec.json.encode(doc), stored.created),
                )

            await self._write(insert, lambda: self.probes.__setitem__(probe_id, stored))
        return stored

    async def delete(self, probe_id: str) -> None:
        async with self.writing:
            self.get(probe_id)

            def remove(conn: sqlite3.Connection) -> None:
                conn.execute("DELETE FROM probe_arms WHERE probe_id = ?", (probe_id,))
                conn.execute("DELETE FROM probe_documents WHERE id = ?", (probe_id,))

            def forget() -> None:
                self.probes.pop(probe_id, None)
                self.arms.pop(probe_id, None)
                self._snapshot()

            await self._write(remove, forget)

    async def arm(self, probe_id: str, gates: Callable[[Stored], Awaitable[Arming]]) -> Arming:
        """Run ``gates`` (an async function of the stored probe returning the
        :class:`Arming`, or raising the refusal) under the write lock, on the probe as it is
        stored once the lock is held (a delete and re-import that came first is what the
        gates check), then persist the arming."""
        async with self.writing:
            arming = await gates(self.get(probe_id))

            def upsert(conn: sqlite3.Connection) -> None:
                conn.execute(
                    "INSERT INTO probe_arms (probe_id, body) VALUES (?, ?) ON CONFLICT(probe_id) DO UPDATE SET body = excluded.body",
                    (probe_id, msgspec.json.encode(arming)),
                )

            def install() -> None:
                self.arms[probe_id] = arming
                self._snapshot()

            await self._write(upsert, install)
            return arming

    async def disarm(self, probe_id: str) -> bool:
        async with self.writing:
            self.get(probe_id)
            if probe_id not in self.arms:
                return False

            def remove(conn: sqlite3.Connection) -> None:
                conn.execute("DELETE FROM probe_arms WHERE probe_id = ?", (probe_id,))

            def forget() -> None:
                self.arms.pop(probe_id, None)
                self._snapshot()

            await self._write(remove, forget)
            return True
