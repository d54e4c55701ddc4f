"""The data directory that holds the files' content: ``<id>.jsonl`` each, written under a
temporary name, flushed to disk and renamed, so a file is whole or absent. Metadata lives
in the database; a file on disk that no row keeps (a crash between the two) is removed at
start-up."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import BinaryIO

from millm_core.api import InvalidRequest, MillmError

CHUNK = 1 << 20
SUFFIX = ".jsonl"
PART = ".part"


class FileTooLarge(MillmError):
    """413: the uploaded file is larger than ``--batch-max-file-bytes``."""

    status = 413
    type = "invalid_request_error"
    code = "file_too_large"


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
        os.makedirs(self.path, exist_ok=True)

    def file(self, file_id: str) -> str:
        return os.path.join(self.path, file_id + SUFFIX)

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
        (400); returns its size."""
        part = self.file(file_id) + PART
        size = lines = 0
        last = b"\n"
        try:
            with open(part, "wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(
                            f"the file is larger than {max_bytes} bytes, the most this server takes (--batch-max-file-bytes)", param="file"
                        )
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
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
        """Write (or write again) a batch's output file, one JSON line each; returns its size."""
        part = self.file(file_id) + PART
        size = 0
        with open(part, "wb") as out:
            for line in lines:
                out.write(line + b"\n")
                size += len(line) + 1
            out.flush()
            os.fsync(out.fileno())
        self._commit(part, file_id)
        return size

    def remove(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.file(file_id))

    def sweep(self, kept: set[str]) -> None:
        """Remove what a crash left behind: partial writes, and files no row keeps. Only
        names this plugin writes (``file-….jsonl``) are touched: the directory may be shared."""
        for name in os.listdir(self.path):
            if not name.startswith("file-"):
                continue
            stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
            if name.endswith(SUFFIX + PART) or (stem is not None and stem not in kept):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.path, name))

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
