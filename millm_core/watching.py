"""Keeping a plugin's in-memory snapshot in step with other servers on the same database.

Several millm servers may share one SQLite file (two ``millm serve`` processes, or Ray Serve
replicas). A plugin whose requests read an in-memory snapshot of its tables keeps a version
row that every write of those tables moves, in the same transaction, and watches it: every
``REFRESH_S`` a task on the event loop reads the version off the loop (a worker thread) and,
when it is not the snapshot's, re-reads the state and installs it. The steering and probes
plugins use it; any plugin may, as ``millm_core.api.watching``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .errors import MillmError
from .store import Store

REFRESH_S = 0.1  # how often a server looks for another server's writes
CONSISTENT_READ_TRIES = 5  # re-reads when a write lands in the middle of one

T = TypeVar("T")


def consistent_read(version: Callable[[], int], held: int, load: Callable[[], T], version_of: Callable[[T], int]) -> T | None:
    """``load()`` when the database's ``version()`` is not ``held``, else None (blocking).
    Consistent without a write lock: the reads count only if the version did not move while
    they ran (every write moves it); after ``CONSISTENT_READ_TRIES`` moves, None (the next
    look will do)."""
    for _ in range(CONSISTENT_READ_TRIES):
        if version() == held:
            return None
        stored = load()
        if version() == version_of(stored):
            return stored
    return None


async def watch(refresh: Callable[[], Awaitable[object]], log: Any, event: str, every: float = REFRESH_S) -> None:
    """Call ``refresh`` every ``every`` seconds for as long as the app runs. A failure is
    logged (``event``) and the next look tries again: a watcher that died would leave the
    snapshot stale for good."""
    while True:
        await asyncio.sleep(every)
        try:
            await refresh()
        except MillmError as exc:  # database_busy and the like: look again next time
            log.debug(event, error=exc.message)
        except Exception:  # noqa: BLE001 - see above
            log.exception(event)


def start(store: Store, watcher: Callable[[], Coroutine[Any, Any, None]], name: str) -> asyncio.Task[None] | None:
    """Run ``watcher()`` as a task on the running event loop, for a database file only
    (nothing else can write to a ``:memory:`` one); None when there is nothing to watch or
    no loop runs (started outside a server: nothing serves requests)."""
    if store.path == ":memory:":
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.create_task(watcher(), name=name)
