"""The data directory that holds the files' content: ``<id>.jsonl`` each, written under a
temporary name of its own (``<id>.<random>.jsonl.part``), flushed to disk and renamed, so a
file is whole or absent. Metadata lives in the database; a file on disk that no row keeps
(a crash between the two) is removed at start-up, and so is a partial write older than an
hour. The directory is created ``0700``. One server at a time runs batches over a data
directory: the one holding the exclusive lock on its ``.lock`` file (:meth:`DataDir.lock`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import BinaryIO

from millm_core.api import InvalidRequest, MillmError

CHUNK = 1 << 20
SUFFIX = ".jsonl"
PART = ".part"
PART_AGE_S = 3600
"""A partial write older than this is what a crash left behind (younger: an upload or a
write under way, perhaps another server's)."""
LOCK = ".lock"


class FileTooLarge(MillmError):
    """413: the uploaded file is larger than ``--batch-max-file-bytes``."""

    status = 413
    type = "invalid_request_error"
    code = "file_too_large"


class StorageFull(MillmError):
    """413: the stored batch files would take more than ``--batch-max-storage-bytes``."""

    status = 413
    type = "invalid_request_error"
    code = "storage_limit_exceeded"


class TooManyLines(InvalidRequest):
    """400: the uploaded file has more lines than ``--batch-max-lines``."""

    code = "too_many_lines"


def default_dir(db_path: str) -> str:
    """``<db>-files`` beside the database file (``millm.db`` → ``millm-files``)."""
    return os.path.splitext(os.path.abspath(db_path))[0] + "-files"


class DataDir:
    """The files' content on disk. ``temporary`` directories (a server on ``--db
    :memory:``) are removed when the server stops."""

    def __init__(self, path: str | None) -> None:
        self.temporary = path is None
        self.path = tempfile.mkdtemp(prefix="millm-files-") if path is None else path
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._lock: int | None = None

    def lock(self) -> bool:
        """Take the exclusive lock on ``<dir>/.lock`` (held until :meth:`close`): whether
        this server is the one that runs batches and sweeps the directory."""
        fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock = fd
        return True

    def file(self, file_id: str) -> str:
        """Where the content of ``file_id`` is kept."""
        return os.path.join(self.path, file_id + SUFFIX)

    def _part(self, file_id: str) -> tuple[int, str]:
        """A new partial file for ``file_id``, its name this write's own."""
        return tempfile.mkstemp(prefix=file_id + ".", suffix=SUFFIX + PART, dir=self.path)

    def _commit(self, part: str, file_id: str) -> None:
        os.replace(part, self.file(file_id))
        with contextlib.suppress(OSError):  # directories cannot be opened on every platform
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def save_upload(self, source: BinaryIO, file_id: str, max_bytes: int, max_lines: int) -> int:
        """Copy an upload into place, refusing it past ``max_bytes`` (413) or ``max_lines``
        (400), as soon as it is past; returns its size."""
        fd, part = self._part(file_id)
        size = lines = 0
        last = b"\n"
        try:
            with open(fd, "wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(
                            f"the file is larger than {max_bytes} bytes, the most this server takes (--batch-max-file-bytes)", param="file"
                        )
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
                    if lines > max_lines:
                        raise TooManyLines(
                            f"the file has more than {max_lines} lines, the most this server takes (--batch-max-lines)", param="file"
                        )
                    out.write(chunk)
                lines += last != b"\n"
                if lines > max_lines:
                    raise TooManyLines(
                        f"the file has {lines} lines; this server takes at most {max_lines} (--batch-max-lines)", param="file"
                    )
                out.flush()
                os.fsync(out.fileno())
            self._commit(part, file_id)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
            raise
        return size

    def write_lines(self, file_id: str, lines: Iterable[bytes]) -> int:
        """Write (or write again) a batch's output file, one JSON line each; returns its
        size. On an error nothing is left behind."""
        fd, part = self._part(file_id)
        size = 0
        try:
            with open(fd, "wb") as out:
                for line in lines:
                    out.write(line + b"\n")
                    size += len(line) + 1
                out.flush()
                os.fsync(out.fileno())
            self._commit(part, file_id)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
            raise
        return size

    def remove(self, file_id: str) -> None:
        """Remove the content of ``file_id`` (if any)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.file(file_id))

    def sweep(self, kept: set[str]) -> None:
        """Remove what a crash left behind: partial writes older than :data:`PART_AGE_S`,
        and files no row keeps. Only names this plugin writes (``file-….jsonl``) are
        touched: the directory may be shared."""
        old = time.time() - PART_AGE_S
        for name in os.listdir(self.path):
            if not name.startswith("file-"):
                continue
            path = os.path.join(self.path, name)
            if name.endswith(SUFFIX + PART):
                with contextlib.suppress(OSError):
                    if os.stat(path).st_mtime < old:
                        os.remove(path)
            elif name.endswith(SUFFIX) and name[: -len(SUFFIX)] not in kept:
                with contextlib.suppress(OSError):
                    os.remove(path)

    def close(self) -> None:
        """Release the lock; remove a temporary directory."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
