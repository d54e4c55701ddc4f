"""The scheduler's side of :class:`~millm_core.engine.JoinTogether`, on a fake joinable
engine (no model; the transformers engine's side is in tests/engine/test_lean_prefill.py):
requests waiting together join in one call and get their first tokens in one draw, each
with its own text, and a request the engine refuses fails alone."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from millm_core.engine import JoinTogether, RowSpec
from millm_core.scheduler import JobDone, JobFailed, Scheduler

from .test_eager_join import EagerFake
from .test_faults_scheduler import JOIN_FAILS, FakeBatch, FakeEngine, Wait, job, solo


class TogetherFake(EagerFake):
    """:class:`EagerFake` that also joins requests together, recording each call's
    requests (their first rows' seeds) and the steps run before it."""

    def __init__(self, delay: float = 0.0, max_rows: int = 16, broken: bool = False) -> None:
        super().__init__(delay)
        self.max_rows = max_rows
        self.broken = broken  # joins nothing and answers for one request fewer than asked
        self.together_calls: list[tuple[int, list[int]]] = []
        self.calls: list[str] = []  # "join 2,3" and "first 2" (rows), in order
        self.joins_together = True  # an attribute here; the protocol reads it as a property

    def first_tokens(self, batch: FakeBatch, biases: Sequence[Mapping[int, float] | None]) -> list[int]:
        self.calls.append(f"first {len(biases)}")
        return super().first_tokens(batch, biases)

    def join_together(self, batch: FakeBatch, requests: Sequence[Sequence[RowSpec]]) -> list[BaseException | None]:
        self.together_calls.append((self.steps, [rows[0].prompt_ids[1] for rows in requests]))
        self.calls.append("join " + ",".join(str(rows[0].prompt_ids[1]) for rows in requests))
        if self.broken:
            return [None] * (len(requests) - 1)
        outcome: list[BaseException | None] = []
        for rows in requests:
            try:
                self.join(batch, rows)
                outcome.append(None)
            except RuntimeError as exc:
                outcome.append(exc)
        return outcome


def running_then_queue(sched: Scheduler, engine: FakeEngine, late: list[Any]) -> Any:
    """Start a job that holds the worker at its first token, queue ``late`` (job() tuples)
    meanwhile, then let it go on: they all wait for the same admission. Returns the running
    job's sink."""
    gate, entered = threading.Event(), threading.Event()
    running, sink = job(engine, seed=1, tokens=12, processors=lambda: [Wait(gate, entered)])
    sched.submit(running)
    assert entered.wait(10)
    for j, _ in late:
        sched.submit(j)
    gate.set()
    return sink


@pytest.fixture
def scheduler() -> Any:
    sched = Scheduler(max_queue=64)
    yield sched
    sched.shutdown()


def test_the_fake_joins_together_and_the_eager_one_does_not() -> None:
    assert isinstance(TogetherFake(), JoinTogether) and not isinstance(EagerFake(), JoinTogether)


def test_an_engine_that_says_it_would_share_nothing_joins_one_request_at_a_time(scheduler: Scheduler) -> None:
    engine = TogetherFake(delay=0.005)
    engine.joins_together = False
    late = [job(engine, seed=2), job(engine, seed=3)]
    running = running_then_queue(scheduler, engine, late)
    for (_, sink), seed in zip(late, (2, 3), strict=True):
        assert sink.end() == JobDone(cancelled=False) and sink.texts(1) == solo(FakeEngine(), seed)
    assert running.end() == JobDone(cancelled=False)
    assert engine.together_calls == [] and engine.calls == ["first 1", "first 1"]


def test_waiting_requests_join_in_one_call_and_draw_their_first_tokens_once(scheduler: Scheduler) -> None:
    """Three requests queued while a batch runs: one join_together with all three (in queue
    order), one first_tokens for their four rows, and every text equal to its solo run."""
    engine = TogetherFake(delay=0.005)
    late = [job(engine, seed=2), job(engine, seed=3, rows=2), job(engine, seed=4)]
    running = running_then_queue(scheduler, engine, late)
    assert running.end() == JobDone(cancelled=False)
    for (_, sink), seed, rows in zip(late, (2, 3, 4), (1, 2, 1), strict=True):
        assert sink.end() == JobDone(cancelled=False)
        assert sink.texts(rows) == solo(FakeEngine(), seed, rows=rows)
    assert [seeds for _, seeds in engine.together_calls] == [[2, 3, 4]]
    assert engine.first_calls == [(1, 4)]  # after the running row, all four joined rows at once


def test_a_refused_request_fails_alone_and_the_others_draw_at_once(scheduler: Scheduler) -> None:
    engine = TogetherFake(delay=0.005)
    bad = job(engine, JOIN_FAILS, seed=3)
    late = [job(engine, seed=2), bad, job(engine, seed=4)]
    running = running_then_queue(scheduler, engine, late)
    failed = bad[1].end()
    assert isinstance(failed, JobFailed) and "refused on purpose" in str(failed.error)
    for seed in (2, 4):
        sink = next(s for j, s in late if j.rows[0].prompt_ids[1] == seed)
        assert sink.end() == JobDone(cancelled=False) and sink.texts(1) == solo(FakeEngine(), seed)
    assert running.end() == JobDone(cancelled=False)
    assert engine.first_calls == [(1, 2)]
    assert scheduler.snapshot().failed_jobs == 1


def test_only_requests_whose_rows_fit_together_join(scheduler: Scheduler) -> None:
    """``can_join`` is asked about the rows of the requests joining with it: with room for
    three more rows, the requests of two and one rows join, the next waits for room."""
    engine = TogetherFake(delay=0.005, max_rows=4)
    late = [job(engine, seed=2, rows=2), job(engine, seed=3), job(engine, seed=4)]
    running = running_then_queue(scheduler, engine, late)
    for (_, sink), seed, rows in zip(late, (2, 3, 4), (2, 1, 1), strict=True):
        assert sink.end() == JobDone(cancelled=False) and sink.texts(rows) == solo(FakeEngine(), seed, rows=rows)
    assert running.end() == JobDone(cancelled=False)
    assert [seeds for _, seeds in engine.together_calls][0] == [2, 3]
    assert [4] in [seeds for _, seeds in engine.together_calls]


def test_an_engine_that_answers_for_fewer_requests_fails_them_not_the_batch(scheduler: Scheduler) -> None:
    engine = TogetherFake(delay=0.005, broken=True)
    late = [job(engine, seed=2), job(engine, seed=3)]
    running = running_then_queue(scheduler, engine, late)
    for _, sink in late:
        failed = sink.end()
        assert isinstance(failed, JobFailed) and "answered for 1 of 2" in str(failed.error)
    assert running.end() == JobDone(cancelled=False) and running.texts(1) == solo(FakeEngine(), 1, tokens=12)


def test_each_lane_joins_in_a_call_of_its_own_interactive_first(scheduler: Scheduler) -> None:
    """An agent job queued before two interactive ones: the interactive jobs join first,
    together, and draw their first tokens before the agent job's prefill (its own call)."""
    engine = TogetherFake(delay=0.005)
    agent = job(engine, seed=2)
    agent[0].lane = "agent"
    late = [agent, job(engine, seed=3), job(engine, seed=4)]
    running = running_then_queue(scheduler, engine, late)
    for (_, sink), seed in zip(late, (2, 3, 4), strict=True):
        assert sink.end() == JobDone(cancelled=False) and sink.texts(1) == solo(FakeEngine(), seed)
    assert running.end() == JobDone(cancelled=False)
    assert engine.calls == ["join 3,4", "first 2", "join 2", "first 1"]


def test_jobs_queued_before_a_model_call_join_before_it_runs(scheduler: Scheduler) -> None:
    engine = TogetherFake(delay=0.005)
    gate, entered = threading.Event(), threading.Event()
    running, running_sink = job(engine, seed=1, tokens=12, processors=lambda: [Wait(gate, entered)])
    scheduler.submit(running)
    assert entered.wait(10)
    first, first_sink = job(engine, seed=2)
    scheduler.submit(first)
    called = scheduler.call(lambda: engine.calls.append("call"))
    second, second_sink = job(engine, seed=3)
    scheduler.submit(second)
    gate.set()
    called.result(10)
    assert first_sink.end() == second_sink.end() == running_sink.end() == JobDone(cancelled=False)
    assert engine.calls == ["join 2", "first 1", "call", "join 3", "first 1"]


class CanJoinRaises(TogetherFake):
    """can_join raises for a request whose first row's seed is 3."""

    def can_join(self, rows: Sequence[RowSpec]) -> bool:
        if any(r.prompt_ids[1] == 3 for r in rows):
            raise RuntimeError("can_join broke")
        return super().can_join(rows)


def test_claimed_jobs_fail_rather_than_wait_forever_when_admission_raises(scheduler: Scheduler) -> None:
    """A job claimed to join together, then admission raises at the next one: the claimed
    job fails (it is in neither the queue nor the batch), as does the batch."""
    engine = CanJoinRaises(delay=0.005)
    late = [job(engine, seed=2), job(engine, seed=3)]
    running = running_then_queue(scheduler, engine, late)
    assert isinstance(late[0][1].end(), JobFailed) and isinstance(running.end(), JobFailed)


class JoinExits(TogetherFake):
    """join_together raises SystemExit (not an Exception): the worker thread stops."""

    def join_together(self, batch: FakeBatch, requests: Sequence[Sequence[RowSpec]]) -> list[BaseException | None]:
        raise SystemExit("worker stops")


def test_jobs_handed_to_an_engine_that_stops_the_worker_fail_rather_than_wait() -> None:
    sched = Scheduler(max_queue=64)
    try:
        engine = JoinExits(delay=0.005)
        late = [job(engine, seed=2), job(engine, seed=3)]
        running = running_then_queue(sched, engine, late)
        for _, sink in late:
            failed = sink.end()
            assert isinstance(failed, JobFailed) and isinstance(failed.error, SystemExit)
        assert isinstance(running.end(), JobFailed)
    finally:
        sched.shutdown()
