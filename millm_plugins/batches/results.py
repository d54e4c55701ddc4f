"""A line's reply → its output line, OpenAI's ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, whose ``response`` also carries
``millm: {"headers": {...}}``: every ``X-miLLM-*`` header the endpoint's route set
(steering, seed, ignored fields, probe verdicts, lane, …), by lower-case name. Building it
(encoding the line, reading the answer's usage) runs off the event loop: the runner calls
:func:`reply_result` on its threads."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from millm_core.api import Dispatched, encode

from .objects import LineError, LineResponse, OutputLine, new_id
from .storage import Usage


@dataclass(frozen=True)
class Result:
    """A line's output line, whether it succeeded (status < 400), and its tokens."""

    ok: bool
    line: bytes
    usage: Usage


class _Details(msgspec.Struct):
    reasoning_tokens: int | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    completion_tokens_details: _Details | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Answer(msgspec.Struct):
    """What a line's answer says of its tokens: its ``usage``, nothing else decoded."""

    usage: _Usage | None = None


def _usage(body: bytes) -> Usage:
    try:
        usage = msgspec.json.decode(body, type=_Answer).usage
    except msgspec.DecodeError:  # not an object, or a usage of another shape
        return Usage()
    if usage is None:
        return Usage()
    details = usage.completion_tokens_details
    return Usage(
        input_tokens=usage.prompt_tokens or 0,
        output_tokens=usage.completion_tokens or 0,
        reasoning_tokens=(details.reasoning_tokens if details is not None else 0) or 0,
        cached_tokens=(usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0) or 0,
    )


def reply_result(custom_id: str, reply: Dispatched) -> Result:
    """The output line of a line the endpoint answered (its body kept byte for byte)."""
    body = reply.body if reply.body is not None else b"null"
    response = LineResponse(
        status_code=reply.status, request_id=reply.request_id, body=msgspec.Raw(body), millm={"headers": reply.millm_headers()}
    )
    ok = reply.status < 400
    line = encode(OutputLine(id=new_id("batch_req"), custom_id=custom_id, response=response, error=None))
    return Result(ok=ok, line=line, usage=_usage(body) if ok else Usage())


def error_body(message: str, code: str, param: str | None) -> bytes:
    """An error in OpenAI's shape, for a line refused before it reached the endpoint."""
    return encode({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}})


def refused_result(custom_id: str, request_id: str, status: int, body: bytes) -> Result:
    """The output line of a line refused here, before the endpoint (``stream: true``)."""
    response = LineResponse(status_code=status, request_id=request_id, body=msgspec.Raw(body), millm={"headers": {}})
    return Result(
        ok=False, line=encode(OutputLine(id=new_id("batch_req"), custom_id=custom_id, response=response, error=None)), usage=Usage()
    )


def expired_line(custom_id: str) -> bytes:
    """The error-file line of a line that never ran before its batch expired."""
    error = LineError(code="batch_expired", message="This request could not be executed before the completion window expired.")
    return encode(OutputLine(id=new_id("batch_req"), custom_id=custom_id, response=None, error=error))
