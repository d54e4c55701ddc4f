"""Persistence: one database (``--db`` / ``MILLM_DB``) with numbered migrations: a SQLite
file by default, or PostgreSQL for servers on several machines (``--db
postgresql://user@host:port/dbname``, see :mod:`.store_pg`; psycopg is imported only then).

Feature plugins keep what must survive a restart here. Each plugin owns its tables: it
calls :meth:`Store.migrate` with its own namespace and an append-only tuple of SQL
statements, and the store runs the ones not yet applied (the namespace's applied count is
its schema version). The core itself defines no tables beyond that bookkeeping. The
connection is owned by the app's lifespan; each call is a short transaction.

Another process may hold the database's write lock (a second server on the same file). A
call waits at most ``BUSY_TIMEOUT_S`` for it, then raises :class:`DatabaseBusy` (503
``database_busy`` with ``Retry-After``); SQLite says so by its error code (SQLITE_BUSY or
SQLITE_LOCKED), never by message text. Reads use their own connection, so in WAL mode they
never wait behind a write, ours or another process's.

Plugins write SQLite's dialect (``?`` placeholders, ``INTEGER``/``REAL``/``BLOB`` columns,
``INSERT OR IGNORE``, upserts); on PostgreSQL the store translates it (:mod:`.dbdialect`
lists what it takes and what it refuses), so the same migrations run on both.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .dbdialect import is_postgres_url
from .errors import DatabaseBusy

BUSY_TIMEOUT_S = 0.25
"""How long a call waits for a lock another connection holds before ``database_busy``."""
STARTUP_WAIT_S = 10.0
"""How long opening the database and running migrations wait (start-up, not a request)."""
RETRY_AFTER_S = 1


@contextmanager
def _busy_is_503(path: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as exc:
        # Extended codes (SQLITE_BUSY_SNAPSHOT, …) keep the primary code in the low byte.
        if (exc.sqlite_errorcode & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            raise DatabaseBusy(
                f"the database {path!r} is locked by another connection (another server on the same file?); retry shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        raise


def default_db_path() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "millm", "millm.db")


class Store:
    """A SQLite database at ``path`` (``":memory:"`` for a throwaway one); for a
    ``postgresql://`` or ``postgres://`` URL, a :class:`~.store_pg.PostgresStore`."""

    def __new__(cls, path: str) -> Store:
        if cls is Store and is_postgres_url(path):
            try:
                from .store_pg import PostgresStore
            except ImportError as exc:
                raise RuntimeError(f"a PostgreSQL --db needs psycopg: pip install 'millm[postgres]' ({exc})") from exc
            return super().__new__(PostgresStore)
        return super().__new__(cls)

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, timeout=STARTUP_WAIT_S, check_same_thread=False, isolation_level=None)
        self._opening("PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._opening("CREATE TABLE IF NOT EXISTS migrations (namespace TEXT PRIMARY KEY, version INTEGER NOT NULL)")
        self._wait(BUSY_TIMEOUT_S)
        # A second connection for reads (a file database only: ":memory:" is per connection).
        self._read_lock = self._lock if path == ":memory:" else threading.Lock()
        self._reader = self._conn if path == ":memory:" else sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)

    def _opening(self, statement: str) -> None:
        """Run a statement of the database's opening, retried for up to ``STARTUP_WAIT_S``
        while another connection holds a lock SQLite does not wait for by itself: a
        connection opening the same new file at the same moment (switching it to WAL, or
        creating the bookkeeping table after our read of the schema, SQLITE_BUSY_SNAPSHOT)
        is refused at once rather than through the busy handler."""
        deadline = time.monotonic() + STARTUP_WAIT_S
        while True:
            try:
                self._conn.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                busy = (exc.sqlite_errorcode & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
                if not busy or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _wait(self, seconds: float) -> None:
        self._conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")

    def version(self, namespace: str) -> int:
        """How many of ``namespace``'s migrations have been applied."""
        row = self.query("SELECT version FROM migrations WHERE namespace = ?", (namespace,))
        return int(str(row[0][0])) if row else 0

    def migrate(self, namespace: str, migrations: Sequence[str]) -> None:
        """Apply ``namespace``'s migrations that have not run yet, in order, in one
        transaction. ``migrations`` is append-only: never edit a released statement."""
        with self.transaction(wait=STARTUP_WAIT_S) as conn:
            row = conn.execute("SELECT version FROM migrations WHERE namespace = ?", (namespace,)).fetchone()
            current = int(row[0]) if row else 0
            if current > len(migrations):
                raise RuntimeError(f"the database's {namespace!r} schema is at version {current}, newer than this millm ({len(migrations)})")
            for statement in migrations[current:]:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO migrations (namespace, version) VALUES (?, ?) ON CONFLICT(namespace) DO UPDATE SET version = excluded.version",
                (namespace, len(migrations)),
            )

    @contextmanager
    def transaction(self, *, wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction: everything in the block commits together or not at all.
        ``wait`` overrides how long it waits for another connection's lock (start-up work).
        Writers run one at a time (SQLite's ``BEGIN IMMEDIATE``; PostgreSQL's advisory
        lock): what the block reads is what it writes over."""
        with self._lock, _busy_is_503(self.path):
            if wait is not None:
                self._wait(wait)
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
            finally:
                if wait is not None:
                    self._wait(BUSY_TIMEOUT_S)

    def query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        with self._read_lock, _busy_is_503(self.path):
            return list(self._reader.execute(sql, args).fetchall())

    def close(self) -> None:
        with self._lock:
            if self._reader is not self._conn:
                with self._read_lock:
                    self._reader.close()
            self._conn.close()
