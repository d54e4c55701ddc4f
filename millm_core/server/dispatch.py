"""Serve a model request from inside a plugin: :func:`dispatch` runs a body through the one
request pipeline (decode → resolve → field policy → validate → render → execute →
generate → finalize) exactly as the endpoint's HTTP route does, and hands back what the
route would have answered — its status, its headers and its JSON body, or the decoded
events of its stream. A plugin builds another API on top of it (``/v1/responses`` over
chat), or runs requests with no client at all (a batch of JSONL lines).

Every refusal and failure comes back as the route's OpenAI-shaped error reply; nothing is
raised to the caller but its own cancellation. When the outer request's client leaves
while a non-streamed request runs, the reply is :data:`CLIENT_CLOSED` (499) with no body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any

import msgspec
import structlog
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message

from ..codec import decode_json, encode
from ..context import AppContext, Endpoint, StashKey
from ..errors import MillmError
from .errors import error_body, internal_error
from .middleware import mint_request_id
from .routes.common import CLIENT_CLOSED, check_loaded, decode_body, joined_headers, respond_to, until_disconnect
from .state import AppState, app_state

log = structlog.get_logger("millm.dispatch")

# The server's private state, reachable from the public AppContext (set by the lifespan).
_STATE = StashKey[AppState]("core.dispatch")
MILLM_HEADER_PREFIX = "x-millm-"
# Body chunks a dispatched stream holds for its reader; past them the stream waits (its
# rows go on generating into the job's own buffer, as they do for a slow HTTP client).
STREAM_BUFFER_FRAMES = 64
_END = object()
# Inner streams still running: their tasks are kept alive here until they end (the event
# loop keeps only weak references to tasks), even once their reply is dropped.
_RUNNING: set[asyncio.Task[None]] = set()

__all__ = ["CLIENT_CLOSED", "STREAM_BUFFER_FRAMES", "Dispatched", "bind_dispatch", "declares", "dispatch"]


def bind_dispatch(state: AppState) -> None:
    """Make :func:`dispatch` work from ``state.app`` (the lifespan calls it once)."""
    state.app.stash[_STATE] = state


def _state_of(source: Request | AppContext) -> AppState:
    if isinstance(source, Request):
        return app_state(source)
    if _STATE not in source.stash:
        raise RuntimeError("this AppContext belongs to no running server: dispatch works once millm_startup has run")
    return source.stash[_STATE]


def declares(source: Request | AppContext, endpoint: Endpoint, field: str) -> bool:
    """Whether ``endpoint``'s request type on this server declares ``field``: OpenAI's
    fields the core decodes, and those of the plugins this server enabled (a plugin's field
    is undeclared while that plugin is disabled). A caller of :func:`dispatch` checks it
    before adding a field of another plugin's to a body (``class`` of the lanes plugin)."""
    return field in _state_of(source).request_types[endpoint].__struct_fields__


class Dispatched:
    """What the endpoint's route would have answered to a request served by
    :func:`dispatch`: ``status`` and ``headers`` (case-insensitive names; the model, the
    plugins' ``X-miLLM-*`` headers, ``X-miLLM-Ignored-Fields``, a 503's ``Retry-After``),
    then either ``body`` (the JSON bytes: a completion, or OpenAI's error shape when
    ``status`` is not 200) or, for a request with ``stream: true`` that was admitted, the
    decoded stream through :meth:`events`. ``status`` is :data:`CLIENT_CLOSED` (499, no
    body) when the outer request's client left while a non-streamed request ran.
    ``ignored_fields`` are the request's unused field locations (those of the header)."""

    def __init__(
        self,
        status: int,
        headers: Headers,
        request_id: str,
        body: bytes | None = None,
        ignored_fields: Sequence[str] = (),
        stream: _InnerStream | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.request_id = request_id
        self.body = body
        self.ignored_fields = tuple(ignored_fields)
        self._stream = stream

    @property
    def streaming(self) -> bool:
        """Whether the reply is a stream (read it with :meth:`events`)."""
        return self._stream is not None

    @property
    def finished(self) -> bool:
        """A stream's ``[DONE]`` arrived (a stream closed early, or cut, never has it)."""
        return self._stream is not None and self._stream.done

    def json(self) -> Any:
        """The body as JSON (a completion, or ``{"error": {...}}``); a stream has none."""
        if self.body is None:
            raise ValueError("a streamed reply has no body: read events()")
        return decode_json(self.body)

    def millm_headers(self) -> dict[str, str]:
        """The reply's ``X-miLLM-*`` headers (lower-case names), to put on a response of your own."""
        return {name: value for name, value in self.headers.items() if name.startswith(MILLM_HEADER_PREFIX)}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's data frames, decoded: each chunk (``chat.completion.chunk``), the
        closing extension chunks (``{"choices": [], key: value}``), or ``{"error": {...}}``
        when it failed after its 200. Iteration ends at ``[DONE]`` (then :attr:`finished`).
        Leaving the loop early, or closing the reply, stops the request: its rows are freed.
        Once the stream has ended (read to its end, or closed), iterating again yields nothing."""
        if self._stream is None:
            raise ValueError("this reply is not a stream: read body")
        try:
            async for event in self._stream.frames():
                yield event
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop a stream that is still running (as its client leaving would); a no-op for a
        complete one or a body."""
        if self._stream is not None:
            await self._stream.close()

    async def __aenter__(self) -> Dispatched:
        """The reply itself; leaving the block closes it (:meth:`aclose`)."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # A stream dropped without being read to its end or closed: its rows are freed.
        stream = getattr(self, "_stream", None)
        if stream is not None and not stream.ended:
            stream.abandon()


class _InnerStream:
    """Runs a streamed response as an ASGI app would, in its own task, and splits its body
    into SSE frames. Its client "disconnects" when the stream is closed. At most
    :data:`STREAM_BUFFER_FRAMES` body chunks wait for the reader; the response then waits
    for it too. The task runs to its end however the reader leaves (the response's own
    end-of-stream work, such as an interrupted stream's finalize, is never cut short)."""

    def __init__(self, response: StreamingResponse) -> None:
        self._gone = asyncio.Event()
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=STREAM_BUFFER_FRAMES)
        self._loop = asyncio.get_running_loop()
        self._over = False  # the response has returned: nothing more will be queued
        self.done = False
        self.ended = False
        self._task = asyncio.ensure_future(self._run(response))
        _RUNNING.add(self._task)
        self._task.add_done_callback(_RUNNING.discard)

    @property
    def buffered(self) -> int:
        """Body chunks waiting for the reader."""
        return self._queue.qsize()

    async def _run(self, response: StreamingResponse) -> None:
        async def receive() -> Message:
            await self._gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body" and not self._gone.is_set():
                await self._queue.put(bytes(message.get("body", b"")))  # waits while the buffer is full

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "method": "POST", "headers": []}
        try:
            await response(scope, receive, send)
        except Exception:  # noqa: BLE001 - the response's own handlers already ended the stream with an error frame
            log.exception("dispatched_stream_failed")
        finally:
            self._over = True
            # A full buffer: the reader sees the end once it has drained it (frames()).
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(_END)

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        """The decoded data frames, until the response ends; nothing once it has ended."""
        buffer = b""
        while not self.ended:
            if self._over and self._queue.empty():
                self.ended = True
                return
            chunk = await self._queue.get()
            if chunk is _END:
                self.ended = True
                return
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                data = b"\n".join(line[len(b"data: ") :] for line in frame.split(b"\n") if line.startswith(b"data: "))
                if not data:
                    continue
                if data == b"[DONE]":
                    self.done = True
                    continue
                yield decode_json(data)

    async def close(self) -> None:
        """Disconnect the response's client and wait until the response has ended. If the
        caller is cancelled meanwhile, the response still ends on its own (shielded: its
        end-of-stream work is never cancelled with the caller) and the cancellation goes on."""
        self._gone.set()
        try:
            await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.done():
                raise  # the caller was cancelled; the task goes on, held by _RUNNING
        finally:
            self.ended = True

    def abandon(self) -> None:
        """Disconnect the response's client from any thread (a reply dropped unread)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._gone.set)


def _error(state: AppState, exc: MillmError, request_id: str, rename: Callable[[str], str] | None) -> Dispatched:
    """The route's error reply: OpenAI's error shape with the error's status and headers
    (a 503 with its ``Retry-After``, as the error handler adds it)."""
    headers = dict(exc.headers)
    if exc.status == 503 and not any(k.lower() == "retry-after" for k in headers):
        estimate = state.scheduler.retry_after_s()
        headers["Retry-After"] = str(max(1, int(estimate)))
    body = error_body(exc)
    if rename is not None and body.error.param is not None:
        inner = body.error.param
        body.error.param = rename(inner)
        if body.error.param != inner:  # a decode error quotes the location: "(at 'messages')"
            body.error.message = body.error.message.replace(f"'{inner}'", f"'{body.error.param}'")
    headers["Content-Type"] = "application/json"
    return Dispatched(exc.status, Headers(headers=headers), request_id, body=encode(body))


def _headers(response: Response) -> Headers:
    return Headers(raw=[(k, v) for k, v in response.raw_headers if k != b"content-length"])


async def dispatch(
    source: Request | AppContext,
    endpoint: Endpoint,
    body: bytes | Mapping[str, Any] | msgspec.Struct,
    *,
    headers: Mapping[str, str] | None = None,
    request_id: str | None = None,
    reported: Sequence[str] = (),
    rename: Callable[[str], str] | None = None,
    unreported: Callable[[str], bool] | None = None,
    may_switch: bool = True,
) -> Dispatched:
    """Serve ``body`` on ``endpoint`` (``"chat.completions"``, ``"completions"``,
    ``"embeddings"``) through the one request pipeline, and return what its route would
    have answered (:class:`Dispatched`): never raises for the request's own failures.

    - ``source``: the plugin route's HTTP request — a non-streamed request is then cancelled
      (its rows freed) when that request's client disconnects — or the server's
      ``AppContext`` for work with no client (a background task; cancel the awaiting task
      to stop it).
    - ``headers``: the request headers the pipeline sees (``X-miLLM-Strict``,
      ``traceparent``, …); by default the outer request's, or none.
    - ``request_id``: by default the outer request's id, or a new one.
    - ``reported``: unused field locations of the caller's own API, reported first in
      ``X-miLLM-Ignored-Fields`` (and refused under ``X-miLLM-Strict``);
      ``rename`` maps the endpoint's field locations (an error's ``param``, the unused
      fields) into the caller's API's names; ``unreported`` picks the endpoint's unused
      field locations (before ``rename``) that are not reported at all, nor refused under
      ``X-miLLM-Strict``: parts of the body the caller made itself, not its client (a
      stored conversation it replays).
    - ``may_switch``: False for work that must never evict the model live traffic uses (a
      batch line): naming a model that is not loaded then answers ``503 model_busy`` while
      another model is loaded, instead of unloading it (``--auto-load``); with no model
      loaded it loads the model as any request does.

    With ``stream: true`` an admitted request answers 200 at once and its frames arrive
    through :meth:`Dispatched.events`; read them to the end or close the reply
    (``async with``) to stop it early; a reply dropped unread stops it too. A non-streamed
    request whose outer client left answers :data:`CLIENT_CLOSED` (499, no body).
    """
    state = _state_of(source)
    outer = source if isinstance(source, Request) else None
    rid = request_id or (outer.scope.get("state", {}).get("request_id") if outer is not None else None) or mint_request_id()
    seen = joined_headers((headers or {}).items()) if headers is not None or outer is None else joined_headers(outer.headers.items())
    access_log: dict[str, Any] = outer.scope.setdefault("state", {}) if outer is not None else {}
    ignored: list[str] = []

    async def guarded(work: Coroutine[Any, Any, Response]) -> Response:
        return await (until_disconnect(outer, work) if outer is not None else work)

    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            if not state.settings.auto_load or state.loading:
                check_loaded(state)
            raw = decode_json(body) if isinstance(body, bytes) else msgspec.to_builtins(body) if isinstance(body, msgspec.Struct) else dict(body)
            admission = decode_body(state, endpoint, raw, request_id=rid, headers=seen, access_log=access_log)
            ignored = admission.ctx.ignored_fields
            admission.ctx.may_switch = may_switch
            response = await respond_to(admission, guarded, reported=reported, rename=rename, unreported=unreported)
        except MillmError as exc:
            return _error(state, exc, rid, rename)
        except Exception:  # noqa: BLE001 - the route answers 500 for these; so does dispatch
            log.exception("dispatch_failed", endpoint=endpoint)
            return _error(state, internal_error(), rid, None)
        if isinstance(response, StreamingResponse):
            return Dispatched(response.status_code, _headers(response), rid, ignored_fields=ignored, stream=_InnerStream(response))
        return Dispatched(response.status_code, _headers(response), rid, body=bytes(response.body), ignored_fields=ignored)
