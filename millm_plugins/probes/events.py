"""The events log: every probe result of a monitored generation (scored, skipped,
interrupted or errored), kept in SQLite for ``GET /api/probes/events``.

Finalize runs on the event loop, so results are queued and written by one background task
off the loop (``asyncio.to_thread``), in batches; a read first waits for the queued writes,
so a request's results can be read as soon as its response ended. After each batch the
oldest events past ``probes_events_max`` are deleted. Scoring and embeddings requests record
nothing (their prompts are not user traffic).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from millm_core.api import MillmError, NotFound, Store

from .book import blob
from .results import ProbeResult

log = structlog.get_logger("millm.probes")

_decode = msgspec.json.Decoder(ProbeResult)


@dataclass
class EventLog:
    """Queued writes and the reads of the ``probe_events`` table (created by the book's
    migrations)."""

    store: Store
    keep: int
    pending: list[ProbeResult] = field(default_factory=list)
    writer: asyncio.Task[None] | None = None

    def record(self, results: Sequence[ProbeResult]) -> None:
        """Queue ``results`` for writing (from the event loop, or written at once when no
        loop runs)."""
        if not results:
            return
        self.pending.extend(results)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush_now()
            return
        if self.writer is None or self.writer.done():
            self.writer = loop.create_task(self._drain(), name="millm-probe-events")

    def _flush_now(self) -> None:
        batch, self.pending = self.pending, []
        self._write(batch)

    async def _drain(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            try:
                await asyncio.to_thread(self._write, batch)
            except MillmError as exc:  # database_busy: these results are lost, and the log says so
                log.warning("probe_events_not_written", count=len(batch), error=exc.message)
            except Exception:  # noqa: BLE001 - a failed write must not stop later ones
                log.exception("probe_events_not_written", count=len(batch))

    async def flushed(self) -> None:
        """Wait until every queued result is written."""
        while self.writer is not None and not self.writer.done():
            await asyncio.shield(self.writer)

    def _write(self, batch: Sequence[ProbeResult]) -> None:
        rows = [(r.result_id, r.probe.id, r.served.request_id, r.trace_id, r.outcome, r.created, msgspec.json.encode(r)) for r in batch]

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT OR IGNORE INTO probe_events (id, probe_id, request_id, trace_id, outcome, created, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            conn.execute("DELETE FROM probe_events WHERE seq <= (SELECT MAX(seq) FROM probe_events) - ?", (self.keep,))

        with self.store.transaction() as conn:
            write(conn)

    def read(
        self, *, probe_id: str | None, request_id: str | None, trace_id: str | None, limit: int, offset: int
    ) -> tuple[int, list[ProbeResult]]:
        """``(total matching, one page newest first)`` (blocking)."""
        where, args = [], []
        for column, wanted in (("probe_id", probe_id), ("request_id", request_id), ("trace_id", trace_id)):
            if wanted is not None:
                where.append(f"{column} = ?")
                args.append(wanted)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        total = self.store.query(f"SELECT COUNT(*) FROM probe_events{clause}", args)[0][0]
        rows = self.store.query(f"SELECT body FROM probe_events{clause} ORDER BY seq DESC LIMIT ? OFFSET ?", [*args, limit, offset])
        return int(str(total)), [_decode.decode(blob(row[0])) for row in rows]

    def one(self, result_id: str) -> ProbeResult:
        rows = self.store.query("SELECT body FROM probe_events WHERE id = ?", (result_id,))
        if not rows:
            raise NotFound(f"no probe event with id {result_id!r}", code="probe_event_not_found", param="id")
        return _decode.decode(blob(rows[0][0]))
