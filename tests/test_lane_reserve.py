"""The row kept free for interactive requests (``Scheduler.agent_reserve``), on a fake
joinable engine of 4 rows: while interactive requests are recent, agent jobs fill at most
3 rows, so an interactive request joins the running batch at once instead of waiting for
an agent row to end; with no recent interactive request agents get every row; and the
agent kept out still runs (it is never starved)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from millm_core.engine import RowSpec
from millm_core.scheduler import JobDone, Scheduler

from .test_faults_scheduler import FakeBatch, FakeEngine, Sink, job

ROWS = 4


class Peak(FakeEngine):
    """Records the most rows its batch held at once."""

    def __init__(self) -> None:
        super().__init__(delay=0.01, max_rows=ROWS)
        self.peak = 0

    def join(self, batch: FakeBatch, rows: Sequence[RowSpec]) -> None:
        super().join(batch, rows)
        self.peak = max(self.peak, self.rows)


def agent(engine: FakeEngine, seed: int, tokens: int = 60) -> tuple[Any, Sink]:
    j, sink = job(engine, seed=seed, tokens=tokens)
    j.lane = "agent"
    return j, sink


def wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        threading.Event().wait(0.005)


@pytest.fixture
def scheduler() -> Any:
    sched = Scheduler(max_queue=64)
    yield sched
    sched.shutdown()


def test_agents_leave_a_row_for_recent_interactive_work(scheduler: Scheduler) -> None:
    engine = Peak()
    warm, warm_sink = job(engine, seed=1, tokens=1)  # an interactive request: recent from now on
    scheduler.submit(warm)
    assert warm_sink.end() == JobDone(cancelled=False)
    agents = [agent(engine, seed=10 + k) for k in range(ROWS)]
    for j, _ in agents:
        scheduler.submit(j)
    wait(lambda: engine.rows == ROWS - 1 and scheduler.snapshot().queued == 1)
    steps = engine.steps
    wait(lambda: engine.steps >= steps + 5)
    assert engine.rows == ROWS - 1 and scheduler.snapshot().queued == 1  # the fourth agent still waits
    interactive, sink = job(engine, seed=2, tokens=3)
    scheduler.submit(interactive)
    assert sink.end() == JobDone(cancelled=False)
    assert not any(s.ended.is_set() for _, s in agents[:3]), "the interactive request waited for an agent row to end"
    assert engine.peak == ROWS
    for _, s in agents:  # the agent kept out runs once a row frees: never starved
        assert s.end(30) == JobDone(cancelled=False)


def test_an_agent_held_back_long_enough_takes_the_last_row(scheduler: Scheduler) -> None:
    """Once interactive work has been served ahead of a kept-out agent ``lane_passes``
    times, the reserve no longer holds it back (it is never starved)."""
    engine = Peak()
    warm, warm_sink = job(engine, seed=1, tokens=1)
    scheduler.submit(warm)
    assert warm_sink.end() == JobDone(cancelled=False)
    scheduler.lane_passes = 2
    agents = [agent(engine, seed=10 + k) for k in range(ROWS)]
    for j, _ in agents:
        scheduler.submit(j)
    wait(lambda: engine.rows == ROWS - 1 and scheduler.snapshot().queued == 1)
    for seed in (2, 3):  # two interactive jobs served ahead of the waiting agent
        interactive, sink = job(engine, seed=seed, tokens=2)
        scheduler.submit(interactive)
        assert sink.end() == JobDone(cancelled=False)
    wait(lambda: engine.rows == ROWS and scheduler.snapshot().queued == 0)  # it took the reserved row
    assert not any(s.ended.is_set() for _, s in agents)  # before any agent row ended
    for _, s in agents:
        assert s.end(30) == JobDone(cancelled=False)


@pytest.mark.parametrize("why", ["no interactive request yet", "the last one is past the window", "no reserve"])
def test_agents_get_every_row_otherwise(scheduler: Scheduler, why: str) -> None:
    engine = Peak()
    if why != "no interactive request yet":
        warm, warm_sink = job(engine, seed=1, tokens=1)
        scheduler.submit(warm)
        assert warm_sink.end() == JobDone(cancelled=False)
    if why == "the last one is past the window":
        scheduler.interactive_window_s = 0.0
    if why == "no reserve":
        scheduler.agent_reserve = 0
    agents = [agent(engine, seed=10 + k, tokens=20) for k in range(ROWS)]
    for j, _ in agents:
        scheduler.submit(j)
    for _, s in agents:
        assert s.end(30) == JobDone(cancelled=False)
    assert engine.peak == ROWS
