"""The Files and Batch APIs' objects in OpenAI's shapes, as ``/v1/files`` and
``/v1/batches`` answer them (the ``openai`` SDK's ``FileObject`` and ``Batch``)."""

from __future__ import annotations

import secrets
import string
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
FINISHED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
"""The statuses a batch never leaves."""
ENDPOINTS: dict[str, Literal["chat.completions", "completions", "embeddings"]] = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
"""A batch's ``endpoint`` → the pipeline endpoint its lines are dispatched to."""
_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``batch_…``, ``batch_req_…``, ``file-…``."""
    if prefix == "file":
        return "file-" + "".join(secrets.choice(_ALNUM) for _ in range(22))
    return f"{prefix}_{secrets.token_hex(16)}"


class FileObject(msgspec.Struct, kw_only=True):
    """An uploaded file (``purpose: "batch"``) or a batch's output or error file
    (``purpose: "batch_output"``)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct, kw_only=True):
    """``GET /v1/files``: one page of files, newest first unless ``order=asc``."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(msgspec.Struct, kw_only=True):
    """``DELETE /v1/files/{file_id}``."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchError(msgspec.Struct, kw_only=True):
    """Why a batch failed validation: ``line`` is the input file's line number (1-based),
    ``param`` the line's field at fault."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    """A failed batch's validation errors."""

    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(msgspec.Struct, kw_only=True):
    """Lines in the batch, lines answered 200, lines answered with an error."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchInputTokensDetails(msgspec.Struct, kw_only=True):
    """Prompt tokens resumed from kept state (prefix reuse), summed over the answered lines."""

    cached_tokens: int = 0


class BatchOutputTokensDetails(msgspec.Struct, kw_only=True):
    """Output tokens spent reasoning."""

    reasoning_tokens: int = 0


class BatchUsage(msgspec.Struct, kw_only=True):
    """Tokens over the batch's answered lines (their ``usage``)."""

    input_tokens: int = 0
    input_tokens_details: BatchInputTokensDetails = msgspec.field(default_factory=BatchInputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: BatchOutputTokensDetails = msgspec.field(default_factory=BatchOutputTokensDetails)
    total_tokens: int = 0


class Batch(msgspec.Struct, kw_only=True):
    """A batch: its input file, its status and the timestamps of each status it reached,
    its counts, and (once finished) its output and error files."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: Endpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: Literal["24h"] = "24h"
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage = msgspec.field(default_factory=BatchUsage)


class BatchList(msgspec.Struct, kw_only=True):
    """``GET /v1/batches``: one page of batches, newest first."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]


class CreateBatch(msgspec.Struct, kw_only=True):
    """``POST /v1/batches``. ``output_expires_after`` is refused: output files are kept
    until deleted."""

    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None = None
    output_expires_after: Any | UnsetType = UNSET


class LineResponse(msgspec.Struct, kw_only=True):
    """An output line's ``response``: the status and body the endpoint's route answered,
    its request id, and (millm's) every ``X-miLLM-*`` header it set, by lower-case name."""

    status_code: int
    request_id: str
    body: msgspec.Raw
    millm: dict[str, dict[str, str]]


class LineError(msgspec.Struct, kw_only=True):
    """An output line's ``error``: a line that never reached the endpoint (its batch expired)."""

    code: str
    message: str


class OutputLine(msgspec.Struct, kw_only=True):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None
