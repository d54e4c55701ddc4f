"""The bookkeeping of one running batch: its jobs and rows in the engine's row order, what
each step's tokens do to them (events, finished rows, failures, rewinds), and the counts
the scheduler reports. The scheduler's worker thread owns it; see
:mod:`millm_core.scheduler`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog

from .engine import Capability
from .errors import FieldNotHonoured
from .jobs import Job, JobDone, JobEvent, JobFailed, SchedulerStats, StepEvents, row_error
from .rows import RowEvent

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = structlog.get_logger("millm.scheduler")


def emit(job: Job, event: JobEvent) -> None:
    """Hand ``event`` to the job's request; a request whose loop is gone is dropped."""
    try:
        job.emit(event)
    except Exception:  # noqa: BLE001 - a closed event loop must not stop the worker
        log.warning("emit_failed", request_id=job.request_id, event=type(event).__name__)


class BatchRun:
    """The jobs and rows of one running batch, in the engine's row order."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: list[tuple[Job, int]] = []
        self.jobs: list[Job] = []
        self.live: dict[Job, int] = {}  # job -> live rows
        self.started: dict[Job, float] = {}
        # Jobs failed in the current step (a processor's bias, a row the engine reported):
        # their rows are stepped once more (or, if the next draw is only joined rows' first
        # tokens, not), then dropped with that draw's finished rows.
        self.failing: dict[Job, BaseException] = {}
        # Rows that take tokens back after the current step: (row position after the
        # step's retain, tokens).
        self._rewinds: list[tuple[int, int]] = []
        # Rows started since the engine last said how much of their prompts it resumed
        # (their prefill runs in the next step).
        self.fresh_rows = False

    def rewind_failed(self, pos: int, exc: BaseException) -> None:
        """The engine could not rewind the row at ``pos``: its request fails (its rows
        leave the batch after the next draw)."""
        job, row = self.slots[pos]
        self._row_failed(job, row, exc)

    def rewinds(self) -> list[tuple[int, int]]:
        """The rows to rewind after this step (positions after its retain), once."""
        out, self._rewinds = self._rewinds, []
        return out

    def _stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def start(self, job: Job) -> None:
        self.fresh_rows = True
        self.jobs.append(job)
        self.slots.extend((job, i) for i in range(len(job.drivers)))
        self.live[job] = len(job.drivers)
        self.started[job] = time.perf_counter()
        with self.scheduler._lock:
            self._stats().running_jobs += 1
            self._stats().active_rows = len(self.slots)

    def _end(self, job: Job, event: JobEvent) -> None:
        self.jobs.remove(job)
        self.live.pop(job, None)
        with self.scheduler._lock:
            self._stats().running_jobs -= 1
            if isinstance(event, JobFailed):
                self._stats().failed_jobs += 1
        seconds = round(time.perf_counter() - self.started.pop(job), 4)
        log.debug("job_done", request_id=job.request_id, rows=len(job.drivers), outcome=type(event).__name__, seconds=seconds)
        self.scheduler._clock.done()
        emit(job, event)

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
        self._end(job, JobDone(cancelled=True))
        return keep

    def biases(self, first: int = 0) -> tuple[list[Any], list[Any] | None]:
        """Each row's logit bias for the next draw, and each row's allowed tokens (None
        when no row is constrained), for the rows from position ``first`` on. A processor
        that raises fails its own job (its rows are drawn for once more, unbiased and
        unconstrained, and are then dropped)."""
        out: list[Any] = []
        allowed: list[Any] | None = None
        for at, (job, i) in enumerate(self.slots[first:]):
            driver = job.drivers[i]
            try:
                out.append(driver.bias())
                if driver.constrained:
                    if Capability.STRUCTURED_OUTPUT not in job.engine.capabilities:
                        raise FieldNotHonoured(
                            "a token processor constrains this row, but this engine applies no token masks "
                            "(it lacks the structured_output capability)"
                        )
                    mask = driver.allowed()
                    if mask is not None:
                        if allowed is None:
                            allowed = [None] * (len(self.slots) - first)
                        allowed[at] = mask
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                self._row_failed(job, i, exc)
                if len(out) <= at:
                    out.append(None)
        return out, allowed

    def resumed(self, counts: list[int]) -> None:
        """After the step that prefilled new rows: how many prompt tokens each row's
        prefill resumed (:class:`~millm_core.engine.PrefixReusing`), kept by rows that
        have not heard it yet."""
        self.fresh_rows = False
        for (job, i), count in zip(self.slots, counts, strict=True):
            driver = job.drivers[i]
            if driver.cached_tokens is None:
                driver.cached_tokens = count

    def tapped(self) -> bool:
        """Whether some row in the batch asked for taps (its vectors are read back)."""
        return any(job.rows and job.rows[0].taps for job in self.jobs)

    def read(self, readouts: list[Any]) -> None:
        """Hand each tapped row the vectors this step read for it. A listener that raises
        fails its own job (its rows are dropped after this step)."""
        for (job, i), readout in zip(self.slots, readouts, strict=True):
            if readout is None or job in self.failing:
                continue
            try:
                job.drivers[i].read(readout)
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                self._row_failed(job, i, exc)

    def _row_failed(self, job: Job, row: int, exc: BaseException) -> None:
        if job not in self.failing:
            log.error("row_failed", request_id=job.request_id, row=row, exc_info=exc)
            self.failing[job] = row_error(exc)

    def fail_rows(self, errors: dict[int, BaseException]) -> None:
        """Rows at these positions failed in the engine's step (:class:`RowsFailed`)."""
        for pos, exc in errors.items():
            job, i = self.slots[pos]
            if job not in self.failing:
                log.error("row_failed", request_id=job.request_id, row=i, error=type(exc).__name__)
                self.failing[job] = exc

    def accept(self, tokens: list[int], first: int = 0) -> list[int]:
        """Hand drawn tokens to the rows' drivers — one per row from position ``first`` on
        (0: a step of every row; else the first tokens of rows that just joined) — emit
        each job's events, end the jobs whose rows all finished and the jobs that failed;
        returns the positions of the rows that go on."""
        per_job: dict[Job, list[RowEvent]] = {}
        keep: list[int] = list(range(first))
        finished = 0
        failing = self.failing
        for pos, ((job, i), token) in enumerate(zip(self.slots[first:], tokens, strict=True), start=first):
            if failing and job in failing:
                continue
            try:
                event = job.drivers[i].accept(token)
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                self._row_failed(job, i, exc)
                continue
            if event.rewind and Capability.REWIND not in job.engine.capabilities:
                self._row_failed(job, i, FieldNotHonoured("a token processor takes tokens back, but this engine cannot rewind a row"))
                continue
            per_job.setdefault(job, []).append(event)
            if event.finish_reason is None:
                if event.rewind:
                    self._rewinds.append((len(keep), event.rewind))
                keep.append(pos)
            else:
                self.live[job] -= 1
                finished += 1
        if failing:  # rows of a job that failed at this step's later rows
            if self._rewinds:
                kept = {p for p in keep if self.slots[p][0] not in failing}
                moved = {p: n for n, p in enumerate(sorted(kept))}
                self._rewinds = [(moved[keep[at]], k) for at, k in self._rewinds if keep[at] in moved]
            keep = [p for p in keep if self.slots[p][0] not in failing]
        with self.scheduler._lock:
            stats = self._stats()
            stats.steps += 1 if first == 0 else 0
            stats.generated_tokens += len(tokens)
            stats.completed_rows += finished
            stats.active_rows = len(keep)
        if failing:
            self.failing = {}
            for job, error in failing.items():
                per_job.pop(job, None)
                self._end(job, JobFailed(error))
        for job in list(self.jobs):
            if job in per_job:
                emit(job, StepEvents(per_job[job]))
        self.slots = [self.slots[p] for p in keep]
        for job in [j for j in self.jobs if self.live.get(j) == 0]:
            self._end(job, JobDone(cancelled=False))
        return keep

    def fail_all(self, error: BaseException) -> None:
        """Fail every job still in the batch with ``error``."""
        jobs, self.jobs, self.slots, self.failing = self.jobs, [], [], {}
        with self.scheduler._lock:
            self._stats().failed_jobs += len(jobs)
            self._stats().running_jobs -= len(jobs)
        for job in jobs:
            emit(job, JobFailed(error))
