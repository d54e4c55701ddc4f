"""The events log: every probe result of a monitored generation (scored, skipped,
interrupted or errored), kept in SQLite for ``GET /api/probes/events``.

Finalize runs on the event loop, so results are queued and written by one background task
off the loop (``asyncio.to_thread``), in batches; a read first waits for the queued writes,
so a request's results can be read as soon as its response ended. After each batch the
oldest events past ``probes_events_max`` are deleted. The queue holds at most
``PENDING_MAX`` results: when the database falls that far behind, the oldest queued ones
are dropped (and the log says how many). At shutdown (:meth:`EventLog.close`, from the
plugin's ``millm_shutdown``) what is still queued is written before the database closes. Scoring and embeddings requests record
nothing (their prompts are not user traffic).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from millm_core.api import MillmError, NotFound, Store

from .book import blob
from .results import ProbeResult

log = structlog.get_logger("millm.probes")

_decode = msgspec.json.Decoder(ProbeResult)
PENDING_MAX = 10_000


@dataclass
class EventLog:
    """Queued writes and the reads of the ``probe_events`` table (created by the book's
    migrations)."""

    store: Store
    keep: int
    pending_max: int = PENDING_MAX
    pending: list[ProbeResult] = field(default_factory=list)
    writer: asyncio.Task[None] | None = None
    dropped: int = 0
    closed: bool = False
    # ``queue`` guards ``pending`` (held for moments, also on the loop); ``writing`` is held
    # while a batch is taken and written, so that close() waits for a write under way.
    queue: threading.Lock = field(default_factory=threading.Lock, repr=False)
    writing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, results: Sequence[ProbeResult]) -> None:
        """Queue ``results`` for writing (from the event loop, or written at once when no
        loop runs); past ``pending_max`` queued, the oldest are dropped."""
        if not results:
            return
        with self.queue:
            self.pending.extend(results)
            excess = len(self.pending) - self.pending_max
            if excess > 0:
                del self.pending[:excess]
                self.dropped += excess
        if excess > 0:
            log.warning("probe_events_dropped", count=excess, total=self.dropped, queued=self.pending_max)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_pending()
            return
        if self.writer is None or self.writer.done():
            self.writer = loop.create_task(self._drain(), name="millm-probe-events")

    def _take(self) -> list[ProbeResult]:
        with self.queue:
            batch, self.pending = self.pending, []
        return batch

    def _write_pending(self) -> None:
        """Take what is queued and write it (blocking; never after :meth:`close`)."""
        with self.writing:
            if self.closed:
                return
            batch = self._take()
            if not batch:
                return
            try:
                self._write(batch)
            except MillmError as exc:  # database_busy: these results are lost, and the log says so
                log.warning("probe_events_not_written", count=len(batch), error=exc.message)
            except Exception:  # noqa: BLE001 - a failed write must not stop later ones
                log.exception("probe_events_not_written", count=len(batch))

    async def _drain(self) -> None:
        while self.pending and not self.closed:
            await asyncio.to_thread(self._write_pending)

    async def flushed(self) -> None:
        """Wait until every queued result is written."""
        while self.writer is not None and not self.writer.done():
            await asyncio.shield(self.writer)

    def close(self) -> None:
        """Write what is still queued, then write nothing more (blocking: at shutdown, after
        the last request; a write under way in the writer's thread is waited for)."""
        self._write_pending()
        with self.writing:
            self.closed = True

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
