"""The memory admission ledger: rows admitted by memory and not finished yet, per engine.

Admission checks a request's memory against what the device has free now. Requests
admitted a moment earlier may still be queued (they have allocated nothing) or running
(their KV cache grows to its budget), so "free now" alone would let many concurrent
requests each see the same memory and together overrun it. Each admitted request's rows
are claimed here until its job ends, and a :class:`~millm_core.engine.MemoryAware`
engine counts them as taken.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Claim:
    """One request's rows in the ledger; :meth:`release` (idempotent) when it ends."""

    __slots__ = ("_ledger", "_key", "_released")

    def __init__(self, ledger: MemoryLedger, key: int) -> None:
        self._ledger = ledger
        self._key = key
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._ledger._drop(self._key)


class MemoryLedger:
    """Rows ``(prompt_length, max_new_tokens)`` admitted per engine and not finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._claims: dict[int, tuple[int, list[tuple[int, int]]]] = {}  # key -> (engine id, rows)

    def admitted(self, engine: object) -> list[tuple[int, int]]:
        """The rows of ``engine`` admitted and not finished yet."""
        with self._lock:
            return [row for owner, rows in self._claims.values() if owner == id(engine) for row in rows]

    def claim(self, engine: object, rows: Sequence[tuple[int, int]]) -> Claim:
        with self._lock:
            self._next += 1
            self._claims[self._next] = (id(engine), list(rows))
            return Claim(self, self._next)

    def _drop(self, key: int) -> None:
        with self._lock:
            self._claims.pop(key, None)
