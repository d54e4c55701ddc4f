"""Stored responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Each row keeps a response as it was answered and the conversation that led to it (its
input items, those of the responses it continued included, never their instructions), so
a follow-up needs that one row alone. Deleting a response therefore removes that row only:
the follow-ups that continued it keep their own copy of its items in their histories.

The table is bounded twice: at most ``--responses-max-stored`` rows and
``--responses-max-stored-bytes`` bytes (a row's response and history, as encoded); the
oldest rows go first. A response larger than the byte bound alone is not kept. Triggers
keep the byte total in a one-row table, so no insert scans the table. Calls block briefly
on SQLite; routes run them off the event loop.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from millm_core.api import Store, decode_json, encode

NAMESPACE = "responses"
MIGRATIONS = (
    "CREATE TABLE responses_stored (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, "
    "created_at INTEGER NOT NULL, response BLOB NOT NULL, history BLOB NOT NULL)",
    "ALTER TABLE responses_stored ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0",
    "UPDATE responses_stored SET bytes = length(response) + length(history)",
    "CREATE TABLE responses_stored_bytes (id INTEGER PRIMARY KEY CHECK (id = 1), total INTEGER NOT NULL)",
    "INSERT INTO responses_stored_bytes (id, total) SELECT 1, COALESCE(SUM(bytes), 0) FROM responses_stored",
    "CREATE TRIGGER responses_stored_added AFTER INSERT ON responses_stored "
    "BEGIN UPDATE responses_stored_bytes SET total = total + NEW.bytes WHERE id = 1; END",
    "CREATE TRIGGER responses_stored_removed AFTER DELETE ON responses_stored "
    "BEGIN UPDATE responses_stored_bytes SET total = total - OLD.bytes WHERE id = 1; END",
)


@dataclass(frozen=True)
class Stored:
    """A stored response: the object as answered, and the input items before its output."""

    response: dict[str, Any]
    history: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up continues: the history, then this response's output items."""
        return [*self.history, *self.response.get("output", [])]


class ResponseStore:
    """The bounded table of stored responses (``limit`` rows, ``max_bytes`` bytes)."""

    def __init__(self, store: Store, limit: int, max_bytes: int) -> None:
        self.store = store
        self.limit = limit
        self.max_bytes = max_bytes
        store.migrate(NAMESPACE, MIGRATIONS)

    @property
    def enabled(self) -> bool:
        """Whether responses are kept at all (neither bound is 0)."""
        return self.limit > 0 and self.max_bytes > 0

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keep ``response``, evicting the oldest rows beyond either bound; whether it was
        kept (not when nothing is kept, nor when it alone is larger than the byte bound).
        Raises ``DatabaseBusy`` (or ``sqlite3.Error``) when the database cannot be written."""
        if not self.enabled:
            return False
        body, past = encode(response), encode(history)
        size = len(body) + len(past)
        if size > self.max_bytes:
            return False

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO responses_stored (id, created_at, response, history, bytes) VALUES (?, ?, ?, ?, ?)",
                (response["id"], int(response["created_at"]), body, past, size),
            )
            # Past the row bound: every row at or below the first one beyond it (newest first).
            conn.execute(
                "DELETE FROM responses_stored WHERE seq <= (SELECT seq FROM responses_stored ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (self.limit,),
            )
            total = int(conn.execute("SELECT total FROM responses_stored_bytes WHERE id = 1").fetchone()[0])
            while total > self.max_bytes:  # the new row fits alone, so it is never the one evicted
                seq, bytes_ = conn.execute("SELECT seq, bytes FROM responses_stored ORDER BY seq LIMIT 1").fetchone()
                conn.execute("DELETE FROM responses_stored WHERE seq = ?", (seq,))
                total -= int(bytes_)

        with self.store.transaction() as conn:
            write(conn)
        return True

    def get(self, response_id: str) -> Stored | None:
        """The stored response with this id, or None."""
        rows = self.store.query("SELECT response, history FROM responses_stored WHERE id = ?", (response_id,))
        if not rows:
            return None
        response, history = rows[0]
        assert isinstance(response, bytes) and isinstance(history, bytes)
        return Stored(response=decode_json(response), history=decode_json(history))

    def delete(self, response_id: str) -> bool:
        """Forget a stored response (its row only: follow-ups keep their histories);
        whether there was one."""
        with self.store.transaction() as conn:
            return conn.execute("DELETE FROM responses_stored WHERE id = ?", (response_id,)).rowcount > 0

    def count(self) -> int:
        """How many responses are stored."""
        return int(str(self.store.query("SELECT COUNT(*) FROM responses_stored")[0][0]))

    def size(self) -> int:
        """The bytes the stored responses take (their responses and histories, encoded)."""
        return int(str(self.store.query("SELECT total FROM responses_stored_bytes WHERE id = 1")[0][0]))
