"""The line slots every running batch shares: ``--batch-concurrency`` workers, each taking
the next line of the oldest running batch that has one, so batches run oldest first and a
newer batch uses the slots an older one leaves free (its last lines, a wait). A batch holds
nothing while it waits for a slot: no open file, no task per line."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from .storage import Pending


@dataclass(eq=False)
class Job:
    """A running batch's lines: ``run_line`` runs one (reads it, dispatches it, records
    its result); ``stopping`` says no new line may start (cancelled, expired, stopping).
    ``error`` is what a line raised, if any: the batch then takes no new line."""

    batch_id: str
    order: int
    lines: Iterator[Pending]
    run_line: Callable[[Pending], Coroutine[Any, Any, None]]
    stopping: Callable[[], bool]
    done: asyncio.Future[None]
    in_flight: int = 0
    exhausted: bool = False
    error: BaseException | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class Slots:
    """The workers and the running batches, oldest (lowest ``order``) first."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._jobs: list[Job] = []
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []

    async def run(self, job: Job) -> None:
        """Run ``job``'s lines until none is left or it is stopping, and its running lines
        have ended."""
        self._jobs.append(job)
        self._jobs.sort(key=lambda j: j.order)
        loop = asyncio.get_running_loop()
        while len(self._workers) < self.concurrency:
            self._workers.append(loop.create_task(self._worker(), name=f"batch slot {len(self._workers)}"))
        self._wake.set()
        try:
            await job.done
        finally:
            job.exhausted = True
            if job in self._jobs:
                self._jobs.remove(job)

    def cancel(self, batch_id: str) -> None:
        """Stop the running lines of ``batch_id`` (its ``stopping`` says so already)."""
        for job in self._jobs:
            if job.batch_id == batch_id:
                for task in job.tasks:
                    task.cancel()

    def stop(self) -> None:
        """The server stops: the workers and every running line."""
        for job in self._jobs:
            for task in job.tasks:
                task.cancel()
        for worker in self._workers:
            worker.cancel()

    def _settle(self, job: Job) -> None:
        if job.exhausted and job.in_flight == 0:
            if job in self._jobs:
                self._jobs.remove(job)
            if not job.done.done():
                job.done.set_result(None)

    def _next(self) -> tuple[Job, Pending] | None:
        for job in list(self._jobs):
            if not job.exhausted and not job.stopping():
                line = next(job.lines, None)
                if line is not None:
                    return job, line
            job.exhausted = True
            self._settle(job)
        return None

    async def _worker(self) -> None:
        while True:
            picked = self._next()
            if picked is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            job, line = picked
            job.in_flight += 1
            task = asyncio.get_running_loop().create_task(job.run_line(line))
            job.tasks.add(task)
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                job.tasks.discard(task)
                job.in_flight -= 1
            if not task.cancelled() and task.exception() is not None:
                job.error = job.error or task.exception()
                job.exhausted = True
            self._settle(job)
