"""The scheduler's fault handling, queue accounting and fairness, on a fake joinable engine
(no model): per-row failures, join and step failures, the watchdog, cancellation while
queued, head-of-line, model calls against ``--max-queue``, and the Retry-After estimate."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any

import pytest

from millm_core.context import AppContext
from millm_core.engine import RowSpec, SamplingParams
from millm_core.errors import InternalError, MillmError, QueueFull, ServiceUnavailable
from millm_core.jobs import ServiceClock
from millm_core.rows import RowDriver
from millm_core.scheduler import Job, JobDone, JobEvent, JobFailed, RowsFailed, Scheduler, StepEvents

from .http.helpers import wait_until

# A prompt's first id says what the fake engine does with its row.
PLAIN, JOIN_FAILS, STEP_FAILS, ROW_FAILS = 1, 2, 3, 4


def decode(ids: Sequence[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


class FakeBatch:
    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    @property
    def size(self) -> int:
        return len(self.rows)


class FakeEngine:
    """Joinable; a row's next token is a function of its own history only (so a row's
    output never depends on its batch), ``delay`` seconds a step."""

    capabilities: frozenset[Any] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, delay: float = 0.0, max_rows: int = 16) -> None:
        self.delay = delay
        self.max_rows = max_rows
        self.rows = 0
        self.steps = 0

    def open_batch(self, rows: Sequence[RowSpec]) -> FakeBatch:
        batch = FakeBatch()
        self.join(batch, rows)
        return batch

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        return self.rows + len(rows) <= self.max_rows

    def join(self, batch: FakeBatch, rows: Sequence[RowSpec]) -> None:
        if any(r.prompt_ids[0] == JOIN_FAILS for r in rows):
            raise RuntimeError("join refused on purpose")
        batch.rows.extend(list(r.prompt_ids) for r in rows)
        self.rows += len(rows)

    def step(self, batch: FakeBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        self.steps += 1
        if self.delay:
            time.sleep(self.delay)
        if any(row[0] == STEP_FAILS for row in batch.rows):
            raise RuntimeError("step failed on purpose")
        tokens = [(sum(row) * 7 + len(row)) % 89 + 10 for row in batch.rows]
        errors: dict[int, BaseException] = {
            pos: MillmError("non-finite logits", code="non_finite")
            for pos, row in enumerate(batch.rows)
            if row[0] == ROW_FAILS and len(row) > 3
        }
        for row, token in zip(batch.rows, tokens, strict=True):
            row.append(token)
        if errors:
            raise RowsFailed(tokens, errors)
        return tokens

    def retain(self, batch: FakeBatch, keep: Sequence[int]) -> None:
        batch.rows = [batch.rows[i] for i in keep]
        self.rows = len(keep)

    def close(self, batch: FakeBatch) -> None:
        batch.rows = []
        self.rows = 0


class Raises:
    """A token processor that raises ``exc`` after ``after`` tokens, in ``on_token`` (or in
    ``logit_bias`` with ``in_bias``)."""

    def __init__(self, after: int, exc: BaseException, in_bias: bool = False) -> None:
        self.left = after
        self.exc = exc
        self.in_bias = in_bias

    def logit_bias(self) -> None:
        if self.in_bias and self.left <= 0:
            raise self.exc
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.left -= 1
        if not self.in_bias and self.left < 0:
            raise self.exc
        return text, False

    def flush(self) -> str:
        return ""


class Wait:
    """Sets ``entered`` and waits on ``gate`` at each token (holding the worker thread),
    then raises ``then`` if given."""

    def __init__(self, gate: threading.Event, entered: threading.Event | None = None, then: BaseException | None = None) -> None:
        self.gate = gate
        self.entered = entered or threading.Event()
        self.then = then

    def logit_bias(self) -> None:
        return None

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.entered.set()
        self.gate.wait(10)
        if self.then is not None:
            raise self.then
        return text, False

    def flush(self) -> str:
        return ""


class Sink:
    """A job's events, collected."""

    def __init__(self) -> None:
        self.events: list[JobEvent] = []
        self.ended = threading.Event()

    def __call__(self, event: JobEvent) -> None:
        self.events.append(event)
        if not isinstance(event, StepEvents):
            self.ended.set()

    def end(self, timeout: float = 10.0) -> JobEvent:
        assert self.ended.wait(timeout), "the job never ended"
        return self.events[-1]

    def texts(self, rows: int) -> list[str]:
        out = [""] * rows
        for event in self.events:
            if isinstance(event, StepEvents):
                for ev in event.events:
                    out[ev.row] += ev.text
        return out


def job(
    engine: FakeEngine,
    kind: int = PLAIN,
    *,
    rows: int = 1,
    tokens: int = 6,
    seed: int = 0,
    processors: Callable[[], list[Any]] | None = None,
) -> tuple[Job, Sink]:
    sink = Sink()
    specs = [RowSpec(prompt_ids=(kind, seed, r), sampling=SamplingParams(temperature=0), max_new_tokens=tokens) for r in range(rows)]
    drivers = [
        RowDriver(r, decode=decode, processors=processors() if processors else [], eos_token_ids=frozenset(), max_new_tokens=tokens)
        for r in range(rows)
    ]
    return Job(engine=engine, rows=specs, drivers=drivers, emit=sink, request_id=f"job-{kind}-{seed}"), sink  # type: ignore[arg-type]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    return wait_until(predicate, timeout, interval=0.005)


@pytest.fixture
def scheduler() -> Any:
    sched = Scheduler(max_queue=64)
    yield sched
    sched.shutdown()


def hold(sched: Scheduler, engine: FakeEngine) -> threading.Event:
    """Occupy the worker with a running job that waits on the returned gate (set it to let
    the job finish after one token): everything submitted meanwhile queues."""
    gate, entered = threading.Event(), threading.Event()
    blocker, _ = job(engine, seed=99, tokens=1, processors=lambda: [Wait(gate, entered)])
    sched.submit(blocker)
    assert entered.wait(10)
    return gate


def solo(engine: FakeEngine, seed: int, rows: int = 1, tokens: int = 6) -> list[str]:
    sched = Scheduler(max_queue=4)
    try:
        j, sink = job(engine, seed=seed, rows=rows, tokens=tokens)
        sched.submit(j)
        assert sink.end() == JobDone(cancelled=False)
        return sink.texts(rows)
    finally:
        sched.shutdown()


def run_together(sched: Scheduler, engine: FakeEngine, jobs: list[tuple[Job, Sink]]) -> None:
    """Queue ``jobs`` behind a held worker, then release it: the first opens a batch and the
    others join it before its first step."""
    gate = hold(sched, engine)
    for j, _ in jobs:
        sched.submit(j)
    assert sched.snapshot().queued == len(jobs)
    gate.set()
    for _, sink in jobs:
        sink.end()


# ------------------------------------------------------------------ per-row failures


@pytest.mark.parametrize("in_bias", [False, True], ids=["on_token", "logit_bias"])
def test_a_processor_that_raises_fails_its_own_job_only(scheduler: Scheduler, in_bias: bool) -> None:
    engine = FakeEngine()
    expected = {seed: solo(engine, seed, rows=2) for seed in (1, 2)}
    good_a, good_b = job(engine, seed=1, rows=2), job(engine, seed=2, rows=2)
    bad = job(engine, seed=3, rows=2, processors=lambda: [Raises(2, ValueError("processor bug"), in_bias)])
    run_together(scheduler, engine, [good_a, bad, good_b])
    failed = bad[1].end()
    assert isinstance(failed, JobFailed) and isinstance(failed.error, InternalError)
    assert failed.error.status == 500 and failed.error.code == "internal_error"
    assert "processor bug" not in failed.error.message  # the details are logged, not sent
    for seed, (_, sink) in ((1, good_a), (2, good_b)):
        assert sink.end() == JobDone(cancelled=False)
        assert sink.texts(2) == expected[seed]
    stats = scheduler.snapshot()
    assert stats.failed_jobs == 1 and stats.running_jobs == 0 and stats.active_rows == 0
    assert stats.steps < stats.generated_tokens  # the three jobs shared steps


def test_a_typed_processor_error_reaches_the_client_as_is(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    error = MillmError("bad feature index", code="invalid_feature_index", status=400)
    bad, sink = job(engine, processors=lambda: [Raises(1, error)])
    scheduler.submit(bad)
    assert sink.end() == JobFailed(error)


def test_rows_the_engine_reports_failed_fail_their_job_only(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    expected = solo(engine, 1, rows=2)
    good, broken = job(engine, seed=1, rows=2), job(engine, ROW_FAILS, seed=2)
    run_together(scheduler, engine, [broken, good])
    failed = broken[1].end()
    assert isinstance(failed, JobFailed) and isinstance(failed.error, MillmError) and failed.error.code == "non_finite"
    assert good[1].end() == JobDone(cancelled=False) and good[1].texts(2) == expected


def test_a_join_the_engine_refuses_fails_the_joining_job_only(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    expected = solo(engine, 1)
    good, refused = job(engine, seed=1), job(engine, JOIN_FAILS, seed=2)
    run_together(scheduler, engine, [good, refused])
    failed = refused[1].end()
    assert isinstance(failed, JobFailed) and "join refused" in str(failed.error)
    assert good[1].end() == JobDone(cancelled=False) and good[1].texts(1) == expected


def test_a_step_that_raises_fails_its_batch_and_the_scheduler_goes_on(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    good, poison = job(engine, seed=1), job(engine, STEP_FAILS, seed=2)
    run_together(scheduler, engine, [good, poison])
    assert isinstance(good[1].end(), JobFailed) and isinstance(poison[1].end(), JobFailed)
    after, sink = job(engine, seed=3)
    scheduler.submit(after)
    assert sink.end() == JobDone(cancelled=False)
    assert scheduler.healthy


# ------------------------------------------------------------------ watchdog


class Fatal(BaseException):
    pass


def test_a_dead_worker_fails_running_and_waiting_work_with_a_503() -> None:
    sched = Scheduler(max_queue=8)
    engine, other = FakeEngine(), FakeEngine()
    fatal_gate, fatal_entered = threading.Event(), threading.Event()
    running, running_sink = job(engine, seed=1, processors=lambda: [Wait(fatal_gate, fatal_entered, then=Fatal())])
    neighbour, neighbour_sink = job(engine, seed=2)
    gate = hold(sched, engine)
    sched.submit(running)
    sched.submit(neighbour)
    gate.set()
    assert fatal_entered.wait(10)  # the batch of two is in its first step
    waiting, waiting_sink = job(other, seed=3)  # another engine: it waits for the batch
    sched.submit(waiting)
    call = sched.call(lambda: 1)
    fatal_gate.set()
    for sink in (running_sink, neighbour_sink, waiting_sink):
        end = sink.end()
        assert isinstance(end, JobFailed) and isinstance(end.error, ServiceUnavailable)
        assert end.error.code == "scheduler_unavailable"
    with pytest.raises(ServiceUnavailable):
        call.result(5)
    assert not sched.healthy and sched.failure
    with pytest.raises(ServiceUnavailable) as refused:
        sched.submit(job(engine, seed=4)[0])
    assert refused.value.code == "scheduler_unavailable"
    with pytest.raises(ServiceUnavailable):
        sched.call(lambda: 1)
    stats = sched.snapshot()
    assert stats.queued == 0 and stats.running_jobs == 0


def test_the_watchdog_catches_a_worker_that_ends_without_a_word() -> None:
    class Quits(Scheduler):
        def _take(self) -> Any:
            return None  # the worker returns as if asked to stop, but nobody asked

    sched = Quits(max_queue=8)
    assert wait_for(lambda: not sched.healthy)
    with pytest.raises(ServiceUnavailable):
        sched.submit(job(FakeEngine())[0])


# ------------------------------------------------------------------ queue accounting


def test_a_job_cancelled_while_queued_leaves_the_queue_at_once(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    gate = hold(scheduler, engine)
    queued, sink = job(engine, seed=1, rows=3)
    scheduler.submit(queued)
    assert scheduler.snapshot().queued == 1
    queued.cancel()  # the worker is still held
    stats = scheduler.snapshot()
    assert stats.queued == 0 and stats.cancelled_rows == 3
    assert sink.end(0.1) == JobDone(cancelled=True)
    gate.set()
    assert wait_for(lambda: scheduler.snapshot().running_jobs == 0)
    assert len(sink.events) == 1  # the worker never saw it


def test_a_cancelled_model_call_leaves_the_queue_and_never_runs(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    gate = hold(scheduler, engine)
    ran = threading.Event()
    future = scheduler.call(ran.set)
    assert scheduler.snapshot().queued == 1
    assert future.cancel()
    assert scheduler.snapshot().queued == 0
    gate.set()
    assert scheduler.call(lambda: 2).result(5) == 2  # the worker has passed where it was
    assert not ran.is_set()


def test_run_model_cancelled_while_queued_cancels_its_call(scheduler: Scheduler) -> None:
    engine = FakeEngine()
    context = AppContext(settings=None, models=None, store=None, model_thread=scheduler, metrics=None, text_thread=None)  # type: ignore[arg-type]
    ran = threading.Event()

    async def main() -> None:
        task = asyncio.ensure_future(context.run_model(ran.set))
        await asyncio.sleep(0.05)
        assert scheduler.snapshot().queued == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert scheduler.snapshot().queued == 0

    gate = hold(scheduler, engine)
    asyncio.run(main())
    gate.set()
    assert scheduler.call(lambda: 2).result(5) == 2
    assert not ran.is_set()


def test_model_calls_count_against_the_queue_limit() -> None:
    sched = Scheduler(max_queue=2)
    try:
        engine = FakeEngine()
        gate = hold(sched, engine)
        first = sched.call(lambda: "a")
        sched.submit(job(engine, seed=1)[0])
        with pytest.raises(QueueFull) as full:
            sched.call(lambda: "b")
        assert int(full.value.headers["Retry-After"]) >= 1
        with pytest.raises(QueueFull):
            sched.submit(job(engine, seed=2)[0])
        loading = sched.call(lambda: "load", counted=False)  # loads may pass a full queue
        assert sched.snapshot().queued == 3
        gate.set()
        assert first.result(5) == "a" and loading.result(5) == "load"
    finally:
        sched.shutdown()


def test_a_call_that_raises_hands_its_error_to_the_caller(scheduler: Scheduler) -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        scheduler.call(boom).result(5)
    assert scheduler.call(lambda: 3).result(5) == 3


def test_shutdown_fails_waiting_work() -> None:
    sched = Scheduler(max_queue=8)
    engine = FakeEngine()
    gate = hold(sched, engine)
    waiting, sink = job(engine, seed=1)
    sched.submit(waiting)
    call = sched.call(lambda: 1)
    threading.Timer(0.2, gate.set).start()
    sched.shutdown()
    end = sink.end(1)
    assert isinstance(end, JobFailed) and isinstance(end.error, ServiceUnavailable)
    with pytest.raises((ServiceUnavailable, CancelledError)):
        call.result(1)


# ------------------------------------------------------------------ head-of-line


def test_a_job_that_cannot_join_does_not_hold_back_one_that_can(scheduler: Scheduler) -> None:
    engine, other = FakeEngine(delay=0.01), FakeEngine()
    long_job, long_sink = job(engine, seed=1, tokens=400)  # ~4 s of steps
    scheduler.submit(long_job)
    assert wait_for(lambda: engine.steps > 2)
    elsewhere, elsewhere_sink = job(other, seed=2, tokens=2)  # another engine: must wait
    joins, joins_sink = job(engine, seed=3, tokens=3)
    scheduler.submit(elsewhere)
    scheduler.submit(joins)
    assert joins_sink.end(3) == JobDone(cancelled=False)  # overtook the waiting job
    assert not long_sink.ended.is_set() and not elsewhere_sink.ended.is_set()
    assert scheduler.snapshot().queued == 1
    long_job.cancel()
    assert elsewhere_sink.end() == JobDone(cancelled=False)


def test_no_room_does_not_block_a_smaller_job(scheduler: Scheduler) -> None:
    engine = FakeEngine(delay=0.01, max_rows=4)
    long_job, _ = job(engine, seed=1, rows=3, tokens=400)
    scheduler.submit(long_job)
    assert wait_for(lambda: engine.steps > 2)
    big, big_sink = job(engine, seed=2, rows=2, tokens=2)  # 3 + 2 > 4
    small, small_sink = job(engine, seed=3, rows=1, tokens=2)
    scheduler.submit(big)
    scheduler.submit(small)
    assert small_sink.end(3) == JobDone(cancelled=False)
    assert not big_sink.ended.is_set()
    long_job.cancel()
    assert big_sink.end() == JobDone(cancelled=False)


def test_a_waiting_job_is_overtaken_a_bounded_number_of_times(scheduler: Scheduler) -> None:
    scheduler.max_overtakes = 2
    engine, other = FakeEngine(delay=0.01), FakeEngine()
    order: list[str] = []

    def tracked(j: Job, sink: Sink, name: str) -> tuple[Job, Sink]:
        def emit(event: JobEvent) -> None:
            if not isinstance(event, StepEvents):
                order.append(name)
            sink(event)

        j.emit = emit
        return j, sink

    long_job, long_sink = tracked(*job(engine, seed=1, tokens=60), "long")
    scheduler.submit(long_job)
    assert wait_for(lambda: engine.steps > 2)
    elsewhere, elsewhere_sink = tracked(*job(other, seed=2, tokens=1), "elsewhere")
    scheduler.submit(elsewhere)
    overtakers = [tracked(*job(engine, seed=seed, tokens=1), f"job{seed}") for seed in (3, 4, 5)]
    for j, _ in overtakers:
        scheduler.submit(j)
    for _, sink in [*overtakers, (elsewhere, elsewhere_sink), (long_job, long_sink)]:
        assert sink.end() == JobDone(cancelled=False)
    # Two jobs joined ahead of the waiting one; the third waited until the batch drained.
    assert order.index("job3") < order.index("long") and order.index("job4") < order.index("long")
    assert order.index("long") < order.index("elsewhere") < order.index("job5")


# ------------------------------------------------------------------ Retry-After


def test_retry_after_is_at_least_one_and_monotone_in_queue_depth() -> None:
    clock = ServiceClock()
    assert clock.wait_s(0) >= 1
    for interval in (0.001, 0.3, 1.7, 12.0):
        clock.interval_s = interval
        waits = [clock.wait_s(depth) for depth in range(0, 200)]
        assert all(w >= 1 for w in waits)
        assert waits == sorted(waits)
        assert waits[-1] <= ServiceClock.MAX_WAIT_S
    clock.interval_s = 0.5
    assert clock.wait_s(9) == 5 and clock.wait_s(0) == 1


def test_retry_after_follows_recent_service_times(scheduler: Scheduler) -> None:
    for _ in range(5):
        scheduler.call(lambda: time.sleep(0.3)).result(5)
    slow = scheduler.retry_after_s(queued=20)
    assert slow >= 4  # about 21 × 0.3 s
    for _ in range(40):
        scheduler.call(lambda: None).result(5)
    assert scheduler.retry_after_s(queued=20) < slow
    assert scheduler.retry_after_s() >= 1
    assert [scheduler.retry_after_s(queued=d) for d in range(64)] == sorted(scheduler.retry_after_s(queued=d) for d in range(64))
