"""Admission and execution of generation jobs and model calls.

One worker thread per scheduler runs jobs; a job's rows (its choices and prompts) form one
batch stepped together. Events go back to the request's asyncio queue once per step.
Cancellation is checked between steps, so a client that disconnects frees its rows within
one step; a job or call cancelled while it waits leaves the queue at once.

The worker thread is the only thread that runs model code: loading, scoring, embeddings
and SAE reads included (see :meth:`Scheduler.call`). With torch's OpenMP runtime, a second
thread doing tensor work gets its own thread team, and the two teams then slow each other
down for good (measured here: 27 → 19 tok/s on a 135M-parameter model after one call from
another thread).

On an engine that is :class:`~millm_core.engine.Joinable` (the GGUF engine; the
transformers engine on its lean decode step), jobs queued for the same engine join the
running batch between steps while the engine says they fit: concurrent requests then share
each forward pass. On an engine that is also :class:`~millm_core.engine.EagerJoin`, rows
that join a batch that has stepped draw their first token at once, before the next step;
on a :class:`~millm_core.engine.JoinTogether` engine the jobs waiting at one admission join
in one call (their prompts may share forward passes). A queued job that cannot join (another engine, no room) does not hold
back later jobs that can, up to :attr:`Scheduler.max_overtakes` times; after that the
batch takes no more joins and drains so that it runs next. Otherwise a batch holds one
job's rows. Model calls run between steps, in queue order.

Failures are per row: a token processor that raises, a row an engine reports failed
(:class:`~millm_core.jobs.RowsFailed`) or a join the engine refuses fails its own request
only; the batch's other rows go on. An engine step that raises fails every job in the
batch, and the scheduler goes on with the next. If the worker thread itself stops, every
waiting and running request gets a typed 503 and :attr:`Scheduler.healthy` turns false.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar, cast

import msgspec
import structlog

from .batchrun import BatchRun, emit
from .engine import EagerJoin, Joinable, JoinTogether, PrefixReusing, Rewinding, Tapping
from .errors import MillmError, QueueFull, ServiceUnavailable
from .jobs import (
    Call,
    Job,
    JobDone,
    JobEvent,
    JobFailed,
    RowsFailed,
    SchedulerStats,
    ServiceClock,
    StepEvents,
    scheduler_down,
    threadsafe_emitter,
)

__all__ = [
    "Call",
    "Job",
    "JobDone",
    "JobEvent",
    "JobFailed",
    "RowsFailed",
    "Scheduler",
    "SchedulerStats",
    "StepEvents",
    "threadsafe_emitter",
]

log = structlog.get_logger("millm.scheduler")

AGENT = "agent"  # the lower-priority lane (Job.lane); everything else is interactive

R = TypeVar("R")


def _settle(call: Call, error: BaseException) -> None:
    if call.future.set_running_or_notify_cancel():
        call.future.set_exception(error)


class Scheduler:
    """FIFO admission with a bounded queue; ``submit`` and ``call`` never block."""

    max_overtakes = 32  # later jobs that may join the running batch ahead of a waiting job
    # Interactive work served ahead of a waiting agent job before that job is served in
    # its arrival place, as if interactive: the agent lane is never starved.
    lane_passes = 8
    # Rows a running batch keeps free of agent jobs, for interactive requests to join at
    # once, while interactive requests arrived within the last ``interactive_window_s``
    # (agent-only traffic gets every row). No pre-emption: without it, agent rows filling
    # every row (every GGUF sequence) keep an interactive request waiting until one ends.
    agent_reserve = 1
    interactive_window_s = 30.0

    def __init__(self, max_queue: int, observe_step: Callable[[float], None] | None = None) -> None:
        self._max_queue = max_queue
        # Called on the model thread with each step's duration in seconds (metrics).
        self._observe_step = observe_step
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[Job | Call] = collections.deque()
        self._stopping = False
        self._failure: str | None = None  # why the model thread stopped
        self._run_now: BatchRun | None = None
        self._clock = ServiceClock()
        self._interactive_at = float("-inf")  # when the last interactive job was submitted
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._worker, name="millm-scheduler", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="millm-scheduler-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # ------------------------------------------------------------------ public

    def submit(self, job: Job) -> None:
        """Queue a generation job, or raise :class:`~millm_core.errors.QueueFull` (or a
        503 when the model thread has stopped)."""
        job.on_cancel = self._withdraw
        self._enqueue(job)

    def call(self, fn: Callable[[], R], *, counted: bool = True) -> Future[R]:
        """Run ``fn`` on the worker thread, between decode steps, in queue order; for model
        loading, scoring, embeddings and any other tensor work that must not happen on
        another thread. It counts against ``--max-queue`` (raises
        :class:`~millm_core.errors.QueueFull` when full) unless ``counted`` is false.
        Cancelling the future while it waits takes it out of the queue at once; it never
        runs."""
        future: Future[R] = Future()
        item = Call(fn, future)
        self._enqueue(item, counted=counted)
        future.add_done_callback(lambda f: self._withdraw(item) if f.cancelled() else None)
        return future

    def cancel_jobs(self, engine: object) -> int:
        """Cancel every queued or running generation job on ``engine`` (an unload past
        its grace period); returns how many. Each ends as its client leaving would."""
        with self._lock:
            jobs = [item for item in self._waiting if isinstance(item, Job) and item.engine is engine]
        run = self._run_now
        jobs += [job for job in (list(run.jobs) if run is not None else []) if job.engine is engine]
        for job in jobs:
            job.cancel()
        return len(jobs)

    @property
    def healthy(self) -> bool:
        """False once the model thread has stopped unexpectedly (its requests were failed
        with a 503); readiness reports it."""
        return self._failure is None and (self._stopping or self._thread.is_alive())

    @property
    def failure(self) -> str | None:
        """Why the model thread stopped, or None while it is healthy."""
        if self._failure is not None:
            return self._failure
        return None if self.healthy else "the model thread is not running"

    def retry_after_s(self, queued: int | None = None) -> int:
        """Whole seconds (≥ 1) a refused client should wait before retrying: the queue
        depth (now, or ``queued``) times the recent interval between completions.
        Non-decreasing in the queue depth."""
        return self._clock.wait_s(self.stats.queued if queued is None else queued)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker: waiting jobs and calls get a 503, a running batch stops at
        its next step."""
        with self._lock:
            self._stopping = True
            left = list(self._waiting)
            self._waiting.clear()
            for item in left:
                item.queued = False
            self.stats.queued = 0
            self._wakeup.notify_all()
        self._fail_items(left, lambda: ServiceUnavailable("The server is shutting down; this request was not run.", code="shutting_down"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def snapshot(self) -> SchedulerStats:
        with self._lock:
            return msgspec.structs.replace(self.stats)

    # ------------------------------------------------------------------ queue

    def _enqueue(self, item: Job | Call, *, counted: bool = True) -> None:
        with self._lock:
            if self._failure is not None or not self._thread.is_alive():
                raise scheduler_down(self._failure or "the model thread is not running")
            if self._stopping:
                raise ServiceUnavailable("The server is shutting down; retry on its replacement.", code="shutting_down")
            if counted and self.stats.queued >= self._max_queue:
                raise QueueFull(
                    f"The request queue is full ({self._max_queue} waiting); retry shortly.",
                    headers={"Retry-After": str(self._clock.wait_s(self.stats.queued))},
                )
            item.queued = True
            self.stats.queued += 1
            self._waiting.append(item)
            if isinstance(item, Job) and item.lane != AGENT:
                self._interactive_at = time.monotonic()  # admitted interactive work (see agent_reserve)
            self._wakeup.notify()

    def _claim(self, item: Job | Call) -> bool:
        """Take ``item`` out of the queue for the worker; False if it already left."""
        with self._lock:
            return self._claim_locked(item)

    def _claim_locked(self, item: Job | Call) -> bool:
        if not item.queued:
            return False
        item.queued = False
        self._waiting.remove(item)
        self.stats.queued -= 1
        return True

    def _served_order(self, waiting: list[Job | Call]) -> list[Job | Call]:
        """Waiting items in the order they are served: model calls, interactive jobs and
        agent jobs passed ``lane_passes`` times, in arrival order; then the other agent
        jobs, in arrival order."""
        late = [i for i in waiting if isinstance(i, Job) and i.lane == AGENT and i.passed < self.lane_passes]
        if not late:
            return waiting
        later = {id(i) for i in late}
        return [i for i in waiting if id(i) not in later] + late

    def _pass_agents(self, served: Job | Call) -> None:
        """``served`` goes ahead of the agent jobs that arrived before it: count it for
        each of them (under the lock)."""
        for item in self._waiting:
            if item is served:
                return
            if isinstance(item, Job) and item.lane == AGENT:
                item.passed += 1

    def _withdraw(self, item: Job | Call) -> None:
        """A job cancelled or a call's future cancelled: out of the queue now, if it is
        still there (otherwise the worker handles it between steps)."""
        with self._lock:
            if not self._claim_locked(item):
                return
            if isinstance(item, Job):
                self.stats.cancelled_rows += len(item.drivers)
        if isinstance(item, Job):
            emit(item, JobDone(cancelled=True))

    def _take(self) -> Job | Call | None:
        """The oldest waiting item (blocking while none), or None when stopping."""
        with self._wakeup:
            idle = False
            while not self._waiting and not self._stopping:
                idle = True
                self._wakeup.wait()
            if self._stopping:
                return None
            item = self._served_order(list(self._waiting))[0]
            self._pass_agents(item)
            self._claim_locked(item)
        if idle:
            self._clock.busy()
        return item

    # ------------------------------------------------------------------ worker

    def _worker(self) -> None:
        try:
            while True:
                item = self._take()
                if item is None:
                    return
                if isinstance(item, Call):
                    self._call(item)
                else:
                    self._run(item)
        except BaseException as exc:  # noqa: BLE001 - the thread must not die silently
            log.exception("scheduler_died", error=type(exc).__name__)
            self._die(f"{type(exc).__name__} on the model thread")

    def _watch(self) -> None:
        """Wait for the worker to end; an end nobody asked for fails what it held."""
        self._thread.join()
        if not self._stopping:
            self._die("the model thread ended")

    def _die(self, reason: str) -> None:
        """Mark the scheduler unhealthy and fail every waiting and running request with a
        503. Idempotent: a second call finds nothing left to fail."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
            failure = self._failure
            left = list(self._waiting)
            self._waiting.clear()
            for item in left:
                item.queued = False
            self.stats.queued = 0
            run, self._run_now = self._run_now, None
        if run is not None:
            run.fail_all(scheduler_down(failure))
        self._fail_items(left, lambda: scheduler_down(failure))

    def _fail_items(self, items: list[Job | Call], error: Callable[[], MillmError]) -> None:
        for item in items:
            if isinstance(item, Call):
                _settle(item, error())
            else:
                with self._lock:
                    self.stats.failed_jobs += 1
                emit(item, JobFailed(error()))

    def _call(self, item: Call) -> None:
        if item.future.set_running_or_notify_cancel():
            try:
                item.future.set_result(item.fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                item.future.set_exception(exc)
            self._clock.done()

    def _admit(self, run: BatchRun, joinable: Joinable | None, batch: Any, joined: Callable[[int], None] | None = None) -> None:
        """Between steps: run waiting calls and join waiting jobs for this engine that fit
        (when the engine is joinable), in queue order. A job that has to wait keeps its
        place without holding back the jobs behind it, until it has been overtaken
        :attr:`max_overtakes` times: then no later job joins, and the batch drains.
        ``joined(first)``, when given, runs after each job joins, with the position of its
        first row (an EagerJoin engine's first tokens, drawn before the next job's prefill).
        On a :class:`~millm_core.engine.JoinTogether` engine see :meth:`_admit_together`."""
        with self._lock:
            waiting = self._served_order(list(self._waiting))
        if isinstance(joinable, JoinTogether) and joinable.joins_together:
            self._admit_together(run, joinable, batch, waiting, joined)
            return
        blocked: list[Job] = []
        starving = False  # a blocked job was overtaken enough: nothing joins ahead of it
        for item in waiting:
            if isinstance(item, Call):
                if self._claim(item):
                    self._call(item)
                continue
            if starving or not self._fits(item, joinable, []):
                blocked.append(item)
                starving = starving or item.overtaken >= self.max_overtakes
                continue
            if not self._claim_job(item):
                continue  # cancelled meanwhile: _withdraw ended it
            try:
                cast(Joinable, joinable).join(batch, item.rows)
            except Exception as exc:  # noqa: BLE001 - this job's error, not the batch's
                self._join_failed(item, exc)
                continue
            starving = self._overtake(blocked) or starving
            first = len(run.slots)
            run.start(item)
            if joined is not None:
                joined(first)
                if not run.slots:
                    # Every row left at that draw (the job ended at its first token and the
                    # running rows had failed): this batch ends, without a retain to match
                    # the engine to it, so nothing more may join it; the rest wait.
                    return

    def _admit_together(
        self, run: BatchRun, engine: JoinTogether, batch: Any, waiting: list[Job | Call], joined: Callable[[int], None] | None
    ) -> None:
        """:meth:`_admit` on a JoinTogether engine: the jobs that fit join in one call per
        run of jobs of one lane (interactive, or agent) in serving order, and ``joined``
        runs once after each call. Jobs claimed before a waiting call join before it runs
        (queue order); if anything raises, the jobs claimed and not yet joined fail."""
        joinable = cast(Joinable, engine)
        pending: list[Job] = []  # claimed, to join together
        blocked: list[Job] = []
        starving = False
        try:
            for item in waiting:
                if isinstance(item, Job):
                    if starving or not self._fits(item, joinable, pending):
                        blocked.append(item)
                        starving = starving or item.overtaken >= self.max_overtakes
                        continue
                    if pending and (pending[0].lane == AGENT) != (item.lane == AGENT):
                        # One lane per shared call: an interactive job's first tokens never
                        # wait for the prefill of an agent job served after it.
                        jobs, pending = pending, []
                        if not self._join_together(run, engine, batch, jobs, joined):
                            return
                    if not self._claim_job(item):
                        continue
                    starving = self._overtake(blocked) or starving
                    pending.append(item)
                    continue
                if pending:  # the jobs claimed before this call join first
                    jobs, pending = pending, []
                    if not self._join_together(run, engine, batch, jobs, joined):
                        return
                if self._claim(item):
                    self._call(item)
            if pending:
                jobs, pending = pending, []
                self._join_together(run, engine, batch, jobs, joined)
        except BaseException as exc:  # claimed jobs not yet joined would be stranded
            for job in pending:
                self._join_failed(job, exc)
            raise

    def _fits(self, job: Job, joinable: Joinable | None, ahead: list[Job]) -> bool:
        """Whether ``job`` may join the running batch now, after the jobs ``ahead``."""
        rows = [row for other in ahead for row in other.rows]
        return (
            joinable is not None
            and job.engine is cast(object, joinable)
            and joinable.can_join([*rows, *job.rows])
            and not self._reserved(job, joinable, rows)
        )

    def _claim_job(self, job: Job) -> bool:
        """Take ``job`` off the queue to join (False: it was cancelled meanwhile)."""
        with self._lock:
            if not job.queued:
                return False
            self._pass_agents(job)
            self._claim_locked(job)
        return True

    def _overtake(self, blocked: list[Job]) -> bool:
        """Count a job joining ahead of each of ``blocked``; True once one was overtaken
        enough that nothing more may join ahead of it."""
        starving = False
        for job in blocked:
            job.overtaken += 1
            starving = starving or job.overtaken >= self.max_overtakes
        return starving

    def _join_together(
        self, run: BatchRun, engine: JoinTogether, batch: Any, jobs: list[Job], joined: Callable[[int], None] | None
    ) -> bool:
        """Join ``jobs`` (claimed) in one call; each that the engine refuses fails alone.
        False when the batch has no rows left afterwards (see :meth:`_admit`): nothing more
        may join it."""
        try:
            outcome = engine.join_together(batch, [job.rows for job in jobs])
            if len(outcome) != len(jobs):
                raise RuntimeError(f"the engine's join_together answered for {len(outcome)} of {len(jobs)} requests")
        except Exception as exc:  # noqa: BLE001 - these jobs' error, not the batch's
            outcome = [exc] * len(jobs)
        except BaseException as exc:  # the worker stops: these jobs are in neither the queue nor the batch
            for job in jobs:
                self._join_failed(job, exc)
            raise
        first = len(run.slots)
        for job, error in zip(jobs, outcome, strict=True):
            if error is not None:
                self._join_failed(job, error)
            else:
                run.start(job)
        if joined is not None and len(run.slots) > first:
            joined(first)
        return bool(run.slots)

    def _join_failed(self, job: Job, exc: BaseException) -> None:
        log.error("join_failed", request_id=job.request_id, exc_info=exc)
        with self._lock:
            self.stats.failed_jobs += 1
        emit(job, JobFailed(exc))

    def _draw(self, run: BatchRun, engine: Any, batch: Any, first: int, draw: Callable[..., list[int]]) -> None:
        """One draw of tokens for the batch's rows from position ``first`` on: ``draw`` is
        :meth:`~millm_core.engine.Engine.step` (``first`` 0, every row) or
        :meth:`~millm_core.engine.EagerJoin.first_tokens` (the rows that just joined). Then
        the rows' readouts, resumed prompt counts, events, finished rows and rewinds."""
        biases, allowed = run.biases(first)
        try:
            # ``allowed`` goes to the engine only when some row is constrained, so an engine
            # without masks (and the unconstrained path) never sees it; the masked form is
            # declared by Capability.STRUCTURED_OUTPUT.
            tokens = draw(batch, biases, allowed) if allowed is not None else draw(batch, biases)
        except RowsFailed as partial:
            tokens = partial.tokens
            run.fail_rows(partial.errors)
        if isinstance(engine, Tapping) and run.tapped():
            run.read(engine.readouts(batch))
        if isinstance(engine, PrefixReusing) and run.fresh_rows:
            run.resumed(engine.resumed(batch))
        rows = len(run.slots)
        keep = run.accept(tokens, first)
        if len(keep) < rows and run.slots:
            engine.retain(batch, keep)
        for pos, k in run.rewinds():
            try:
                cast(Rewinding, engine).rewind(batch, pos, k)  # rows of engines with Capability.REWIND only
            except Exception as exc:  # noqa: BLE001 - this row's request fails, not the batch
                run.rewind_failed(pos, exc)

    def _reserved(self, job: Job, joinable: Joinable, ahead: list[Any] | None = None) -> bool:
        """Whether agent ``job`` must not join because it would take the rows kept for
        interactive requests (``agent_reserve``, while interactive requests are recent):
        the engine is asked whether the job's rows and that many more would fit (after
        ``ahead``, rows of jobs about to join with it)."""
        if job.lane != AGENT or self.agent_reserve <= 0 or not job.rows:
            return False
        if job.passed >= self.lane_passes or job.overtaken >= self.max_overtakes:
            return False  # held back long enough: it takes any row now (never starved)
        if time.monotonic() - self._interactive_at > self.interactive_window_s:
            return False
        return not joinable.can_join([*(ahead or []), *job.rows, *[job.rows[0]] * self.agent_reserve])

    def _run(self, first: Job) -> None:
        """Step one batch until every row in it is done: ``first``'s rows, and on a
        :class:`~millm_core.engine.Joinable` engine the rows of jobs that join it."""
        engine = first.engine
        if first.cancelled.is_set():
            with self._lock:
                self.stats.cancelled_rows += len(first.drivers)
            emit(first, JobDone(cancelled=True))
            return
        run = BatchRun(self)
        self._run_now = run
        batch = None
        run.start(first)  # before open_batch: a batch that cannot open fails this job, never strands it
        try:
            batch = engine.open_batch(first.rows)
            joinable = engine if isinstance(engine, Joinable) else None
            eager = engine if isinstance(engine, EagerJoin) else None
            stepped = False
            while run.slots:
                if self._stopping:
                    run.fail_all(ServiceUnavailable("The server is shutting down; this request was stopped.", code="shutting_down"))
                    break
                for job in run.cancelled_jobs():
                    keep = run.drop(job)
                    if run.slots:
                        engine.retain(batch, keep)
                if not run.slots:
                    break
                if self._waiting:
                    # A joined job's first tokens now, not after everyone's next step, and
                    # before the next joining job's prefill (8 requests arriving at once get
                    # their first tokens one prefill apart, not all after the eighth).
                    draw_first = (
                        functools.partial(self._draw, run, engine, batch, draw=eager.first_tokens)
                        if eager is not None and stepped
                        else None
                    )
                    self._admit(run, joinable, batch, draw_first)
                    if not run.slots:
                        break
                started = time.perf_counter()
                self._draw(run, engine, batch, 0, engine.step)
                stepped = True
                if self._observe_step is not None:
                    self._observe_step(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - delivered to every request in the batch, logged
            log.exception("batch_failed", request_ids=[j.request_id for j in run.jobs])
            run.fail_all(exc)
        finally:
            if batch is not None:
                engine.close(batch)
            with self._lock:
                self.stats.active_rows = 0
        self._run_now = None  # not on a BaseException: _die fails the run's jobs
