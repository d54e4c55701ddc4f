"""Stored responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Each row keeps a response as it was answered and the conversation that led to it (its
input items, those of the responses it continued included, never their instructions), so
a follow-up needs that one row alone. At most ``--responses-max-stored`` rows are kept: the
oldest go first. Calls block briefly on SQLite; routes run them off the event loop.
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
    """The bounded table of stored responses."""

    def __init__(self, store: Store, limit: int) -> None:
        self.store = store
        self.limit = limit
        store.migrate(NAMESPACE, MIGRATIONS)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Keep ``response`` (evicting the oldest beyond the limit); with a limit of 0, nothing."""
        if self.limit <= 0:
            return

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO responses_stored (id, created_at, response, history) VALUES (?, ?, ?, ?)",
                (response["id"], int(response["created_at"]), encode(response), encode(history)),
            )
            conn.execute(
                "DELETE FROM responses_stored WHERE seq NOT IN (SELECT seq FROM responses_stored ORDER BY seq DESC LIMIT ?)",
                (self.limit,),
            )

        with self.store.transaction() as conn:
            write(conn)

    def get(self, response_id: str) -> Stored | None:
        rows = self.store.query("SELECT response, history FROM responses_stored WHERE id = ?", (response_id,))
        if not rows:
            return None
        response, history = rows[0]
        assert isinstance(response, bytes) and isinstance(history, bytes)
        return Stored(response=decode_json(response), history=decode_json(history))

    def delete(self, response_id: str) -> bool:
        with self.store.transaction() as conn:
            return conn.execute("DELETE FROM responses_stored WHERE id = ?", (response_id,)).rowcount > 0

    def count(self) -> int:
        return int(str(self.store.query("SELECT COUNT(*) FROM responses_stored")[0][0]))
