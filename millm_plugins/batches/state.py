"""The plugin's per-server state, kept in the app's stash."""

from __future__ import annotations

from dataclasses import dataclass

from millm_core.api import NotFound, StashKey

from .disk import DataDir
from .runner import Runner
from .storage import BatchStore


@dataclass
class BatchesState:
    """The tables, the data directory, the runner and the upload limits of one server."""

    store: BatchStore
    disk: DataDir
    runner: Runner
    max_file_bytes: int
    max_lines: int
    max_storage_bytes: int


STATE = StashKey[BatchesState]("batches.state")


class FileNotFound(NotFound):
    """404: no file has this id."""

    code = "file_not_found"


class BatchNotFound(NotFound):
    """404: no batch has this id."""

    code = "batch_not_found"
