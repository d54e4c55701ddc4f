"""Persistence: one SQLite database (``--db`` / ``MILLM_DB``) with numbered migrations.

Feature plugins keep what must survive a restart here. Each plugin owns its tables: it
calls :meth:`Store.migrate` with its own namespace and an append-only tuple of SQL
statements, and the store runs the ones not yet applied (the namespace's applied count is
its schema version). The core itself defines no tables beyond that bookkeeping. The
connection is owned by the app's lifespan; each call is a short transaction.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


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
        self._conn.execute("CREATE TABLE IF NOT EXISTS migrations (namespace TEXT PRIMARY KEY, version INTEGER NOT NULL)")

    def version(self, namespace: str) -> int:
        """How many of ``namespace``'s migrations have been applied."""
        row = self.query("SELECT version FROM migrations WHERE namespace = ?", (namespace,))
        return int(str(row[0][0])) if row else 0

    def migrate(self, namespace: str, migrations: Sequence[str]) -> None:
        """Apply ``namespace``'s migrations that have not run yet, in order, in one
        transaction. ``migrations`` is append-only: never edit a released statement."""
        with self.transaction() as conn:
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
