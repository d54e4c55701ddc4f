"""The background work: validating each new batch's input file, running its lines
through the core's one request pipeline (``dispatch``), and writing its output files.

Each unfinished batch is driven by its own small task (validate, run, finish); the lines of
every batch share ``--batch-concurrency`` slots (:mod:`.slots`), oldest batch first, so
that a few lines at a time join the running decode batch beside live requests. Lines run
in the ``agent`` lane when the lanes plugin is enabled (a line asking for another lane is
refused): live, interactive requests go first at admission, and a line is never starved.
A line that finds no model to run on (its model is not the one loaded, an unload, a load)
parks its batch: the line stays pending, the batch takes no new line and gives its slots
back, and it tries again after a pause (spending no retry) until its model serves, the batch
is cancelled or it expires. So batches for the loaded model never wait behind it.

A line's result is committed with the line marked done (see :mod:`.storage`). At start-up
every unfinished batch is driven again from what the database says: lines done are not
run again; a line that was running when the server stopped produced nothing durable and
runs again.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from millm_core.api import AppContext, Dispatched, Endpoint, declares, decode_json, dispatch
from millm_plugins.lanes.public import LANES

from .disk import DataDir
from .lines import Checked, check_lines, read_lines
from .objects import ENDPOINTS, BatchError, FileObject, new_id
from .results import Result, error_body, expired_line, refused_result, reply_result
from .slots import Job, Slots
from .storage import BatchStore, Pending

log = structlog.get_logger("millm.batches")

RETRIES_503 = 10
"""How often a line answered 503 (queue full, busy database, memory) is tried again."""
RETRY_S = 5.0
"""The pause before driving a batch again after an unexpected failure (a full disk)."""
MAX_FAILURES = 5
"""Unexpected failures in a row after which a batch is given up as ``failed``."""
MODEL_WAIT = frozenset({"model_not_loaded", "model_busy"})
"""503 codes that mean "no model to run on now" (another model loaded, an unload, a load):
the batch parks (its line stays pending, spending no retry) and tries again after the
reply's ``Retry-After`` (within :data:`PARK_S`)."""
PARK_S = (0.5, 5.0)
"""The least and the most a parked batch waits before it tries its model again."""


class Parked:
    """A line that met no model to run on: it stays pending; ``pause`` is how long its
    batch waits before it tries again."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
THREADS = 4
"""The runner's own worker threads (database calls, validation, file writes), so that a
long validation or write never holds up the default pool the server's routes use."""
T = TypeVar("T")


class Runner:
    """Drives the batches of one server."""

    def __init__(
        self,
        app: AppContext,
        store: BatchStore,
        disk: DataDir,
        concurrency: int,
        max_lines: int,
        active: bool = True,
    ) -> None:
        self.app = app
        self.active = active
        """False on a server without the data directory's lock: it drives nothing."""
        self.store = store
        self.disk = disk
        self.max_lines = max_lines
        self.concurrency = concurrency
        self._slots = Slots(concurrency)
        self._drives: dict[str, asyncio.Task[None]] = {}
        self._order: dict[str, int] = {}
        self._count = itertools.count()
        self._cancelled: set[str] = set()
        self._closed = False
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="millm-batches")

    async def off(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the plugin's own threads (long file work: validation, writes,
        uploads), never the default pool the server's routes use."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def start(self) -> None:
        """Drive every unfinished batch (at start-up: resume what was running)."""
        if not self.active:
            return
        for batch_id in self.store.unfinished():
            self.drive(batch_id)

    def drive(self, batch_id: str) -> None:
        """Start driving ``batch_id`` to its end, unless already driven."""
        if self._closed or not self.active or batch_id in self._drives:
            return
        self._order.setdefault(batch_id, next(self._count))  # drive() is called oldest first
        task = asyncio.get_running_loop().create_task(self._drive(batch_id), name=f"batch {batch_id}")
        self._drives[batch_id] = task
        task.add_done_callback(lambda _: self._drives.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        """The batch is ``cancelling``: take no new line, stop the running ones (their rows
        are freed; they appear in neither file), then finish it as ``cancelled``."""
        self._cancelled.add(batch_id)
        self._slots.cancel(batch_id)
        self.drive(batch_id)

    def stop(self) -> None:
        """The server stops: stop every batch where it is (it resumes at the next start)."""
        self._closed = True
        for task in list(self._drives.values()):
            task.cancel()
        self._slots.stop()

    def close(self) -> None:
        """After :meth:`stop`: wait for the runner's threads (a write or a record under way)
        so that the database is closed after them, never under them."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _drive(self, batch_id: str) -> None:
        failures = 0
        while True:
            try:
                await self._advance(batch_id)
                self._cancelled.discard(batch_id)
                self._order.pop(batch_id, None)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged; the batch is driven again from the database
                failures += 1
                log.exception("batch_step_failed", batch_id=batch_id, failures=failures)
                if failures >= MAX_FAILURES:
                    error = BatchError(
                        code="batch_failed", message=f"the batch failed {failures} times in a row; last: {type(exc).__name__}"
                    )
                    await self.off(self.store.fail, batch_id, error)
                    self._cancelled.discard(batch_id)
                    self._order.pop(batch_id, None)
                    return
                await asyncio.sleep(RETRY_S)

    async def _advance(self, batch_id: str) -> None:
        """Take the batch from its status in the database to its end. Every change of
        status is conditional on the one read: a concurrent cancel is read again, never
        overwritten."""
        while True:
            status = await self.off(self.store.status, batch_id)
            if status == "validating":
                await self._validate(batch_id)
            elif status == "in_progress":
                expires_at, parked = await self._run(batch_id)
                if await self.off(self.store.status, batch_id) != "in_progress":
                    continue
                if time.time() >= expires_at and len(await self.off(self.store.pending, batch_id)):
                    await self._finish(batch_id, "expired")
                elif self._closed:
                    return  # a stop: the batch resumes at start-up
                elif batch_id in self._cancelled:
                    continue  # cancelled after the status was read: read it again (the cancel was committed first)
                elif parked is not None:  # holding no slot: another batch may run meanwhile
                    await self._park(batch_id, parked.pause, expires_at)
                else:
                    await self.off(self.store.finalizing, batch_id)
            elif status == "finalizing":
                await self._finish(batch_id, "completed")
            elif status == "cancelling":
                await self._finish(batch_id, "cancelled")
            else:
                return

    async def _park(self, batch_id: str, pause: float, expires_at: int) -> None:
        """Wait ``pause`` seconds (less when the batch expires first; a cancel or a stop
        ends the wait within a tenth of a second)."""
        until = time.monotonic() + min(pause, max(0.0, expires_at - time.time()))
        while time.monotonic() < until and batch_id not in self._cancelled and not self._closed:
            await asyncio.sleep(min(0.1, max(0.0, until - time.monotonic())))

    # ------------------------------------------------------------------ validating

    def _check(self, batch_id: str) -> Checked:
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        try:
            with open(self.disk.file(batch.input_file_id), "rb") as source:
                limit = self.app.settings.max_body_bytes
                return check_lines(read_lines(source, limit), batch.endpoint, self.max_lines, limit)
        except FileNotFoundError:  # removed from the data directory by hand
            return Checked(
                errors=[
                    BatchError(code="file_not_found", message=f"the input file {batch.input_file_id!r} is gone from the data directory")
                ]
            )

    async def _validate(self, batch_id: str) -> None:
        checked = await self.off(self._check, batch_id)
        if checked.errors:
            await self.off(self.store.invalid, batch_id, checked.errors)
            log.info("batch_failed_validation", batch_id=batch_id, errors=len(checked.errors))
        else:
            await self.off(self.store.validated, batch_id, checked.lines, checked.model)

    # ------------------------------------------------------------------ running

    async def _until_model(self, stopping: Callable[[], bool]) -> None:
        """Wait for a model to be loaded; with ``--auto-load`` a line loads the model it
        names itself while none is loaded (it never unloads one: a line naming another
        model than the one served waits, on its 503 model_busy, for that model)."""
        if self.app.settings.auto_load:
            return
        while not len(self.app.models) and not stopping():
            await asyncio.sleep(0.5)

    @staticmethod
    def _read(path: str, line: Pending) -> dict[str, object]:
        """A line's body, read from the input file (opened for this line only: a batch
        waiting for a slot holds no file open)."""
        with open(path, "rb") as source:
            body: dict[str, object] = decode_json(os.pread(source.fileno(), line.length, line.offset))["body"]
        return body

    async def _run(self, batch_id: str) -> tuple[int, Parked | None]:
        """Run the batch's pending lines until none is left, it is cancelled, it expires or
        a line meets no model to run on; returns its expiry time and, in the last case,
        the pause before it tries again."""
        batch = await self.off(self.store.get_batch, batch_id)
        assert batch is not None and batch.expires_at is not None
        expires_at = batch.expires_at

        def stopping() -> bool:
            return batch_id in self._cancelled or self._closed or time.time() >= expires_at

        await self._until_model(stopping)
        pending = await self.off(self.store.pending, batch_id)
        if not pending or stopping():
            return expires_at, None
        endpoint = ENDPOINTS[batch.endpoint]
        lane = endpoint != "embeddings" and declares(self.app, endpoint, "class")
        path = self.disk.file(batch.input_file_id)
        parked: list[Parked] = []

        async def run_line(line: Pending) -> None:
            body = await self.off(self._read, path, line)
            result = await self._line(endpoint, body, line.custom_id, lane)
            if isinstance(result, Parked):  # no model for it now: the batch gives its slots back
                parked.append(result)
                job.exhausted = True
            else:
                await self.off(self.store.record, batch_id, line.number, result.ok, result.line, result.usage)

        job = Job(
            batch_id=batch_id,
            order=self._order.get(batch_id, 0),
            lines=iter(pending),
            run_line=run_line,
            stopping=stopping,
            done=asyncio.get_running_loop().create_future(),
        )
        await self._slots.run(job)
        if isinstance(job.error, FileNotFoundError):  # removed from the data directory by hand: nothing can run
            error = BatchError(code="file_not_found", message=f"the input file {batch.input_file_id!r} is gone from the data directory")
            await self.off(self.store.fail, batch_id, error)
            log.warning("batch_input_gone", batch_id=batch_id, file_id=batch.input_file_id)
        elif job.error is not None:
            raise job.error
        return expires_at, max(parked, key=lambda p: p.pause) if parked else None

    @staticmethod
    def _lane_refusal(body: dict[str, object], custom_id: str) -> Result | None:
        """A line asking for a lane other than ``agent`` (``class``, or a ``model@lane``
        suffix) is refused (400 naming the field): batch lines never jump the live queue."""
        asked = body.get("class")
        if "class" in body and asked != "agent":
            message = f'a batch line runs in the agent lane: send "class": "agent" or leave it out, not {asked!r}'
            return refused_result(custom_id, new_id("req"), 400, error_body(message, "invalid_lane", "class"))
        model = body.get("model")
        if isinstance(model, str) and "@" in model and model.rpartition("@")[2] in LANES and model.rpartition("@")[2] != "agent":
            message = f"a batch line runs in the agent lane: name the model without @{model.rpartition('@')[2]} (or with @agent)"
            return refused_result(custom_id, new_id("req"), 400, error_body(message, "invalid_lane", "model"))
        return None

    @staticmethod
    def _code(reply: Dispatched) -> str | None:
        try:
            error = reply.json().get("error")
        except (ValueError, AttributeError):
            return None
        code = error.get("code") if isinstance(error, dict) else None
        return code if isinstance(code, str) else None

    @staticmethod
    def _pause(reply: Dispatched, least: float, most: float) -> float:
        """The reply's ``Retry-After`` within [least, most]; 1 s when it is absent or bad."""
        try:
            asked = float(reply.headers.get("retry-after", "1"))
        except ValueError:
            asked = 1.0
        return min(most, max(least, asked))

    async def _line(
        self, endpoint: Endpoint, body: dict[str, object], custom_id: str, lane: bool
    ) -> Result | Parked:
        """Run one line: its result, or :class:`Parked` when no model can run it now (it
        stays pending)."""
        if body.get("stream") is True:
            refusal = error_body("a batch line cannot stream: send stream false or leave it out", "invalid_parameter", "stream")
            return refused_result(custom_id, new_id("req"), 400, refusal)
        if lane:
            refused = self._lane_refusal(body, custom_id)
            if refused is not None:
                return refused
            model = body.get("model")
            named = isinstance(model, str) and "@" in model and model.rpartition("@")[2] in LANES
            if "class" not in body and not named:
                body = {**body, "class": "agent"}
        reply: Dispatched | None = None
        attempt = 0
        while True:
            reply = await dispatch(self.app, endpoint, body, may_switch=False)  # a batch never evicts the live model
            if reply.status != 503:
                break
            if self._code(reply) in MODEL_WAIT:
                return Parked(self._pause(reply, *PARK_S))
            if attempt == RETRIES_503:
                break
            attempt += 1
            await asyncio.sleep(self._pause(reply, 1.0, 30.0))
        return await self.off(reply_result, custom_id, reply)

    # ------------------------------------------------------------------ finishing

    def _write(self, batch_id: str, status: str) -> bool:
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        reserved = self.store.reserved(batch_id)
        now = int(time.time())
        unrun = self.store.pending(batch_id) if status == "expired" else []
        output = error = None
        if batch.request_counts.completed:
            size = self.disk.write_lines(reserved.out_id, self.store.results(batch_id, "ok"))
            output = FileObject(id=reserved.out_id, filename=f"{batch_id}_output.jsonl", purpose="batch_output", bytes=size, created_at=now)
        if batch.request_counts.failed or unrun:
            lines = itertools.chain(self.store.results(batch_id, "failed"), (expired_line(line.custom_id) for line in unrun))
            size = self.disk.write_lines(reserved.err_id, lines)
            error = FileObject(id=reserved.err_id, filename=f"{batch_id}_error.jsonl", purpose="batch_output", bytes=size, created_at=now)
        return self.store.finish(batch_id, status, output, error, expired=len(unrun))

    async def _finish(self, batch_id: str, status: str) -> None:
        if await self.off(self._write, batch_id, status):
            log.info("batch_finished", batch_id=batch_id, status=status)
