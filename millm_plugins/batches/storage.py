"""The Files and Batch APIs' tables: file metadata, batches, and each batch's lines.

A line's result is written in the same transaction that marks it done and counts it in
its batch, and only while the batch is ``in_progress``, so a line is either done with its
result kept or still pending: a server killed at any moment reruns exactly the lines that
had produced nothing durable, and a result that arrives after a cancel changes nothing.
Every change of a batch's status is conditional on the status it leaves, so a concurrent
cancel is never overwritten; finishing recounts the lines and drops their results (the
files hold them then). A batch's
output and error file ids are chosen when it is created, so that writing its files again
after a crash replaces, never duplicates, them. Calls block briefly on SQLite; routes and
the runner call them off the event loop.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from millm_core.api import MillmError, Store, decode_json, encode

from .disk import StorageFull
from .lines import Line
from .objects import (
    FINISHED,
    Batch,
    BatchError,
    BatchErrors,
    BatchInputTokensDetails,
    BatchOutputTokensDetails,
    BatchUsage,
    FileObject,
    RequestCounts,
    new_id,
)

NAMESPACE = "batches"
MIGRATIONS = (
    "CREATE TABLE batch_files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, filename TEXT NOT NULL, "
    "purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL)",
    "CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, endpoint TEXT NOT NULL, "
    "input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, "
    "expires_at INTEGER, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, "
    "expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT, "
    "errors BLOB, metadata BLOB, model TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, "
    "failed INTEGER NOT NULL DEFAULT 0, input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0, "
    "reasoning_tokens INTEGER NOT NULL DEFAULT 0, out_id TEXT NOT NULL, err_id TEXT NOT NULL)",
    "CREATE TABLE batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, "
    "\"offset\" INTEGER NOT NULL, length INTEGER NOT NULL, state TEXT NOT NULL DEFAULT 'pending', result BLOB, "
    "PRIMARY KEY (batch_id, line))",
    "ALTER TABLE batches ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",
)
_FILE_COLUMNS = "id, filename, purpose, bytes, created_at"
_BATCH_COLUMNS = (
    "id, endpoint, input_file_id, completion_window, status, created_at, expires_at, in_progress_at, finalizing_at, "
    "completed_at, failed_at, expired_at, cancelling_at, cancelled_at, output_file_id, error_file_id, errors, metadata, "
    "model, total, completed, failed, input_tokens, output_tokens, reasoning_tokens, cached_tokens"
)
_UNFINISHED = "status NOT IN ('failed', 'completed', 'expired', 'cancelled')"
WINDOW_S = 24 * 3600
_FROM = {"completed": "finalizing", "cancelled": "cancelling", "expired": "in_progress"}
"""The status a batch finishes from, by the status it finishes as."""


class FileInUse(MillmError):
    """409: the file is the input of a batch that has not finished."""

    status = 409
    type = "invalid_request_error"
    code = "file_in_use"


@dataclass(frozen=True)
class Usage:
    """A line's tokens, added to its batch's ``usage``."""

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Pending:
    """A line still to run: where its request is in the input file."""

    number: int
    custom_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Reserved:
    """A batch's input file and the ids its output and error files will have."""

    input_file_id: str
    out_id: str
    err_id: str


def _file(row: Sequence[Any]) -> FileObject:
    return FileObject(id=row[0], filename=row[1], purpose=row[2], bytes=int(row[3]), created_at=int(row[4]))


def _batch(row: Sequence[Any]) -> Batch:
    (id_, endpoint, input_file_id, window, status, created, expires, in_progress, finalizing, completed_at, failed_at, expired_at,
     cancelling_at, cancelled_at, output_file_id, error_file_id, errors, metadata, model, total, completed, failed, input_tokens,
     output_tokens, reasoning, cached) = row  # fmt: skip
    return Batch(
        id=id_, endpoint=endpoint, input_file_id=input_file_id, completion_window=window, status=status, created_at=created,
        expires_at=expires, in_progress_at=in_progress, finalizing_at=finalizing, completed_at=completed_at, failed_at=failed_at,
        expired_at=expired_at, cancelling_at=cancelling_at, cancelled_at=cancelled_at, output_file_id=output_file_id,
        error_file_id=error_file_id, errors=BatchErrors(data=[BatchError(**e) for e in decode_json(errors)]) if errors else None,
        metadata=decode_json(metadata) if metadata else None, model=model,
        request_counts=RequestCounts(total=total, completed=completed, failed=failed),
        usage=BatchUsage(input_tokens=input_tokens, input_tokens_details=BatchInputTokensDetails(cached_tokens=cached), output_tokens=output_tokens,
                         output_tokens_details=BatchOutputTokensDetails(reasoning_tokens=reasoning), total_tokens=input_tokens + output_tokens),
    )  # fmt: skip


class BatchStore:
    """The plugin's tables in the server's database."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.migrate(NAMESPACE, MIGRATIONS)

    # ------------------------------------------------------------------ files

    def stored_bytes(self) -> int:
        """What every stored file takes together, uploads and results."""
        [(total,)] = self.store.query("SELECT COALESCE(SUM(bytes), 0) FROM batch_files")
        return int(str(total))

    def add_file(self, file: FileObject, limit: int | None = None) -> None:
        """Record an uploaded file (its content is on disk already); with ``limit``, only
        if every stored file then takes at most ``limit`` bytes (checked and written in one
        transaction: two uploads cannot both slip under it), else :class:`StorageFull`."""
        with self.store.transaction() as conn:
            if limit is not None:
                stored = int(conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM batch_files").fetchone()[0])
                if stored + file.bytes > limit:
                    raise StorageFull(
                        f"the stored batch files take {stored} bytes; this {file.bytes}-byte file would pass the "
                        f"{limit}-byte limit (--batch-max-storage-bytes): delete files you no longer need",
                        param="file",
                    )
            conn.execute(
                "INSERT INTO batch_files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                (file.id, file.filename, file.purpose, file.bytes, file.created_at),
            )

    def get_file(self, file_id: str) -> FileObject | None:
        """The file ``file_id``, or None."""
        rows = self.store.query(f"SELECT {_FILE_COLUMNS} FROM batch_files WHERE id = ?", (file_id,))
        return _file(rows[0]) if rows else None

    def list_files(
        self, purpose: str | None, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[FileObject], bool]:
        """A page of files in ``order`` of upload, after the file ``after``; whether more follow."""
        where, args = ["1 = 1"], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq {'>' if order == 'asc' else '<'} (SELECT seq FROM batch_files WHERE id = ?)")
            args.append(after)
        sql = f"SELECT {_FILE_COLUMNS} FROM batch_files WHERE {' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?"
        rows = self.store.query(sql, (*args, limit + 1))
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def has_file(self, file_id: str) -> bool:
        """Whether a file has the id ``file_id``."""
        return bool(self.store.query("SELECT 1 FROM batch_files WHERE id = ?", (file_id,)))

    def delete_file(self, file_id: str) -> bool:
        """Forget a file; refused with 409 while an unfinished batch reads it."""
        with self.store.transaction() as conn:
            user = conn.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND {_UNFINISHED} LIMIT 1", (file_id,)).fetchone()
            if user is not None:
                raise FileInUse(
                    f"the file {file_id!r} is the input of the batch {user[0]!r}, which has not finished; cancel it or wait",
                    param="file_id",
                )
            return conn.execute("DELETE FROM batch_files WHERE id = ?", (file_id,)).rowcount > 0

    def kept_ids(self) -> set[str]:
        """Every file id whose content must stay on disk: the files, and the output files
        of unfinished batches (written, then recorded, when they finish)."""
        files = {str(r[0]) for r in self.store.query("SELECT id FROM batch_files")}
        reserved = self.store.query(f"SELECT out_id, err_id FROM batches WHERE {_UNFINISHED}")
        return files | {str(i) for r in reserved for i in r}

    # ------------------------------------------------------------------ batches

    def create_batch(self, endpoint: str, input_file_id: str, metadata: dict[str, str] | None) -> Batch | None:
        """A new ``validating`` batch reading ``input_file_id``; None when no such file is
        recorded (checked in the same transaction, so a concurrent delete cannot orphan it)."""
        now = int(time.time())
        batch_id = new_id("batch")
        with self.store.transaction() as conn:
            inserted = conn.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata, out_id, err_id) "
                "SELECT ?, ?, ?, '24h', 'validating', ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM batch_files WHERE id = ?)",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    now,
                    now + WINDOW_S,
                    encode(metadata) if metadata is not None else None,
                    new_id("file"),
                    new_id("file"),
                    input_file_id,
                ),
            ).rowcount
        return self.get_batch(batch_id) if inserted else None

    def get_batch(self, batch_id: str) -> Batch | None:
        """The batch ``batch_id``, or None."""
        rows = self.store.query(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,))
        return _batch(rows[0]) if rows else None

    def list_batches(self, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of batches, newest first, after the batch ``after``; whether more follow."""
        args: tuple[str, ...]
        where, args = "", ()
        if after is not None:
            where, args = "WHERE seq < (SELECT seq FROM batches WHERE id = ?)", (after,)
        rows = self.store.query(f"SELECT {_BATCH_COLUMNS} FROM batches {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1))
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def has_batch(self, batch_id: str) -> bool:
        """Whether a batch has the id ``batch_id``."""
        return bool(self.store.query("SELECT 1 FROM batches WHERE id = ?", (batch_id,)))

    def unfinished(self) -> list[str]:
        """The ids of the batches still to drive, oldest first."""
        return [str(r[0]) for r in self.store.query(f"SELECT id FROM batches WHERE {_UNFINISHED} ORDER BY seq")]

    def reserved(self, batch_id: str) -> Reserved:
        """The batch's input file and the ids chosen for its output and error files."""
        row = self.store.query("SELECT input_file_id, out_id, err_id FROM batches WHERE id = ?", (batch_id,))[0]
        return Reserved(input_file_id=str(row[0]), out_id=str(row[1]), err_id=str(row[2]))

    def validated(self, batch_id: str, lines: Sequence[Line], model: str | None) -> None:
        """The input checked out: its lines become pending and the batch ``in_progress``
        (unless it was cancelled meanwhile)."""
        with self.store.transaction() as conn:
            updated = conn.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ?, model = ? WHERE id = ? AND status = 'validating'",
                (int(time.time()), len(lines), model, batch_id),
            ).rowcount
            if updated:
                conn.executemany(
                    'INSERT INTO batch_lines (batch_id, line, custom_id, "offset", length) VALUES (?, ?, ?, ?, ?)',
                    ((batch_id, line.number, line.custom_id, line.offset, line.length) for line in lines),
                )

    def invalid(self, batch_id: str, errors: Sequence[BatchError]) -> None:
        """The input did not check out: the batch has ``failed`` with these errors."""
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND status = 'validating'",
                (int(time.time()), encode(list(errors)), batch_id),
            )

    def cancel(self, batch_id: str) -> str | None:
        """Ask to cancel: a validating or running batch becomes ``cancelling``. Returns the
        status it had (None: no such batch)."""
        with self.store.transaction() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row[0] in ("validating", "in_progress"):
                conn.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?", (int(time.time()), batch_id))
            return str(row[0])

    def finalizing(self, batch_id: str) -> bool:
        """Every line ran: the batch writes its files. False when the batch was no longer
        ``in_progress`` (cancelled meanwhile): nothing changed."""
        with self.store.transaction() as conn:
            return (
                conn.execute(
                    "UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = 'in_progress'",
                    (int(time.time()), batch_id),
                ).rowcount
                > 0
            )

    def finish(self, batch_id: str, status: str, output: FileObject | None, error: FileObject | None, expired: int = 0) -> bool:
        """The batch reaches ``status`` (completed, cancelled or expired) with its files, in
        one transaction, only from the status that leads there (``finalizing``,
        ``cancelling``, ``in_progress``): False when it had moved on (a concurrent cancel),
        and nothing changed. Its counts are recounted from its lines (``expired`` lines that
        never ran count as failed), and the lines' results, now in the files, are dropped."""
        assert status in FINISHED
        with self.store.transaction() as conn:
            updated = conn.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?, "
                "completed = (SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND state = 'ok'), "
                "failed = (SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND state = 'failed') + ? "
                "WHERE id = ? AND status = ?",
                (
                    status,
                    int(time.time()),
                    output.id if output else None,
                    error.id if error else None,
                    batch_id,
                    batch_id,
                    expired,
                    batch_id,
                    _FROM[status],
                ),
            ).rowcount
            if not updated:
                return False
            for file in (output, error):
                if file is not None:  # replaced when written again after a crash (a new seq, as INSERT OR REPLACE gave)
                    conn.execute("DELETE FROM batch_files WHERE id = ?", (file.id,))
                    conn.execute(
                        "INSERT INTO batch_files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                        (file.id, file.filename, file.purpose, file.bytes, file.created_at),
                    )
            conn.execute("UPDATE batch_lines SET result = NULL WHERE batch_id = ?", (batch_id,))
            return True

    def fail(self, batch_id: str, error: BatchError) -> bool:
        """The batch cannot run on (its input file is gone, it kept failing): it has
        ``failed`` with ``error``, from any unfinished status; False if it had finished."""
        with self.store.transaction() as conn:
            return (
                conn.execute(
                    f"UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? AND {_UNFINISHED}",
                    (int(time.time()), encode([error]), batch_id),
                ).rowcount
                > 0
            )

    def status(self, batch_id: str) -> str:
        """The batch's status, as committed now."""
        return str(self.store.query("SELECT status FROM batches WHERE id = ?", (batch_id,))[0][0])

    # ------------------------------------------------------------------ lines

    def pending(self, batch_id: str) -> list[Pending]:
        """The batch's lines still to run, in line order."""
        rows = self.store.query(
            "SELECT line, custom_id, \"offset\", length FROM batch_lines WHERE batch_id = ? AND state = 'pending' ORDER BY line",
            (batch_id,),
        )
        return [Pending(number=int(str(r[0])), custom_id=str(r[1]), offset=int(str(r[2])), length=int(str(r[3]))) for r in rows]

    def record(self, batch_id: str, number: int, ok: bool, result: bytes, usage: Usage) -> None:
        """A line ran: its result, its state and its batch's counts, in one transaction.
        A line already done, or whose batch is no longer ``in_progress`` (a slow write racing
        a cancel or an expiry, whose files are being written), is left as it is."""

        def write(conn: sqlite3.Connection) -> None:
            done = conn.execute(
                "UPDATE batch_lines SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND state = 'pending' "
                "AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND status = 'in_progress')",
                ("ok" if ok else "failed", result, batch_id, number, batch_id),
            ).rowcount
            if done:
                conn.execute(
                    f"UPDATE batches SET {'completed' if ok else 'failed'} = {'completed' if ok else 'failed'} + 1, "
                    "input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, reasoning_tokens = reasoning_tokens + ?, "
                    "cached_tokens = cached_tokens + ? WHERE id = ?",
                    (usage.input_tokens, usage.output_tokens, usage.reasoning_tokens, usage.cached_tokens, batch_id),
                )

        with self.store.transaction() as conn:
            write(conn)

    def results(self, batch_id: str, state: Literal["ok", "failed"], page: int = 1000) -> Iterator[bytes]:
        """The results of the lines that ended in ``state``, in line order, a page at a time."""
        last = 0
        while True:
            rows = self.store.query(
                "SELECT line, result FROM batch_lines WHERE batch_id = ? AND state = ? AND line > ? ORDER BY line LIMIT ?",
                (batch_id, state, last, page),
            )
            for row in rows:
                assert isinstance(row[1], bytes)
                yield row[1]
            if len(rows) < page:
                return
            last = int(str(rows[-1][0]))
