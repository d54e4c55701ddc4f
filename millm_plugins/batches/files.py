"""``/v1/files``: upload a batch's input file (multipart, as the ``openai`` SDK sends it),
list, read, fetch the content of and delete files. Content lives in the data directory,
metadata in the database. The upload is streamed to disk and refused past
``--batch-max-file-bytes`` (413), ``--batch-max-lines`` (400) or, with every stored file,
``--batch-max-storage-bytes`` (413), naming ``file``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive

from millm_core.api import FieldNotHonoured, InvalidRequest, MillmError, app_context, json_response

from .disk import CHUNK, FileTooLarge
from .objects import FileDeleted, FileList, FileObject, new_id
from .paging import limit, query
from .state import STATE, BatchesState, FileNotFound

FORM_OVERHEAD = 64 * 1024
"""Bytes of a multipart body beyond the file itself (boundaries, headers, ``purpose``)."""
FIELDS = ("purpose", "file")


def _state(request: Request) -> BatchesState:
    return app_context(request).stash[STATE]


class UploadTimeout(MillmError):
    """408: a part of the upload did not arrive within ``--read-timeout``."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


def _bounded(receive: Receive, most: int, file_limit: int, timeout_s: float) -> Receive:
    """``receive`` refusing a body past ``most`` bytes while it arrives (a body of unknown
    length is never read to its end to find out), and one whose next chunk takes longer
    than ``timeout_s`` to come (408: a stalled client cannot hold an upload open)."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        try:
            message = await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError as exc:
            raise UploadTimeout(
                f"the upload stalled: nothing arrived for {timeout_s:g} s after {seen} bytes (--read-timeout); send it faster",
                param="file",
            ) from exc
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > most:
                raise FileTooLarge(
                    f"the file is larger than {file_limit} bytes, the most this server takes (--batch-max-file-bytes)", param="file"
                )
        return message

    return bounded


def _not_found(file_id: str) -> FileNotFound:
    return FileNotFound(f"no file has the id {file_id!r}", param="file_id")


async def _form_fields(request: Request, state: BatchesState) -> tuple[str, UploadFile, Any]:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise InvalidRequest("upload a file as multipart/form-data with the fields purpose and file", code="invalid_request")
    most = state.max_file_bytes + FORM_OVERHEAD
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > most:
        raise FileTooLarge(
            f"the body ({declared} bytes) is larger than the {state.max_file_bytes}-byte file limit (--batch-max-file-bytes)", param="file"
        )
    try:
        bounded = _bounded(request.receive, most, state.max_file_bytes, app_context(request).settings.read_timeout)
        form = await Request(request.scope, bounded).form(max_files=1, max_fields=8, max_part_size=FORM_OVERHEAD)
    except (MultiPartException, HTTPException) as exc:
        raise InvalidRequest(
            f"the multipart body does not parse: {getattr(exc, 'message', None) or getattr(exc, 'detail', exc)}", code="invalid_request"
        ) from exc
    except ClientDisconnect as exc:  # as the JSON routes answer a body cut short
        raise InvalidRequest("the client closed the connection before the upload was complete", code="incomplete_body") from exc
    for name in form:
        if name.startswith("expires_after"):
            await form.close()
            raise FieldNotHonoured("files are kept until deleted: expires_after is not served; leave it out", param="expires_after")
        if name not in FIELDS:
            await form.close()
            raise InvalidRequest(f"unknown field {name!r}; an upload has purpose and file", code="unknown_parameter", param=name)
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(upload, UploadFile):
        await form.close()
        raise InvalidRequest("the upload has no file part", code="missing_required_parameter", param="file")
    if purpose != "batch":
        await form.close()
        given = "no purpose" if purpose is None else f"purpose {purpose!r}"
        raise InvalidRequest(f'this server stores batch input files only (purpose "batch"); the upload has {given}', param="purpose")
    return purpose, upload, form


async def upload_file(request: Request) -> Response:
    """``POST /v1/files``."""
    state = _state(request)
    # The storage limit is checked once the upload is in (refusing before the body is read
    # would reset the connection under a client still sending, which then sees no 413).
    _, upload, form = await _form_fields(request, state)
    file_id = new_id("file")
    try:
        size = await state.runner.off(state.disk.save_upload, upload.file, file_id, state.max_file_bytes, state.max_lines)
    finally:
        await form.close()
    created = FileObject(id=file_id, filename=upload.filename or "upload.jsonl", purpose="batch", bytes=size, created_at=int(time.time()))
    try:
        await asyncio.to_thread(state.store.add_file, created, state.max_storage_bytes)
    except BaseException:
        state.disk.remove(file_id)
        raise
    return json_response(created)


async def list_files(request: Request) -> Response:
    """``GET /v1/files``: ``purpose``, ``order`` (``desc`` by default), ``after``, ``limit`` (up to 10,000)."""
    state = _state(request)
    params = query(request.query_params, ("purpose", "order", "after", "limit"))
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f'order must be "asc" or "desc", not {order!r}', param="order")
    after = params.get("after")
    if after is not None and not await asyncio.to_thread(state.store.has_file, after):
        raise InvalidRequest(f"after names no file: {after!r}", param="after")
    page, more = await asyncio.to_thread(
        state.store.list_files, params.get("purpose"), after, limit(params, 10000, 10000), "asc" if order == "asc" else "desc"
    )
    return json_response(FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None, has_more=more))


async def get_file(request: Request) -> Response:
    """``GET /v1/files/{file_id}``."""
    file_id = request.path_params["file_id"]
    found = await asyncio.to_thread(_state(request).store.get_file, file_id)
    if found is None:
        raise _not_found(file_id)
    return json_response(found)


async def file_content(request: Request) -> Response:
    """``GET /v1/files/{file_id}/content``: the file's bytes. The file is opened before the
    answer starts: a delete meanwhile cannot cut it (or turn it into a 500)."""
    state = _state(request)
    file_id = request.path_params["file_id"]
    if not await asyncio.to_thread(state.store.has_file, file_id):
        raise _not_found(file_id)
    try:
        source = await asyncio.to_thread(open, state.disk.file(file_id), "rb")
    except FileNotFoundError:
        raise _not_found(file_id) from None
    size = os.fstat(source.fileno()).st_size

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(source.read, CHUNK):
                yield chunk
        finally:
            source.close()

    return StreamingResponse(chunks(), media_type="application/jsonl", headers={"content-length": str(size)})


async def delete_file(request: Request) -> Response:
    """``DELETE /v1/files/{file_id}``: refused with 409 while an unfinished batch reads it."""
    state = _state(request)
    file_id = request.path_params["file_id"]
    if not await asyncio.to_thread(state.store.delete_file, file_id):
        raise _not_found(file_id)
    await asyncio.to_thread(state.disk.remove, file_id)
    return json_response(FileDeleted(id=file_id))
