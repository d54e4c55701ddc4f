"""``/v1/batches``: create a batch from an uploaded file, retrieve it, list batches (newest
first, ``after``/``limit`` pages) and cancel one. The work itself is the runner's."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import FieldNotHonoured, InvalidRequest, MillmError, app_context, convert, json_response, read_json, unknown_fields

from .disk import StorageFull
from .objects import Batch, BatchList, CreateBatch
from .paging import limit, query
from .state import STATE, BatchesState, BatchNotFound, FileNotFound


class BatchNotCancellable(MillmError):
    """409: the batch has finished (or is writing its files) and cannot be cancelled."""

    status = 409
    type = "invalid_request_error"
    code = "batch_not_cancellable"


def _state(request: Request) -> BatchesState:
    return app_context(request).stash[STATE]


async def _batch(state: BatchesState, batch_id: str) -> Batch:
    found = await asyncio.to_thread(state.store.get_batch, batch_id)
    if found is None:
        raise BatchNotFound(f"no batch has the id {batch_id!r}", param="batch_id")
    return found


async def create_batch(request: Request) -> Response:
    """``POST /v1/batches``: the batch starts ``validating``; its input file is checked
    in the background."""
    state = _state(request)
    raw = await read_json(request, dict[str, Any])
    unknown = unknown_fields(raw, CreateBatch)
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}", code="unknown_parameter", param=unknown[0])
    if raw.get("output_expires_after") is not None:
        raise FieldNotHonoured(
            "output files are kept until deleted: output_expires_after is not served; leave it out", param="output_expires_after"
        )
    body = convert(raw, CreateBatch)
    if not any(getattr(route, "path", None) == body.endpoint for route in request.app.routes):
        raise InvalidRequest(
            f"this server does not serve {body.endpoint} (no enabled plugin serves it), so a batch cannot run on it", param="endpoint"
        )
    found = await asyncio.to_thread(state.store.get_file, body.input_file_id)
    if found is None:
        raise FileNotFound(f"no file has the id {body.input_file_id!r}", param="input_file_id")
    stored = await asyncio.to_thread(state.store.stored_bytes)
    if stored >= state.max_storage_bytes:  # a batch writes result files: none is started on a full store
        raise StorageFull(
            f"the stored batch files take {stored} bytes, the {state.max_storage_bytes}-byte limit (--batch-max-storage-bytes), "
            "and a batch writes result files: delete files you no longer need",
            param="input_file_id",
        )
    if found.purpose != "batch":
        raise InvalidRequest(
            f'the file {body.input_file_id!r} has purpose {found.purpose!r}; a batch reads a file uploaded with purpose "batch"',
            param="input_file_id",
        )
    batch = await asyncio.to_thread(state.store.create_batch, body.endpoint, body.input_file_id, body.metadata)
    if batch is None:  # deleted since it was looked up
        raise FileNotFound(f"no file has the id {body.input_file_id!r}", param="input_file_id")
    state.runner.drive(batch.id)
    return json_response(batch)


async def get_batch(request: Request) -> Response:
    """``GET /v1/batches/{batch_id}``."""
    return json_response(await _batch(_state(request), request.path_params["batch_id"]))


async def list_batches(request: Request) -> Response:
    """``GET /v1/batches``: newest first; ``after`` (a batch id) and ``limit`` (1 to 100, 20 by default)."""
    state = _state(request)
    params = query(request.query_params, ("after", "limit"))
    after = params.get("after")
    if after is not None and not await asyncio.to_thread(state.store.has_batch, after):
        raise InvalidRequest(f"after names no batch: {after!r}", param="after")
    page, more = await asyncio.to_thread(state.store.list_batches, after, limit(params, 20, 100))
    return json_response(BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None, has_more=more))


async def cancel_batch(request: Request) -> Response:
    """``POST /v1/batches/{batch_id}/cancel``: a validating or running batch becomes
    ``cancelling``, then ``cancelled`` once its running lines are stopped and its partial
    files written. Cancelling a cancelled batch again answers it as it is."""
    state = _state(request)
    batch_id = request.path_params["batch_id"]
    before = await asyncio.to_thread(state.store.cancel, batch_id)
    if before is None:
        raise BatchNotFound(f"no batch has the id {batch_id!r}", param="batch_id")
    if before not in ("validating", "in_progress", "cancelling", "cancelled"):
        raise BatchNotCancellable(
            f"the batch {batch_id!r} is {before}; only a validating or in-progress batch can be cancelled", param="batch_id"
        )
    if before != "cancelled":
        state.runner.cancel(batch_id)
    return json_response(await _batch(state, batch_id))
