"""Turn a request's result into an HTTP response: a generation streamed or not, or a
plugin's computed :class:`~millm_core.pipeline_types.Reply`.

The endpoint-specific part of generation (which Structs to build) is a small
:class:`Shapes` object; everything else — headers, usage, the SSE framing, disconnects,
mid-stream errors, finalize extensions — is shared by every endpoint.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..codec import SSE_DONE, encode, sse_frame
from ..context import RequestContext
from ..contracts.common import PromptTokensDetails, StreamOptions, Usage
from ..engine import backend_of
from ..errors import MillmError
from ..metrics import TokenClock
from ..pipeline_types import Finalization, Outcome, Reply
from ..registry import ServedModel
from ..rows import RowEvent
from ..sfv import string_list
from .errors import error_body, internal_error
from .pipeline import Prepared, RunHandle, events, finalize, outcome, submit, until_ended
from .state import AppState

log = structlog.get_logger("millm.respond")

IGNORED_FIELDS_HEADER = "X-miLLM-Ignored-Fields"
IGNORED_FIELDS_HEADER_MAX_BYTES = 1024


@dataclass(frozen=True)
class Shapes:
    """How one endpoint builds its response objects."""

    id_prefix: str
    # (id, created, model, fingerprint, texts, reasons, usage, fields) -> response Struct;
    # fields[i]: the message fields processors added to choice i as it ended, or None
    full: Callable[..., msgspec.Struct]
    # (id, created, model, index, text|None, reason|None, first: bool, usage|None, fields|None) -> chunk
    chunk: Callable[..., msgspec.Struct]


def response_headers(ctx: RequestContext, served_name: str) -> dict[str, str]:
    """Headers every model response carries: the model, plugin headers, unused fields."""
    headers = {"X-miLLM-Model": served_name, **ctx.response_headers}
    if ctx.ignored_fields:
        headers[IGNORED_FIELDS_HEADER] = string_list(ctx.ignored_fields, IGNORED_FIELDS_HEADER_MAX_BYTES)
    return headers


BACKEND_HEADER = "X-miLLM-Backend"


def _headers(state: AppState, prepared: Prepared) -> dict[str, str]:
    """A generation's headers; ``X-miLLM-Backend`` says whether its rows could share
    decode steps with other requests (``batched``) or ran alone (``serial``)."""
    return {**response_headers(prepared.ctx, prepared.model.info.served_name), BACKEND_HEADER: backend_of(prepared.model.engine)}


def _body_with_extensions(obj: msgspec.Struct, extensions: dict[str, Any], choices: list[dict[str, Any] | None] | None = None) -> bytes:
    """The body, with ``extensions`` as top-level keys and ``choices[i]``'s fields added
    to choice i (fields processors set on the choice itself, beside ``message``)."""
    if not extensions and not any(choices or ()):
        return encode(obj)
    data = msgspec.to_builtins(obj)
    for i, extra in enumerate(choices or ()):
        if extra:
            data["choices"][i].update(extra)
    data.update(extensions)
    return encode(data)


@dataclass
class _Progress:
    """What a generation's rows produced so far (a stream's body and its response share
    it: an interrupted stream finalizes with what was sent)."""

    rows: int
    # Rows per prompt (the request's ``n``): a prompt's cached tokens are its rows' least.
    per_prompt: int = 1
    finalized: bool = False
    counts: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    # Message fields processors added as each row ended (``tool_calls``).
    ended: list[dict[str, Any] | None] = field(default_factory=list)
    # Text of other message fields, accumulated (``reasoning_content``).
    sides: list[dict[str, str]] = field(default_factory=list)
    # Fields of each choice itself (beside ``message``), and the summed usage details.
    choices: list[dict[str, Any] | None] = field(default_factory=list)
    details: dict[str, int] = field(default_factory=dict)
    # Prompt tokens each row's prefill resumed from retained state.
    cached: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts, self.texts, self.cached = [0] * self.rows, [""] * self.rows, [0] * self.rows
        self.reasons, self.ended, self.choices = [None] * self.rows, [None] * self.rows, [None] * self.rows
        self.sides = [{} for _ in range(self.rows)]

    def take(self, ev: RowEvent) -> None:
        """Record one row event."""
        self.counts[ev.row] += 1
        self.texts[ev.row] += ev.text
        if ev.side:
            side = self.sides[ev.row]
            for key, value in ev.side.items():
                side[key] = side.get(key, "") + value
        if ev.finish_reason:
            self.reasons[ev.row] = ev.finish_reason
            self.ended[ev.row] = ev.fields
            self.choices[ev.row] = ev.choice
            self.cached[ev.row] = ev.cached_tokens
            for name, count in (ev.usage or {}).items():
                self.details[name] = self.details.get(name, 0) + count

    def fields(self) -> list[dict[str, Any] | None]:
        """Each choice's added message fields: side-channel text, then the fields its
        processors added as it ended."""
        return [({**side, **(ended or {})} or None) for side, ended in zip(self.sides, self.ended, strict=True)]

    def cached_tokens(self) -> int:
        """The prompt tokens the request never prefilled: per prompt (counted once, as in
        ``prompt_tokens``), the least any of its rows resumed."""
        n = self.per_prompt
        return sum(min(self.cached[i : i + n]) for i in range(0, self.rows, n))

    def usage(self, prompt_tokens: int) -> Usage:
        completion = sum(self.counts)
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens()),
        )
        if self.details:
            usage.completion_tokens_details = dict(self.details)
        return usage

    def outcome(self, prepared: Prepared, *, cancelled: bool = False) -> Outcome:
        return outcome(
            prepared, self.texts, self.reasons, self.counts, cancelled=cancelled, fields=self.fields(), cached_tokens=self.cached_tokens()
        )


async def complete(state: AppState, prepared: Prepared, shapes: Shapes) -> Response:
    """Run to the end and answer with one JSON body."""
    handle = submit(state, prepared)
    progress = _Progress(handle.rows, prepared.n)
    clock = TokenClock(state.metrics, prepared.ctx.started)
    try:
        async for step in events(handle):
            if step.events:
                clock.tick()
            for ev in step.events:
                progress.take(ev)
    except BaseException:
        handle.job.cancel()
        raise
    result = progress.outcome(prepared)
    count_tokens(state, prepared.ctx, result)
    final = finalize(state, prepared, result)
    info = prepared.model.info
    body = shapes.full(
        f"{shapes.id_prefix}-{uuid.uuid4().hex}",
        prepared.ctx.created,
        info.served_name,
        info.system_fingerprint,
        progress.texts,
        progress.reasons,
        progress.usage(result.prompt_tokens),
        progress.fields(),
    )
    headers = {**_headers(state, prepared), **final.headers}
    return Response(_body_with_extensions(body, final.extensions, progress.choices), media_type="application/json", headers=headers)


def _frame(chunk: msgspec.Struct, choice: dict[str, Any] | None = None) -> bytes:
    """One SSE frame; ``choice``: fields added to the chunk's choice."""
    if not choice:
        return sse_frame(chunk)
    data = msgspec.to_builtins(chunk)
    data["choices"][0].update(choice)
    return b"data: " + encode(data) + b"\n\n"


def stream(state: AppState, prepared: Prepared, shapes: Shapes) -> Response:
    """Answer with SSE: a first chunk with the role, content chunks, one final chunk per
    choice with its finish_reason (the last one also with usage), extension chunks from
    finalize, then ``[DONE]``. A failure after the 200 becomes an error event."""
    handle = submit(state, prepared)
    response_id = f"{shapes.id_prefix}-{uuid.uuid4().hex}"
    info = prepared.model.info
    created = prepared.ctx.created
    options = getattr(prepared.request, "stream_options", None)
    include_usage = not (isinstance(options, StreamOptions) and options.include_usage is False)
    progress = _Progress(handle.rows, prepared.n)

    def chunk(row: int, text: str | None, reason: str | None = None, usage: Usage | None = None, fields: dict[str, Any] | None = None) -> msgspec.Struct:
        return shapes.chunk(response_id, created, info.served_name, row, text, reason, False, usage, fields)

    async def body() -> AsyncIterator[bytes]:
        open_rows = handle.rows
        clock = TokenClock(state.metrics, prepared.ctx.started)
        try:
            for row in range(handle.rows):
                yield sse_frame(shapes.chunk(response_id, created, info.served_name, row, None, None, True, None))
            async for step in events(handle):
                if step.events:
                    clock.tick()
                for ev in step.events:
                    progress.take(ev)
                    if ev.side:  # other message fields' text first (reasoning before the answer)
                        yield sse_frame(chunk(ev.row, None, fields=ev.side))
                    if not ev.finish_reason:
                        if ev.text:
                            yield sse_frame(chunk(ev.row, ev.text))
                        continue
                    open_rows -= 1
                    usage = progress.usage(prepared.prompt_tokens) if open_rows == 0 and include_usage else None
                    text = ev.text
                    if ev.fields:  # the text, then one delta with the fields, then the final chunk
                        if text:
                            yield sse_frame(chunk(ev.row, text))
                        yield sse_frame(chunk(ev.row, None, fields=ev.fields))
                        text = ""
                    yield _frame(chunk(ev.row, text, ev.finish_reason, usage), ev.choice)
            result = progress.outcome(prepared)
            count_tokens(state, prepared.ctx, result)
            progress.finalized = True
            final = finalize(state, prepared, result)
            for key, value in final.closing():
                yield encode_extension(response_id, created, info.served_name, shapes, key, value)
        except MillmError as exc:
            log.warning("stream_failed", code=exc.code)
            yield sse_frame(error_body(exc))
        except Exception:
            log.exception("stream_failed")
            yield sse_frame(error_body(internal_error()))
        finally:
            # Runs on completion and on client disconnect (generator closed/cancelled).
            handle.job.cancel()
        yield SSE_DONE

    headers = _headers(state, prepared)
    headers["Cache-Control"] = "no-cache"
    return JobStream(body(), handle, prepared, media_type="text/event-stream", headers=headers, on_end=lambda: _interrupted(state, prepared, handle, progress))


INTERRUPTED_WAIT_S = 30.0


async def _interrupted(state: AppState, prepared: Prepared, handle: RunHandle, progress: _Progress) -> None:
    """Finalize hooks for a stream that ended before its finalize (the client left, before
    or after the first chunk, or an error ended it): ``outcome.cancelled`` is true and
    nothing they write is sent. Called once the job has left the model thread, so that no
    processor of its rows runs while the hooks read their state."""
    if progress.finalized:
        return
    if not await until_ended(handle, INTERRUPTED_WAIT_S):
        log.warning("interrupted_job_still_running", request_id=prepared.ctx.request_id)
    result = progress.outcome(prepared, cancelled=True)
    try:
        finalize(state, prepared, result)
    except Exception:  # noqa: BLE001 - the stream is gone; a plugin's failure here is only logged
        log.exception("finalize_interrupted_failed")


class JobStream(StreamingResponse):
    """A stream that cancels its job and releases its memory claim however the response
    ends, including when the client left before the first chunk (the body generator then
    never starts, so its own ``finally`` would never run)."""

    def __init__(
        self, content: AsyncIterator[bytes], handle: RunHandle, prepared: Prepared, on_end: Callable[[], Awaitable[None]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._handle = handle
        self._prepared = prepared
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.job.cancel()  # a no-op for a job that already ended
            self._prepared.release()
            # A client that left while the body waited at a ``yield`` leaves the generator
            # suspended there: close it now, so its own ``finally`` (the interrupted
            # stream's finalize) runs at once rather than whenever it is collected.
            try:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()
                if self._on_end is not None:
                    await self._on_end()
            except BaseException:  # noqa: BLE001 - cancelled (shutdown) or a plugin's failure: the response is over
                log.warning("stream_end_hooks_skipped", request_id=self._prepared.ctx.request_id)


def encode_extension(response_id: str, created: int, model: str, shapes: Shapes, key: str, value: Any) -> bytes:
    """A closing chunk ``{"id", "object", "created", "model", "choices": [], key: value}``."""
    base = msgspec.to_builtins(shapes.chunk(response_id, created, model, 0, None, None, False, None))
    base["choices"] = []
    base[key] = value
    return b"data: " + encode(base) + b"\n\n"


def count_tokens(state: AppState, ctx: RequestContext, result: Outcome) -> None:
    """Token counters, and the counts on the request's access-log line."""
    state.metrics.tokens(ctx.endpoint, result.prompt_tokens, result.completion_tokens)
    ctx.access_log["prompt_tokens"] = result.prompt_tokens
    ctx.access_log["completion_tokens"] = result.completion_tokens


def reply(state: AppState, ctx: RequestContext, request: Any, model: ServedModel, result: Reply) -> Response:
    """A computed reply: the common headers, the plugin's own, then ``millm_finalize``'s
    headers and body extensions (finalize runs for every path)."""
    out = Finalization()
    count_tokens(state, ctx, result.outcome)
    state.host.finalize(ctx, request, result.outcome, out)
    headers = {**response_headers(ctx, model.info.served_name), **result.headers, **out.headers}
    body = result.body
    if isinstance(body, msgspec.Struct):
        payload = _body_with_extensions(body, out.extensions)
    else:
        payload = encode({**body, **out.extensions})
    return Response(payload, media_type="application/json", headers=headers)
