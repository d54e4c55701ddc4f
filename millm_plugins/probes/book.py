"""The probes a server holds: their documents and which are armed, persisted in SQLite
(namespace ``probes``) and mirrored in memory.

Requests read the in-memory :attr:`ProbeBook.armed` tuple only (no SQLite on the request
path); a write goes to the database first, off the event loop, and only then replaces the
snapshot, so a write the database refuses changes nothing. The events log's table is
created here with the others (see :mod:`.events`).

Several servers may share one database file. Every write moves ``probe_state.version`` in
its transaction, and works from the database's state, re-read in that transaction when
another server wrote since this one last looked (so the armed-probe limit is checked
against every server's arms). Each server checks the version every ``REFRESH_S`` off the
event loop (:meth:`ProbeBook.watch`) and re-reads the probes when it moved, so its
requests run with other servers' imports, deletes and arming within that time.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import structlog

from millm_core.api import MillmError, NotFound, Store, watching

from .detector import Detector
from .document import ProbeDocument, Window

MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE probe_documents (id TEXT PRIMARY KEY, name TEXT NOT NULL, body BLOB NOT NULL, created REAL NOT NULL)",
    "CREATE TABLE probe_arms (probe_id TEXT PRIMARY KEY, body BLOB NOT NULL)",
    "CREATE TABLE probe_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, probe_id TEXT NOT NULL, "
    "request_id TEXT NOT NULL, trace_id TEXT NOT NULL, outcome TEXT NOT NULL, created REAL NOT NULL, body BLOB NOT NULL)",
    "CREATE INDEX probe_events_by_probe ON probe_events (probe_id, seq)",
    "CREATE INDEX probe_events_by_request ON probe_events (request_id, seq)",
    "CREATE TABLE probe_state (id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)",
)
STARTUP_WAIT_S = 10.0
REFRESH_S = watching.REFRESH_S  # how often a server looks for another server's writes

log = structlog.get_logger("millm.probes")


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


class ProbeChanged(MillmError):
    """409: another server deleted the probe and imported another document under its id
    while the gates ran on this one."""

    status = 409
    type = "invalid_request_error"
    code = "probe_changed"


Query = Callable[[str, Sequence[object]], list[tuple[object, ...]]]
LimitGate = Callable[[set[str], str], None]  # (armed ids, the probe to arm): raise to refuse


@dataclass(frozen=True)
class Shelf:
    """One snapshot of the probes: documents and arms by id, and the database's probes
    version it reflects. Never mutated: a write builds a new one."""

    probes: Mapping[str, Stored] = field(default_factory=dict)
    arms: Mapping[str, Arming] = field(default_factory=dict)
    version: int = 0


def _in(conn: sqlite3.Connection) -> Query:
    return lambda sql, args: list(conn.execute(sql, args).fetchall())


def version(query: Query) -> int:
    """The database's probes version (0 before the first write)."""
    rows = query("SELECT version FROM probe_state WHERE id = 1", ())
    return int(str(rows[0][0])) if rows else 0


def load(query: Query, held: Mapping[str, Stored]) -> Shelf:
    """The stored probes and arms. A document held already (the same id, imported at the
    same time) is not compiled again. Read inside a transaction, or check that
    :func:`version` did not move meanwhile."""
    stored_version = version(query)
    probes: dict[str, Stored] = {}
    for probe_id, body, created in query("SELECT id, body, created FROM probe_documents", ()):
        same = held.get(str(probe_id))
        if same is not None and same.created == float(str(created)):
            probes[str(probe_id)] = same
            continue
        doc = _decode_doc.decode(blob(body))
        probes[str(probe_id)] = Stored(doc, Detector.of(doc), float(str(created)))
    arms: dict[str, Arming] = {}
    for probe_id, body in query("SELECT probe_id, body FROM probe_arms", ()):
        if str(probe_id) in probes:
            arms[str(probe_id)] = _decode_arming.decode(blob(body))
    return Shelf(probes, arms, stored_version)


def _moved(conn: sqlite3.Connection, to: int) -> None:
    """Move the probes version (inside the write's transaction)."""
    conn.execute(
        "INSERT INTO probe_state (id, version) VALUES (1, ?) ON CONFLICT(id) DO UPDATE SET version = excluded.version", (to,)
    )


def _missing(probe_id: str) -> NotFound:
    return NotFound(f"no probe with id {probe_id!r}", code="probe_not_found", param="id")


Change = Callable[[sqlite3.Connection, Shelf], Shelf | None]


@dataclass
class ProbeBook:
    """Per-app probe state: documents and arms (persisted), and the armed snapshot.

    ``shelf`` and ``armed`` are replaced together, on the event loop, by :meth:`_install`;
    ``limit_gate`` is the arming gate ``limit``, checked again against the database inside
    the arming transaction."""

    store: Store
    limit_gate: LimitGate | None = None
    shelf: Shelf = field(default_factory=Shelf)
    armed: tuple[Armed, ...] = ()
    writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    watcher: asyncio.Task[None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.store.migrate("probes", MIGRATIONS)
        with self.store.transaction(wait=STARTUP_WAIT_S) as conn:  # one consistent read, whoever writes meanwhile
            self._install(load(_in(conn), {}), force=True)

    @property
    def probes(self) -> Mapping[str, Stored]:
        return self.shelf.probes

    @property
    def arms(self) -> Mapping[str, Arming]:
        return self.shelf.arms

    @property
    def version(self) -> int:
        return self.shelf.version

    def _install(self, new: Shelf | None, *, force: bool = False) -> None:
        """Make ``new`` current unless the current snapshot is as recent."""
        if new is None or (new.version <= self.shelf.version and not force):
            return
        armed = [Armed(new.probes[i].detector, tuple(a.windows)) for i, a in new.arms.items() if i in new.probes]
        self.shelf = new
        self.armed = tuple(sorted(armed, key=lambda a: (a.detector.name, a.detector.probe_id)))

    def get(self, probe_id: str) -> Stored:
        stored = self.probes.get(probe_id)
        if stored is None:
            raise _missing(probe_id)
        return stored

    # ------------------------------------------------------------------ other servers' writes

    def _read(self) -> Shelf | None:
        """The stored probes when the database's version is not the snapshot's, else None
        (blocking)."""
        query: Query = self.store.query
        held = self.shelf
        return watching.consistent_read(lambda: version(query), held.version, lambda: load(query, held.probes), lambda s: s.version)

    async def refresh(self) -> None:
        """Pick up another server's writes (read off the event loop)."""
        self._install(await asyncio.to_thread(self._read))

    async def watch(self) -> None:
        """Pick up other servers' writes every ``REFRESH_S``, so that requests (which read
        the snapshot only) run with them."""
        await watching.watch(self.refresh, log, "probes_refresh_failed", REFRESH_S)

    def start_watching(self) -> None:
        """Start :meth:`watch` on the running event loop (a database file only)."""
        if self.watcher is None:
            self.watcher = watching.start(self.store, self.watch, "millm-probes-watch")

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    # ------------------------------------------------------------------ writes

    async def _commit(self, change: Change) -> None:
        """Run ``change`` in one transaction off the event loop and install what it made.
        ``change`` gets the connection and the current state (the database's, re-read when
        another server wrote since this one last looked; raise to refuse) and returns the
        new state, or None when nothing changes; the version moves in the same
        transaction. The write goes on in its thread even if the request that asked is
        gone, and memory follows it then too."""

        def run() -> Shelf | None:
            with self.store.transaction() as conn:
                query = _in(conn)
                held = self.shelf
                stored_version = version(query)
                current = held if stored_version == held.version else load(query, held.probes)
                new = change(conn, current)
                if new is None:
                    return current if current is not held else None
                _moved(conn, stored_version + 1)
                return replace(new, version=stored_version + 1)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self._install(await task)
            raise
        self._install(task.result())

    async def add(self, doc: ProbeDocument) -> Stored:
        assert doc.id is not None
        probe_id = doc.id
        stored = Stored(doc, Detector.of(doc), time.time())

        def insert(conn: sqlite3.Connection, current: Shelf) -> Shelf:
            if probe_id in current.probes:
                raise ProbeExists(f"a probe with id {probe_id!r} exists; delete it first, or import under another id", param="id")
            conn.execute(
                "INSERT INTO probe_documents (id, name, body, created) VALUES (?, ?, ?, ?)",
                (probe_id, doc.name, msgspec.json.encode(doc), stored.created),
            )
            return replace(current, probes={**current.probes, probe_id: stored})

        async with self.writing:
            await self._commit(insert)
        return stored

    async def delete(self, probe_id: str) -> None:
        def remove(conn: sqlite3.Connection, current: Shelf) -> Shelf:
            if probe_id not in current.probes:
                raise _missing(probe_id)
            conn.execute("DELETE FROM probe_arms WHERE probe_id = ?", (probe_id,))
            conn.execute("DELETE FROM probe_documents WHERE id = ?", (probe_id,))
            probes = {i: s for i, s in current.probes.items() if i != probe_id}
            return replace(current, probes=probes, arms={i: a for i, a in current.arms.items() if i != probe_id})

        async with self.writing:
            await self._commit(remove)

    async def arm(self, probe_id: str, gates: Callable[[Stored], Awaitable[Arming]]) -> Arming:
        """Run ``gates`` (an async function of the stored probe returning the
        :class:`Arming`, or raising the refusal) under the write lock, on the probe as it is
        stored once the lock is held and other servers' writes are picked up (a delete and
        re-import that came first is what the gates check), then persist the arming. In
        that transaction the probe must still be the one the gates checked, and the limit
        gate is checked again against the arms in the database (another server may have
        armed probes meanwhile)."""
        async with self.writing:
            await self.refresh()
            checked = self.get(probe_id)
            arming = await gates(checked)

            def upsert(conn: sqlite3.Connection, current: Shelf) -> Shelf:
                now = current.probes.get(probe_id)
                if now is None:
                    raise _missing(probe_id)
                if now.created != checked.created:
                    raise ProbeChanged(f"probe {probe_id!r} was deleted and imported again meanwhile; arm it again", param="id")
                if self.limit_gate is not None:
                    self.limit_gate(set(current.arms), probe_id)
                conn.execute(
                    "INSERT INTO probe_arms (probe_id, body) VALUES (?, ?) ON CONFLICT(probe_id) DO UPDATE SET body = excluded.body",
                    (probe_id, msgspec.json.encode(arming)),
                )
                return replace(current, arms={**current.arms, probe_id: arming})

            await self._commit(upsert)
            return arming

    async def disarm(self, probe_id: str) -> bool:
        removed = False

        def remove(conn: sqlite3.Connection, current: Shelf) -> Shelf | None:
            nonlocal removed
            if probe_id not in current.probes:
                raise _missing(probe_id)
            if probe_id not in current.arms:
                return None
            conn.execute("DELETE FROM probe_arms WHERE probe_id = ?", (probe_id,))
            removed = True
            return replace(current, arms={i: a for i, a in current.arms.items() if i != probe_id})

        async with self.writing:
            await self._commit(remove)
        return removed
