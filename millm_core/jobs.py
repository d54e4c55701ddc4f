"""What the scheduler queues and hands back: jobs (a request's rows), model calls, the
events a job emits, the counters, and the service-time estimate behind ``Retry-After``.

The scheduler itself (admission, the worker thread, batches) is
:mod:`millm_core.scheduler`, which re-exports the names request code uses.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .engine import Engine, RowSpec
from .errors import InternalError, MillmError, ServiceUnavailable
from .rows import RowDriver, RowEvent


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
    """The job failed; ``error`` is the exception (a :class:`~millm_core.errors.MillmError`
    when the scheduler knows what it means for the client)."""

    error: BaseException


JobEvent = StepEvents | JobDone | JobFailed


class _Queued:
    """Queue membership shared by jobs and model calls: ``queued`` is true while the item
    waits (and counts against ``--max-queue``); the scheduler's lock guards it."""

    queued: bool = False
    overtaken: int = 0  # times a later job joined the running batch ahead of this one


@dataclass(eq=False)
class Job(_Queued):
    """Rows of one request, to be stepped together on one engine."""

    engine: Engine
    rows: list[RowSpec]
    drivers: list[RowDriver]
    emit: Callable[[JobEvent], None]
    request_id: str = ""
    # The scheduling lane: "interactive" (default) or "agent" (served after interactive
    # work, never starved: see Scheduler.lane_passes). ``passed`` counts the times
    # interactive work was served ahead of this agent job.
    lane: str = "interactive"
    passed: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set by the scheduler on submit: takes a job cancelled while queued out of the queue at once.
    on_cancel: Callable[[Job], None] | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Stop the job: a queued job leaves the queue now (it ends with
        ``JobDone(cancelled=True)``), a running one frees its rows before the next step.
        Safe from any thread, and more than once."""
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)


@dataclass(eq=False)
class Call(_Queued):
    """A function to run on the model thread, its result or error delivered on ``future``."""

    fn: Callable[[], Any]
    future: Future[Any]


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Counters exposed at ``GET /api/health/inference``. ``queued`` counts everything
    waiting for the model thread: generation jobs and model calls (scoring, embeddings,
    SAE features, loads)."""

    queued: int = 0
    running_jobs: int = 0
    active_rows: int = 0
    completed_rows: int = 0
    cancelled_rows: int = 0
    failed_jobs: int = 0
    steps: int = 0
    generated_tokens: int = 0


class RowsFailed(Exception):  # noqa: N818 - a signal from an engine's step, named for what happened
    """Raised by an engine's ``step`` when some rows failed but the others were stepped
    (a non-finite row, one joining prompt's prefill that ran out of memory): ``tokens``
    has one entry per row in row order (any value for a failed row) and ``errors`` maps a
    failed row's position to its error. The failed rows are still in the batch; the
    scheduler fails their requests alone and drops them with ``retain``."""

    def __init__(self, tokens: Sequence[int], errors: Mapping[int, BaseException]) -> None:
        super().__init__(f"{len(errors)} row(s) failed")
        self.tokens = list(tokens)
        self.errors = dict(errors)


def row_error(exc: BaseException) -> MillmError:
    """What a client gets for a failure inside its own row (a token processor's bug): a
    typed error; the details stay in the log."""
    if isinstance(exc, MillmError):
        return exc
    error = InternalError("A token processor failed while generating this request; see the server's log for the request id.")
    error.__cause__ = exc
    return error


def scheduler_down(reason: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The model thread stopped ({reason}); this request was not completed. The server needs a restart.",
        code="scheduler_unavailable",
    )


class ServiceClock:
    """Recent service times: an exponentially weighted mean of the interval between
    completions while the worker is busy (the inverse of recent throughput, batching
    included). Written by the worker thread only; read from any thread."""

    DEFAULT_INTERVAL_S = 1.0
    MAX_WAIT_S = 300

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self.interval_s: float | None = None
        self._last_done = 0.0
        self._busy_since = 0.0

    def busy(self) -> None:
        """The worker took work after waiting idle."""
        self._busy_since = time.perf_counter()

    def done(self) -> None:
        """A job or call ended (finished, failed or cancelled while running)."""
        now = time.perf_counter()
        interval = now - max(self._last_done, self._busy_since)
        self._last_done = now
        previous = self.interval_s
        self.interval_s = interval if previous is None else previous + self._alpha * (interval - previous)

    def wait_s(self, queued: int) -> int:
        """Whole seconds until a request arriving behind ``queued`` waiting items would
        start: at least 1, non-decreasing in ``queued``, capped at :attr:`MAX_WAIT_S`."""
        interval = self.interval_s if self.interval_s is not None else self.DEFAULT_INTERVAL_S
        return max(1, min(self.MAX_WAIT_S, math.ceil((max(queued, 0) + 1) * interval - 1e-9)))


def threadsafe_emitter(loop: asyncio.AbstractEventLoop, sink: asyncio.Queue[JobEvent]) -> Callable[[JobEvent], None]:
    """An ``emit`` callback that hands events from any thread to ``sink``."""

    def emit(event: JobEvent) -> None:
        loop.call_soon_threadsafe(sink.put_nowait, event)

    return emit
