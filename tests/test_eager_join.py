"""The scheduler's side of :class:`~millm_core.engine.EagerJoin`, on a fake joinable engine
(no model; the engines' side is in the conformance suite): a job joining a running batch
gets its first token before the batch's next step, with its own biases only, and what
happens at that draw (a finished row, a failed row, a processor that raises) happens to
that job alone."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from millm_core.engine import Capability, EagerJoin, RowSpec
from millm_core.errors import MillmError
from millm_core.scheduler import JobDone, JobEvent, JobFailed, RowsFailed, Scheduler, StepEvents

from .test_faults_scheduler import ROW_FAILS, FakeBatch, FakeEngine, Raises, Sink, job, solo


class Recording(FakeEngine):
    """:class:`FakeEngine` that records the step count at each join."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.joined_at: list[int] = []

    def join(self, batch: FakeBatch, rows: Sequence[RowSpec]) -> None:
        self.joined_at.append(self.steps)
        super().join(batch, rows)


class EagerFake(Recording):
    """:class:`Recording` that also draws joined rows' first tokens at once, recording each
    call's first row position, its row count and the biases it was given."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.first_calls: list[tuple[int, int]] = []  # (first position, rows)
        self.biases_seen: list[list[Any]] = []
        self.retained: list[tuple[int, list[int]]] = []  # (first_tokens calls so far, keep)

    def retain(self, batch: FakeBatch, keep: Sequence[int]) -> None:
        self.retained.append((len(self.first_calls), list(keep)))
        super().retain(batch, keep)

    def first_tokens(self, batch: FakeBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        first = batch.size - len(biases)
        self.first_calls.append((first, len(biases)))
        self.biases_seen.append(list(biases))
        tokens = [(sum(row) * 7 + len(row)) % 89 + 10 for row in batch.rows[first:]]
        errors: dict[int, BaseException] = {
            first + at: MillmError("non-finite logits", code="non_finite") for at, row in enumerate(batch.rows[first:]) if row[0] == ROW_FAILS
        }
        for row, token in zip(batch.rows[first:], tokens, strict=True):
            row.append(token)
        if errors:
            raise RowsFailed(tokens, errors)
        return tokens


class StepsAtFirstEvent(Sink):
    """A sink that notes the engine's step count when the job's first tokens arrive."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__()
        self.engine = engine
        self.steps_at_first: int | None = None

    def __call__(self, event: JobEvent) -> None:
        if isinstance(event, StepEvents) and self.steps_at_first is None:
            self.steps_at_first = self.engine.steps
        super().__call__(event)


def running_then_join(sched: Scheduler, engine: FakeEngine, late: Any, **kwargs: Any) -> tuple[Sink, StepsAtFirstEvent, int]:
    """Start a long job, wait until it has stepped twice, then submit ``late`` (a job()
    tuple whose sink is replaced); returns the running job's sink, the late job's sink and
    the step count when it was submitted."""
    running, running_sink = job(engine, seed=1, tokens=40)
    sched.submit(running)
    while engine.steps < 2:
        threading.Event().wait(0.002)
    late_job, _ = late
    sink = StepsAtFirstEvent(engine)
    late_job.emit = sink
    submitted = engine.steps
    sched.submit(late_job)
    return running_sink, sink, submitted


@pytest.fixture
def scheduler() -> Any:
    sched = Scheduler(max_queue=64)
    yield sched
    sched.shutdown()


def test_the_fake_is_eager_and_the_plain_one_is_not() -> None:
    assert isinstance(EagerFake(), EagerJoin) and not isinstance(FakeEngine(), EagerJoin)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "plain"])
def test_a_joining_job_gets_its_first_token_before_the_next_step(scheduler: Scheduler, eager: bool) -> None:
    """With EagerJoin the joined job's first event comes with no step of the batch between
    its join and its first token; without it (the control), one step later. Either way its
    text and the running job's equal their solo runs."""
    expected = {seed: solo(FakeEngine(), seed, tokens=tokens) for seed, tokens in ((1, 40), (2, 6))}
    engine = EagerFake(delay=0.02) if eager else Recording(delay=0.02)
    running_sink, sink, _ = running_then_join(scheduler, engine, job(engine, seed=2))
    assert sink.end() == JobDone(cancelled=False) and running_sink.end() == JobDone(cancelled=False)
    assert sink.texts(1) == expected[2] and running_sink.texts(1) == expected[1]
    joined_at = engine.joined_at[-1]  # [open_batch's join, the late job's]
    assert len(engine.joined_at) == 2 and joined_at >= 2
    assert sink.steps_at_first == (joined_at if eager else joined_at + 1)
    if eager:
        assert isinstance(engine, EagerFake) and engine.first_calls == [(1, 1)]  # the joined row, after the running one
    stats = scheduler.snapshot()
    assert stats.generated_tokens == 46 and stats.steps == 40


def test_first_tokens_runs_only_between_steps_of_a_started_batch(scheduler: Scheduler) -> None:
    """Jobs queued before a batch's first step go with that step: first_tokens is called
    only for rows joining a batch that has stepped."""
    from .test_faults_scheduler import run_together

    engine = EagerFake()
    jobs = [job(engine, seed=s) for s in (1, 2, 3)]
    run_together(scheduler, engine, jobs)
    assert engine.first_calls == []


def test_a_joined_row_whose_budget_is_one_token_ends_at_its_first_draw(scheduler: Scheduler) -> None:
    engine = EagerFake(delay=0.01)
    expected = solo(FakeEngine(), 1, tokens=40)
    running_sink, sink, _ = running_then_join(scheduler, engine, job(engine, seed=2, tokens=1))
    assert sink.end() == JobDone(cancelled=False)
    assert len(sink.texts(1)[0]) > 0 and sink.steps_at_first == engine.joined_at[-1]
    assert running_sink.end() == JobDone(cancelled=False) and running_sink.texts(1) == expected
    assert engine.first_calls == [(1, 1)]
    # Retained away right after that draw, before any step: the next retain is the running
    # row's own end (the batch closes without one).
    assert engine.retained[0] == (1, [0]) and sink.steps_at_first == engine.joined_at[-1]


def test_a_row_that_fails_at_its_first_draw_fails_its_job_only(scheduler: Scheduler) -> None:
    engine = EagerFake(delay=0.01)
    expected = solo(FakeEngine(), 1, tokens=40)
    running_sink, sink, _ = running_then_join(scheduler, engine, job(engine, ROW_FAILS, seed=2))
    failed = sink.end()
    assert isinstance(failed, JobFailed) and isinstance(failed.error, MillmError) and failed.error.code == "non_finite"
    # It failed at first_tokens (keyed by its batch position, 1): no token ever reached it.
    assert engine.first_calls == [(1, 1)] and not any(isinstance(e, StepEvents) for e in sink.events)
    assert running_sink.end() == JobDone(cancelled=False) and running_sink.texts(1) == expected


def test_a_processor_that_raises_at_the_first_draw_fails_its_job_only(scheduler: Scheduler) -> None:
    engine = EagerFake(delay=0.01)
    expected = solo(FakeEngine(), 1, tokens=40)
    bad = job(engine, seed=2, processors=lambda: [Raises(0, ValueError("processor bug"), in_bias=True)])
    running_sink, sink, _ = running_then_join(scheduler, engine, bad)
    assert isinstance(sink.end(), JobFailed)
    assert running_sink.end() == JobDone(cancelled=False) and running_sink.texts(1) == expected
    assert engine.biases_seen and all(len(b) == 1 for b in engine.biases_seen)  # the joined row's only


def test_jobs_joining_at_once_draw_each_row_once_after_the_running_rows(scheduler: Scheduler) -> None:
    """Two jobs submitted together (joining between the same two steps or two in a row):
    each of their three rows is drawn once by first_tokens, at positions after the running
    row, and every job keeps its solo text."""
    engine = EagerFake(delay=0.02)
    expected = {seed: solo(FakeEngine(), seed, rows=rows, tokens=tokens) for seed, rows, tokens in ((1, 1, 40), (2, 2, 6), (3, 1, 6))}
    running, running_sink = job(engine, seed=1, tokens=40)
    scheduler.submit(running)
    while engine.steps < 2:
        threading.Event().wait(0.002)
    # Queue both while the worker is inside a step, so that they join between the same two steps.
    a, a_sink = job(engine, seed=2, rows=2)
    b, b_sink = job(engine, seed=3)
    scheduler.submit(a)
    scheduler.submit(b)
    for sink, seed, rows in ((a_sink, 2, 2), (b_sink, 3, 1), (running_sink, 1, 1)):
        assert sink.end() == JobDone(cancelled=False) and sink.texts(rows) == expected[seed]
    assert sum(n for _, n in engine.first_calls) == 3
    assert all(first >= 1 for first, _ in engine.first_calls)


class Ordered(EagerFake):
    """:class:`EagerFake` that logs joins and first-token draws in the order they happen."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(delay)
        self.log: list[tuple[str, int]] = []

    def join(self, batch: FakeBatch, rows: Sequence[RowSpec]) -> None:
        self.log.append(("join", len(rows)))
        super().join(batch, rows)

    def first_tokens(self, batch: FakeBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        self.log.append(("first", len(biases)))
        return super().first_tokens(batch, biases)


def test_jobs_joining_together_get_their_first_tokens_one_join_apart(scheduler: Scheduler) -> None:
    """Jobs waiting at the same step boundary: each job's first tokens are drawn right after
    its own join (its prefill), before the next job joins, not all after the last one."""
    engine = Ordered(delay=0.1)
    running, running_sink = job(engine, seed=1, tokens=20)
    scheduler.submit(running)
    while engine.steps < 2:
        threading.Event().wait(0.002)
    late = [job(engine, seed=s, rows=r) for s, r in ((2, 2), (3, 1), (4, 1))]
    started = engine.steps
    while engine.steps == started:  # a step has just begun (it counts, then takes 100 ms)
        threading.Event().wait(0.001)
    for queued, _ in late:  # all inside that step: they join at the same boundary
        scheduler.submit(queued)
    for _, sink in late:
        assert sink.end() == JobDone(cancelled=False)
    assert running_sink.end() == JobDone(cancelled=False)
    joins = [i for i, (what, _) in enumerate(engine.log) if what == "join"][1:]  # the first opened the batch
    assert len(joins) == 3 and engine.joined_at[1] == engine.joined_at[3]  # one boundary, as arranged
    assert [engine.log[i + 1] for i in joins] == [("first", 2), ("first", 1), ("first", 1)]


class TakesBack:
    """A processor that asks for its row's second token back (a rewind)."""

    def __init__(self) -> None:
        self.tokens = 0

    def logit_bias(self) -> dict[int, float]:
        return {}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.tokens += 1
        return text, False

    def take_back(self) -> int:
        return 1 if self.tokens == 2 else 0

    def flush(self) -> str:
        return ""


class CannotRewind(Ordered):
    """:class:`Ordered` whose rewinds fail (as an engine's rewind can: a cache that cannot
    take tokens back, no memory)."""

    capabilities: frozenset[Any] = frozenset({Capability.REWIND})

    def rewind(self, batch: FakeBatch, row: int, k: int) -> None:
        raise RuntimeError("this cache cannot take tokens back")


def test_a_batch_emptied_by_a_first_token_draw_takes_no_more_joins(scheduler: Scheduler) -> None:
    """The running job's rewind fails after a step (its row leaves at the next draw); at that
    boundary a job that ends at its first token joins, and its draw leaves the batch with no
    rows. A job waiting behind it must not join that batch (whose engine rows were never
    trimmed to the empty run): it opens a new one and gets its solo text."""
    engine = CannotRewind(delay=0.1)
    expected = solo(FakeEngine(), 6, rows=2)
    rewinding, rewinding_sink = job(engine, tokens=40, processors=lambda: [TakesBack()])
    scheduler.submit(rewinding)
    while engine.steps < 2:  # its second step (whose token it takes back) has begun
        threading.Event().wait(0.001)
    short, short_sink = job(engine, seed=5, tokens=1)
    behind, behind_sink = job(engine, seed=6, rows=2)
    scheduler.submit(short)
    scheduler.submit(behind)
    assert isinstance(rewinding_sink.end(), JobFailed)
    assert short_sink.end() == JobDone(cancelled=False)
    assert behind_sink.end() == JobDone(cancelled=False) and behind_sink.texts(2) == expected
