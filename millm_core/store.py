"""Persistence: one SQLite database (``--db`` / ``MILLM_DB``) with numbered migrations.

Feature plugins keep what must survive a restart here (SAE registrations now; profiles,
clusters and circuits next). The connection is owned by the app's lifespan and used from
the event loop thread only; each call is a short transaction.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

# Each migration runs once, in order; the applied count is the schema version.
MIGRATIONS: Sequence[str] = (
    """
    CREATE TABLE saes (
        id TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        created REAL NOT NULL
    )
    """,
)


def default_db_path() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "millm", "millm.db")


class Store:
    """A SQLite database at ``path`` (``":memory:"`` for a throwaway one)."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        self._migrate()

    @property
    def version(self) -> int:
        row = self._conn.execute("SELECT version FROM schema_version").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> None:
        with self.transaction() as conn:
            current = self.version
            if not current:
                conn.execute("INSERT INTO schema_version (version) VALUES (0)")
            for number, statement in enumerate(MIGRATIONS[current:], start=current + 1):
                conn.execute(statement)
                conn.execute("UPDATE schema_version SET version = ?", (number,))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[object, ...]]:
        with self._lock:
            return list(self._conn.execute(sql, args).fetchall())

    def close(self) -> None:
        with self._lock:
            self._conn.close()
