"""OpenAI's Files and Batch APIs: upload a JSONL file of requests (``/v1/files``), run it
as a batch (``/v1/batches``) on ``/v1/chat/completions``, ``/v1/completions`` or
``/v1/embeddings``, and download the output and error files.

Every line runs through the core's one request pipeline (``dispatch``), exactly as the
same request sent live, in the ``agent`` lane (when the lanes plugin is enabled), a few at
a time (``--batch-concurrency``), so batch lines share decode steps with live requests and
never hold them up. Batches, lines and results are kept in the database and resume after a
restart; each line's answer appears exactly once in the files (a line killed after its
answer but before it was recorded runs again, and only its second answer is kept). The files' content is kept in a data
directory (``--batch-data-dir``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from millm_core.api import AppContext, ConfigError, PluginSetting, RouteDoc, hookimpl

from .disk import DataDir, default_dir
from .files import delete_file, file_content, get_file, list_files, upload_file
from .objects import Batch, BatchList, CreateBatch, FileDeleted, FileList, FileObject
from .routes import cancel_batch, create_batch, get_batch, list_batches
from .runner import Runner
from .state import STATE, BatchesState
from .storage import BatchStore

NAME = "batches"
log = structlog.get_logger("millm.batches")


def _positive(text: str) -> int:
    """A setting's value: an integer, 1 or more."""
    value = int(text)
    if value < 1:
        raise ValueError("must be 1 or more")
    return value


DATA_DIR = PluginSetting(
    "batch_data_dir",
    "",
    "where uploaded and batch output files are kept; empty: <db>-files beside the database (a temporary directory for --db :memory:)",
)
MAX_FILE_BYTES = PluginSetting(
    "batch_max_file_bytes", 200 * 1024 * 1024, "the largest file POST /v1/files accepts, in bytes (larger: 413)", _positive
)
MAX_STORAGE_BYTES = PluginSetting(
    "batch_max_storage_bytes",
    20 * 1024 * 1024 * 1024,
    "the most bytes all stored batch files may take together, uploads and results (an upload past it: 413)",
    _positive,
)
MAX_LINES = PluginSetting("batch_max_lines", 50_000, "the most lines a batch input file may have (more: 400)", _positive)
CONCURRENCY = PluginSetting(
    "batch_concurrency", 4, "batch lines run at once, over all batches (they share decode steps with live requests)", _positive
)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    for setting in (DATA_DIR, MAX_FILE_BYTES, MAX_STORAGE_BYTES, MAX_LINES, CONCURRENCY):
        register(setting)


@hookimpl
def millm_startup(app: AppContext) -> None:
    store = BatchStore(app.store)
    configured = DATA_DIR.get(app.settings)
    if not configured and "://" in app.store.path:
        # A database server: no file for <db>-files to sit beside, and servers on other
        # machines share the batches but not a local directory (each would run the others'
        # batches without their files).
        raise ConfigError(
            "with a database server (--db postgresql://…) set --batch-data-dir to a directory every server shares "
            "(or leave the batches plugin out: --plugins)"
        )
    disk = DataDir(configured or (None if app.store.path == ":memory:" else default_dir(app.store.path)))
    running = disk.lock()
    if running:
        disk.sweep(store.kept_ids())
    else:
        log.warning(
            "batches_api_only",
            data_dir=disk.path,
            reason="another server holds the data directory's lock: this one serves the Files and Batch APIs but runs no batch",
        )
    max_lines = MAX_LINES.get(app.settings)
    runner = Runner(app, store, disk, CONCURRENCY.get(app.settings), max_lines, active=running)
    app.stash[STATE] = BatchesState(
        store=store, disk=disk, runner=runner, max_file_bytes=MAX_FILE_BYTES.get(app.settings), max_lines=max_lines,
        max_storage_bytes=MAX_STORAGE_BYTES.get(app.settings),
    )  # fmt: skip
    runner.start()


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    if STATE in app.stash:
        state = app.stash[STATE]
        state.runner.stop()
        state.runner.close()
        state.disk.close()


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    errors = ("400", "404", "409", "413")
    register(
        "/v1/files",
        upload_file,
        ["POST"],
        doc=RouteDoc(
            "Upload a batch input file (multipart/form-data: purpose=batch and a JSONL file)", response=FileObject, errors=("400", "413")
        ),
    )
    register(
        "/v1/files", list_files, ["GET"], doc=RouteDoc("List files (purpose, order, after, limit)", response=FileList, errors=("400",))
    )
    register("/v1/files/{file_id}", get_file, ["GET"], doc=RouteDoc("A file's metadata", response=FileObject, errors=("404",)))
    register("/v1/files/{file_id}", delete_file, ["DELETE"], doc=RouteDoc("Delete a file", response=FileDeleted, errors=("404", "409")))
    register("/v1/files/{file_id}/content", file_content, ["GET"], doc=RouteDoc("A file's content (JSONL)", errors=("404",)))
    register(
        "/v1/batches",
        create_batch,
        ["POST"],
        doc=RouteDoc("Create a batch from an uploaded file", request=CreateBatch, response=Batch, errors=errors),
    )
    register(
        "/v1/batches", list_batches, ["GET"], doc=RouteDoc("List batches, newest first (after, limit)", response=BatchList, errors=("400",))
    )
    register("/v1/batches/{batch_id}", get_batch, ["GET"], doc=RouteDoc("A batch", response=Batch, errors=("404",)))
    register("/v1/batches/{batch_id}/cancel", cancel_batch, ["POST"], doc=RouteDoc("Cancel a batch", response=Batch, errors=("404", "409")))
