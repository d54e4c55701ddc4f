"""Admission and execution of generation jobs.

One worker thread per scheduler runs jobs; a job's rows (its choices and prompts) form one
batch stepped together. Events go back to the request's asyncio queue once per step.
Cancellation is checked between steps, so a client that disconnects frees its rows within
one step.

The worker thread is the only thread that runs model code: loading included (see
:meth:`Scheduler.call`). With torch's OpenMP runtime, a second thread doing tensor work
gets its own thread team, and the two teams then slow each other down for good (measured
here: 27 → 19 tok/s on a 135M-parameter model after one call from another thread).

Continuous batching (admitting rows of other requests into a running batch) is
a policy change here: the engine contract already steps per-row state.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog

from .engine import Engine, RowSpec
from .errors import QueueFull
from .rows import RowDriver, RowEvent

log = structlog.get_logger("millm.scheduler")


@dataclass
class StepEvents:
    """Row events of one decode step (only rows that were live in it)."""

    events: list[RowEvent]


@dataclass
class JobDone:
    """The job ended: every row finished or the job was cancelled."""

    cancelled: bool


@dataclass
class JobFailed:
    """The job raised; ``error`` is the exception."""

    error: BaseException


JobEvent = StepEvents | JobDone | JobFailed


@dataclass
class Job:
    """Rows of one request, to be stepped together on one engine."""

    engine: Engine
    rows: list[RowSpec]
    drivers: list[RowDriver]
    emit: Callable[[JobEvent], None]
    request_id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Counters exposed at ``GET /api/health/inference``."""

    queued: int = 0
    running_jobs: int = 0
    active_rows: int = 0
    completed_rows: int = 0
    cancelled_rows: int = 0
    failed_jobs: int = 0
    steps: int = 0
    generated_tokens: int = 0


_STOP = object()
R = TypeVar("R")


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


class Scheduler:
    """FIFO admission with a bounded queue; ``submit`` never blocks."""

    def __init__(self, max_queue: int) -> None:
        self._max_queue = max_queue
        self._queue: queue.Queue[Job | object] = queue.Queue()
        self._lock = threading.Lock()
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._worker, name="millm-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.stats.queued >= self._max_queue:
                raise QueueFull(
                    f"The request queue is full ({self._max_queue} waiting); retry shortly.",
                    headers={"Retry-After": "1"},
                )
            self.stats.queued += 1
        self._queue.put(job)

    def call(self, fn: Callable[[], R]) -> Future[R]:
        """Run ``fn`` on the worker thread, between jobs; for model loading and any other
        tensor work that must not happen on another thread. Not counted against the queue
        limit."""
        future: Future[R] = Future()
        self._queue.put(_Call(fn, future))
        return future

    def shutdown(self, timeout: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def snapshot(self) -> SchedulerStats:
        with self._lock:
            return msgspec.structs.replace(self.stats)

    # ------------------------------------------------------------------ worker

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        item.future.set_exception(exc)
                continue
            assert isinstance(item, Job)
            with self._lock:
                self.stats.queued -= 1
                self.stats.running_jobs += 1
            try:
                self._run(item)
            except BaseException as exc:  # noqa: BLE001 - delivered to the request, logged
                with self._lock:
                    self.stats.failed_jobs += 1
                log.exception("job_failed", request_id=item.request_id)
                item.emit(JobFailed(exc))
            finally:
                with self._lock:
                    self.stats.running_jobs -= 1
                    self.stats.active_rows = 0

    def _run(self, job: Job) -> None:
        engine, drivers = job.engine, job.drivers
        if job.cancelled.is_set():
            with self._lock:
                self.stats.cancelled_rows += len(drivers)
            job.emit(JobDone(cancelled=True))
            return
        started = time.perf_counter()
        batch = engine.open_batch(job.rows)
        live = list(range(len(job.rows)))
        with self._lock:
            self.stats.active_rows = len(live)
        cancelled = False
        try:
            while live:
                if job.cancelled.is_set():
                    for i in live:
                        drivers[i].cancel()
                    with self._lock:
                        self.stats.cancelled_rows += len(live)
                        self.stats.active_rows = 0
                    cancelled = True
                    break
                tokens = engine.step(batch, [drivers[i].bias() for i in live])
                events: list[RowEvent] = []
                keep: list[int] = []
                for pos, (i, token) in enumerate(zip(live, tokens, strict=True)):
                    event = drivers[i].accept(token)
                    events.append(event)
                    if event.finish_reason is None:
                        keep.append(pos)
                finished = len(live) - len(keep)
                with self._lock:
                    self.stats.steps += 1
                    self.stats.generated_tokens += len(live)
                    self.stats.completed_rows += finished
                    self.stats.active_rows = len(keep)
                job.emit(StepEvents(events))
                if finished:
                    live = [live[p] for p in keep]
                    if live:
                        engine.retain(batch, keep)
        finally:
            engine.close(batch)
        log.debug(
            "job_done",
            request_id=job.request_id,
            rows=len(drivers),
            cancelled=cancelled,
            seconds=round(time.perf_counter() - started, 4),
        )
        job.emit(JobDone(cancelled=cancelled))


def threadsafe_emitter(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue[JobEvent]) -> Callable[[JobEvent], None]:
    """An ``emit`` callback that hands events from the worker thread to ``sink``."""

    def emit(event: JobEvent) -> None:
        loop.call_soon_threadsafe(sink.put_nowait, event)

    return emit
