"""The circuits a server holds, as one immutable snapshot, and how they are persisted.

Each circuit is a row of the ``circuits`` table: its id and name, the document it was
imported from (JSON, given back by export), the compiled circuit (msgpack), its persistent
dial and whether it is active. ``circuit_state`` holds the circuits epoch, which moves when
what a plain request runs with changes (activation, deactivation, deleting an active
circuit, the dial of an active one; and every restart), and a version that moves with
every write, whichever server makes it.

A write goes through :meth:`CircuitState.commit`: one transaction off the event loop,
computed from the rows in the database (re-read when another server wrote since), stored,
then made current. Requests read the snapshot only; :meth:`CircuitState.watch` picks up
other servers' writes every ``REFRESH_S``. A stored circuit whose compiled form cannot be
decoded (a newer millm's, or damaged) is kept with ``circuit=None`` and the reason: it is
listed as unreadable, can be deactivated and deleted, and never steers.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import structlog

from millm_core.api import MillmError, Store

from .document import Circuit
from .ladder import LADDER

MIGRATIONS: tuple[str, ...] = (
    "CREATE TABLE circuits (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, document BLOB NOT NULL, body BLOB NOT NULL, "
    "intensity REAL NOT NULL, active INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL)",
    "CREATE TABLE circuit_state (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, version INTEGER NOT NULL)",
)
STARTUP_WAIT_S = 10.0
REFRESH_S = 0.1
CONSISTENT_READ_TRIES = 5

Query = Callable[[str, Sequence[object]], list[tuple[object, ...]]]
Change = Callable[["Book"], "Book | None"]

log = structlog.get_logger("millm.circuits")


@dataclass(frozen=True)
class Row:
    """One stored circuit. ``circuit`` is None when its stored definition cannot be decoded
    (``problem`` says why); ``body`` is the stored bytes either way."""

    id: str
    name: str
    document: bytes
    body: bytes
    circuit: Circuit | None
    problem: str | None
    intensity: float
    active: bool
    created: float

    def runs_like(self, other: Row) -> bool:
        return (self.intensity, self.circuit, self.body, self.problem) == (other.intensity, other.circuit, other.body, other.problem)


@dataclass(frozen=True)
class Book:
    """One snapshot of the circuits: rows by id, the epoch and the database version it
    reflects. Never mutated: a write builds a new one."""

    rows: Mapping[str, Row] = field(default_factory=dict)
    epoch: int = 0
    version: int = 0

    def active(self) -> list[Row]:
        """The active circuits, by id."""
        return [row for _, row in sorted(self.rows.items()) if row.active]

    def runs_like(self, other: Book) -> bool:
        """Whether a plain request runs the same under both (the epoch moves otherwise)."""
        mine, theirs = self.active(), other.active()
        return [r.id for r in mine] == [r.id for r in theirs] and all(a.runs_like(b) for a, b in zip(mine, theirs, strict=True))

    def named(self, name: str) -> Row | None:
        return next((row for row in self.rows.values() if row.name == name), None)

    def with_row(self, row: Row) -> Book:
        return replace(self, rows={**self.rows, row.id: row})

    def without(self, circuit_id: str) -> Book:
        return replace(self, rows={i: r for i, r in self.rows.items() if i != circuit_id})


def decode_body(body: bytes) -> tuple[Circuit | None, str | None]:
    """The compiled circuit, or None and why it cannot be decoded. A rung this server's
    ladder does not have (a newer millm's) is unreadable too: it has no phrase to report,
    and guessing one could describe a circuit as better validated than it is."""
    try:
        circuit = msgspec.msgpack.decode(body, type=Circuit)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return None, f"the stored definition cannot be parsed: {exc}"
    unknown = sorted({circuit.rung, *(edge.rung for edge in circuit.edges)} - set(LADDER))
    if unknown:
        return None, f"the stored definition cannot be parsed: rung {unknown[0]} is not on this server's evidence ladder"
    return circuit, None


def encode_body(circuit: Circuit) -> bytes:
    return msgspec.msgpack.encode(circuit)


def version(query: Query) -> int:
    rows = query("SELECT version FROM circuit_state WHERE id = 1", ())
    return int(str(rows[0][0])) if rows else 0


def load(query: Query) -> Book:
    """Every stored circuit and the state row (read in a transaction, or check that the
    version did not move meanwhile)."""
    rows: dict[str, Row] = {}
    for circuit_id, name, document, body, intensity, active, created in query(
        "SELECT id, name, document, body, intensity, active, created FROM circuits", ()
    ):
        assert isinstance(document, bytes) and isinstance(body, bytes)
        circuit, problem = decode_body(body)
        rows[str(circuit_id)] = Row(
            id=str(circuit_id), name=str(name), document=document, body=body, circuit=circuit, problem=problem,
            intensity=float(str(intensity)), active=bool(active), created=float(str(created)),
        )  # fmt: skip
    state = query("SELECT epoch, version FROM circuit_state WHERE id = 1", ())
    epoch, stored_version = (int(str(state[0][0])), int(str(state[0][1]))) if state else (0, 0)
    return Book(rows=rows, epoch=epoch, version=stored_version)


def save(conn: sqlite3.Connection, new: Book, before: Book) -> None:
    """Persist ``new`` over ``before`` (what the database held) in the caller's
    transaction: the rows that changed, the removed ones, the epoch and the version."""
    for circuit_id, row in new.rows.items():
        if before.rows.get(circuit_id) is not row:
            conn.execute(
                "INSERT INTO circuits (id, name, document, body, intensity, active, created) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET intensity = excluded.intensity, active = excluded.active",
                (row.id, row.name, row.document, row.body, row.intensity, int(row.active), row.created),
            )
    for circuit_id in before.rows:
        if circuit_id not in new.rows:
            conn.execute("DELETE FROM circuits WHERE id = ?", (circuit_id,))
    conn.execute(
        "INSERT INTO circuit_state (id, epoch, version) VALUES (1, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET epoch = excluded.epoch, version = excluded.version",
        (new.epoch, new.version),
    )


def _in(conn: sqlite3.Connection) -> Query:
    return lambda sql, args: list(conn.execute(sql, args).fetchall())


@dataclass
class CircuitState:
    """Per-app circuits state: the current snapshot, written through :meth:`commit`."""

    store: Store
    book: Book = field(default_factory=Book)
    writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    watcher: asyncio.Task[None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.store.migrate("circuits", MIGRATIONS)
        self.restore()

    def restore(self) -> None:
        """Read the stored circuits (start-up). The epoch resumes one above the stored one:
        a restart may change what a request gets, and the epoch never goes back."""
        with self.store.transaction(wait=STARTUP_WAIT_S) as conn:
            stored = load(_in(conn))
            self.book = replace(stored, epoch=stored.epoch + 1, version=stored.version + 1)
            save(conn, self.book, stored)

    async def commit(self, change: Change) -> Book:
        """Apply one operator write and return the snapshot it made current. ``change``
        gets the current book (the database's, re-read if another server wrote; it runs in
        a worker thread inside the write transaction: keep it pure and quick, raise to
        refuse) and returns the new one, or None when nothing changes."""
        async with self.writing:
            work = asyncio.ensure_future(asyncio.to_thread(self._transact, change))
            try:
                new = await asyncio.shield(work)
            except asyncio.CancelledError:
                self._install(await work)  # the write goes on: memory follows the database
                raise
            self._install(new)
            return self.book

    def _transact(self, change: Change) -> Book | None:
        with self.store.transaction() as conn:
            query = _in(conn)
            held = self.book
            stored_version = version(query)
            current = held if stored_version == held.version else load(query)
            new = change(current)
            if new is None:
                return current if current is not held else None
            epoch = current.epoch if new.runs_like(current) else current.epoch + 1
            new = replace(new, epoch=epoch, version=stored_version + 1)
            save(conn, new, current)
            return new

    def _install(self, new: Book | None) -> None:
        if new is not None and new.version > self.book.version:
            self.book = new

    def _read(self) -> Book | None:
        """The stored book when its version is not the snapshot's, else None (blocking).
        The reads count only if the version did not move while they ran."""
        query: Query = self.store.query
        for _ in range(CONSISTENT_READ_TRIES):
            if version(query) == self.book.version:
                return None
            stored = load(query)
            if version(query) == stored.version:
                return stored
        return None

    async def refresh(self) -> Book:
        """The current snapshot, after picking up another server's writes."""
        self._install(await asyncio.to_thread(self._read))
        return self.book

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except MillmError as exc:  # database_busy and the like: look again next time
                log.debug("circuits_refresh_failed", error=exc.message)
            except Exception:  # noqa: BLE001 - a watcher that dies would leave the state stale for good
                log.exception("circuits_refresh_failed")

    def start_watching(self) -> None:
        """Watch for other servers' writes (a database file only)."""
        if self.store.path == ":memory:" or self.watcher is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.watcher = loop.create_task(self.watch(), name="millm-circuits-watch")

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
