"""The regex automata of constrained rows, built off the event loop and the model thread.

A ``pattern`` (in a schema, or a forced pythonic tool call) is constrained by a finite
automaton that lm-format-enforcer builds from the pattern (through ``interegular``), in
pure Python. The repeat-count budget (:mod:`.budget`) refuses the patterns whose automata
are known to be large, but it reads counts only: a repeat spelled out by hand after an
unbounded one (``.*a........b``) can still take seconds. So no row builds its automaton
itself: the request's pre-forward asks :class:`Automata` for each pattern's (one build
per distinct pattern, on a thread of its own, kept for later requests), and waits for
them before its rows join a batch (``ForwardPlan.add_wait``). A build that takes longer
than :data:`BUILD_WAIT_S` refuses the request with a 400; it finishes in the background
and serves the next request that sends the pattern.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from millm_core.api import AppContext, StashKey

from .schema import ResponseFormatUnsupported

log = structlog.get_logger("millm.structured")

BUILD_WAIT_S = 10.0
"""How long a request waits for its patterns' automata before it is refused."""
MAX_KEPT = 256
"""Automata kept for later requests; the least recently asked for is dropped first."""

AUTOMATA = StashKey["Automata"]("structured.automata")


def _build(pattern: str) -> Any:
    from lmformatenforcer import RegexParser  # imported on the build thread, not with the plugin

    from .constraint import parser_config

    return RegexParser(pattern, parser_config()).context


class Automata:
    """Each pattern's automaton (lm-format-enforcer's ``RegexParser`` context: immutable
    once built apart from a cache of allowed characters per state, so every row may share
    it), built once on a thread of its own. Asked for on the event loop only."""

    def __init__(self) -> None:
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="millm-constraint-automata")
        self._built: OrderedDict[str, Future[Any]] = OrderedDict()

    def future(self, pattern: str) -> Future[Any]:
        """``pattern``'s automaton, building it if nobody asked for it yet (a failed build
        is kept: the pattern fails again at once)."""
        future = self._built.get(pattern)
        if future is None:
            future = self._builder.submit(_build, pattern)
            self._built[pattern] = future
            while len(self._built) > MAX_KEPT:
                oldest = next(iter(self._built))
                if not self._built[oldest].done():
                    break  # never drop a build under way (it would be started again)
                del self._built[oldest]
        else:
            self._built.move_to_end(pattern)
        return future

    def wait(self, patterns: Iterable[str], into: dict[str, Any], param: str) -> Callable[[], Awaitable[None]]:
        """A wait for ``ForwardPlan.add_wait``: every pattern's automaton into ``into``
        (for the rows' parsers), or :class:`~.schema.ResponseFormatUnsupported` (``param``)
        for a pattern that cannot be compiled or takes more than :data:`BUILD_WAIT_S` to."""
        futures = {pattern: self.future(pattern) for pattern in sorted(patterns)}

        async def built() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BUILD_WAIT_S
            for pattern, future in futures.items():
                try:
                    # shielded: a request that stops waiting leaves the build to finish for the next
                    into[pattern] = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    log.warning("pattern_automaton_slow", pattern=pattern[:200], waited_s=BUILD_WAIT_S)
                    raise ResponseFormatUnsupported(
                        f"the automaton for pattern {pattern!r} takes more than {BUILD_WAIT_S:g} s to build; write the pattern with fewer "
                        "states (a repeat written out character by character after .* or + multiplies them)",
                        param=param,
                    ) from None
                except Exception as exc:  # noqa: BLE001 - the library's parse error, whatever its type
                    raise ResponseFormatUnsupported(f"pattern {pattern!r} cannot be compiled ({exc})", param=param) from None

        return built

    def shutdown(self) -> None:
        """Stop the build thread (a build under way is left to finish on its own)."""
        self._builder.shutdown(wait=False, cancel_futures=True)


def automata(app: AppContext) -> Automata:
    """The app's :class:`Automata` (made on first use)."""
    return app.stash.setdefault(AUTOMATA, Automata)
