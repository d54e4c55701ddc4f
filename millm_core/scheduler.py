"""Admission and execution of generation jobs.

One worker thread per scheduler runs jobs; a job's rows (its choices and prompts) form one
batch stepped together. Events go back to the request's asyncio queue once per step.
Cancellation is checked between steps, so a client that disconnects frees its rows within
one step.

The worker thread is the only thread that runs model code: loading included (see
:meth:`Scheduler.call`). With torch's OpenMP runtime, a second thread doing tensor work
gets its own thread team, and the two teams then slow each other down for good (measured
here: 27 → 19 tok/s on a 135M-parameter model after one call from another thread).

On an engine that is :class:`~millm_core.engine.Joinable` (the GGUF engine; the
transformers engine on its lean decode step), jobs queued for the same engine join the
running batch between steps while the engine says they fit: concurrent requests then share
each forward pass. Otherwise a batch holds one job's rows.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec
import structlog

from .engine import Engine, Joinable, RowSpec
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
        self._pending: collections.deque[Job | _Call | object] = collections.deque()  # pulled early, still first in line
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

    def _next(self) -> Job | _Call | object:
        return self._pending.popleft() if self._pending else self._queue.get()

    def _worker(self) -> None:
        while True:
            item = self._next()
            if item is _STOP:
                return
            if isinstance(item, _Call):
                self._call(item)
                continue
            assert isinstance(item, Job)
            with self._lock:
                self.stats.queued -= 1
            self._run(item)

    @staticmethod
    def _call(item: _Call) -> None:
        if item.future.set_running_or_notify_cancel():
            try:
                item.future.set_result(item.fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                item.future.set_exception(exc)

    def _admit(self, engine: Joinable, batch: Any, run: _Run) -> None:
        """Between steps of a joinable engine's batch: join queued jobs for the same
        engine while they fit, run queued calls, and stop at the first item that has to
        wait (it keeps its place: nothing overtakes it)."""
        while not self._pending:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Call):
                self._call(item)
                continue
            if isinstance(item, Job) and item.engine is cast(object, engine) and engine.can_join(item.rows):
                with self._lock:
                    self.stats.queued -= 1
                if item.cancelled.is_set():
                    self._finish(item, cancelled=True, rows=len(item.drivers))
                    continue
                engine.join(batch, item.rows)
                run.start(item)
                continue
            self._pending.append(item)

    def _finish(self, job: Job, *, cancelled: bool, rows: int = 0) -> None:
        with self._lock:
            if cancelled:
                self.stats.cancelled_rows += rows
        job.emit(JobDone(cancelled=cancelled))

    def _run(self, first: Job) -> None:
        """Step one batch until every row in it is done: ``first``'s rows, and on a
        :class:`~millm_core.engine.Joinable` engine the rows of jobs that join it."""
        engine = first.engine
        if first.cancelled.is_set():
            self._finish(first, cancelled=True, rows=len(first.drivers))
            return
        run = _Run(self)
        batch = None
        run.start(first)  # before open_batch: a batch that cannot open fails this job, never strands it
        try:
            batch = engine.open_batch(first.rows)
            joinable = engine if isinstance(engine, Joinable) else None
            while run.slots:
                for job in run.cancelled_jobs():
                    keep = run.drop(job)
                    if run.slots:
                        engine.retain(batch, keep)
                if not run.slots:
                    break
                if joinable is not None:
                    self._admit(joinable, batch, run)
                slots = run.slots
                tokens = engine.step(batch, [job.drivers[i].bias() for job, i in slots])
                keep = run.accept(tokens)
                if len(keep) < len(slots) and run.slots:
                    engine.retain(batch, keep)
        except BaseException as exc:  # noqa: BLE001 - delivered to every request in the batch, logged
            log.exception("batch_failed", request_ids=[j.request_id for j in run.jobs])
            run.fail(exc)
        finally:
            if batch is not None:
                engine.close(batch)
            with self._lock:
                self.stats.active_rows = 0


class _Run:
    """The jobs and rows of one running batch, in the engine's row order."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: list[tuple[Job, int]] = []
        self.jobs: list[Job] = []
        self.live: dict[int, int] = {}  # id(job) -> live rows
        self.started: dict[int, float] = {}

    def _stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def start(self, job: Job) -> None:
        self.jobs.append(job)
        self.slots.extend((job, i) for i in range(len(job.drivers)))
        self.live[id(job)] = len(job.drivers)
        self.started[id(job)] = time.perf_counter()
        with self.scheduler._lock:
            self._stats().running_jobs += 1
            self._stats().active_rows = len(self.slots)

    def _end(self, job: Job, cancelled: bool) -> None:
        self.jobs.remove(job)
        self.live.pop(id(job), None)
        with self.scheduler._lock:
            self._stats().running_jobs -= 1
        seconds = round(time.perf_counter() - self.started.pop(id(job)), 4)
        log.debug("job_done", request_id=job.request_id, rows=len(job.drivers), cancelled=cancelled, seconds=seconds)
        job.emit(JobDone(cancelled=cancelled))

    def cancelled_jobs(self) -> list[Job]:
        return [job for job in self.jobs if job.cancelled.is_set()]

    def drop(self, job: Job) -> list[int]:
        """Cancel ``job``'s live rows; returns the positions of the rows that stay."""
        keep = [p for p, (j, _) in enumerate(self.slots) if j is not job]
        dropped = [(j, i) for j, i in self.slots if j is job]
        for _, i in dropped:
            job.drivers[i].cancel()
        self.slots = [self.slots[p] for p in keep]
        with self.scheduler._lock:
            self._stats().cancelled_rows += len(dropped)
            self._stats().active_rows = len(self.slots)
        self._end(job, cancelled=True)
        return keep

    def accept(self, tokens: list[int]) -> list[int]:
        """Hand one step's tokens to the rows' drivers, emit each job's events, end the
        jobs whose rows all finished; returns the positions of the rows that go on."""
        per_job: dict[int, list[RowEvent]] = {}
        keep: list[int] = []
        for pos, ((job, i), token) in enumerate(zip(self.slots, tokens, strict=True)):
            event = job.drivers[i].accept(token)
            per_job.setdefault(id(job), []).append(event)
            if event.finish_reason is None:
                keep.append(pos)
            else:
                self.live[id(job)] -= 1
        finished = len(self.slots) - len(keep)
        with self.scheduler._lock:
            stats = self._stats()
            stats.steps += 1
            stats.generated_tokens += len(self.slots)
            stats.completed_rows += finished
            stats.active_rows = len(keep)
        for job in list(self.jobs):
            if id(job) in per_job:
                job.emit(StepEvents(per_job[id(job)]))
        self.slots = [self.slots[p] for p in keep]
        for job in [j for j in self.jobs if self.live.get(id(j)) == 0]:
            self._end(job, cancelled=False)
        return keep

    def fail(self, error: BaseException) -> None:
        with self.scheduler._lock:
            self._stats().failed_jobs += len(self.jobs)
            self._stats().running_jobs -= len(self.jobs)
        for job in self.jobs:
            job.emit(JobFailed(error))
        self.jobs, self.slots = [], []


def threadsafe_emitter(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue[JobEvent]) -> Callable[[JobEvent], None]:
    """An ``emit`` callback that hands events from the worker thread to ``sink``."""

    def emit(event: JobEvent) -> None:
        loop.call_soon_threadsafe(sink.put_nowait, event)

    return emit
