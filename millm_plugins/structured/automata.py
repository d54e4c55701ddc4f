"""The regex automata of constrained rows, built off the event loop and the model thread.

A ``pattern`` (in a schema, or a forced pythonic tool call) is constrained by a finite
automaton that lm-format-enforcer walks; ``interegular`` builds it from the pattern, in
pure Python. The repeat-count budget (:mod:`.budget`) refuses the patterns whose automata
are known to be large, but it reads counts only: a repeat spelled out by hand after an
unbounded one (``.*a........b``) can still take seconds, or years. So no row builds its
automaton itself: the request's pre-forward asks :class:`Automata` for each pattern's (one
build per distinct pattern, kept for later requests; at most :data:`PER_REQUEST` started by
one request, so that one request never fills the queue), and waits for them before its rows
join a batch (``ForwardPlan.add_wait``), at most :data:`BUILD_WAIT_S`. Builds run in a
child process (:mod:`.fsmbuild`), one at a time, each stopped after
:data:`BUILD_LIMIT_S`: a pattern whose build was stopped is refused from then on. A request
that stops waiting leaves its build to finish for the next request that sends the pattern.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from millm_core.api import AppContext, MillmError, RequestContext, ServiceUnavailable, StashKey

from .fsmbuild import Builder, BuilderUnavailable

log = structlog.get_logger("millm.structured")

BUILD_WAIT_S = 10.0
"""How long a request waits for its patterns' automata before it is refused."""
BUILD_LIMIT_S = 10.0
"""How long one build may take before it is stopped (the pattern is refused from then on)."""
MAX_KEPT = 256
"""Automata kept for later requests; the least recently asked for is dropped first."""
MAX_QUEUED = 8
"""Builds waiting or under way at most: a request with a new pattern past it gets a 503."""
PER_REQUEST = 4
"""Builds one request may start: a request with more new patterns starts this many and gets
a 503 to retry (the next try starts the next ones), so that no request fills the queue."""

AUTOMATA = StashKey["Automata"]("structured.automata")
STARTED = StashKey[list[int]]("structured.builds_started")
"""Builds a request has started (in its ``ctx.stash``: the structured-output and tools
plugins' patterns share one request's share)."""
Refusal = Callable[[str], MillmError]
"""Makes the error that refuses a request, from the reason (the pattern is named in it)."""


def _context(fsm: Any) -> Any:
    """lm-format-enforcer's regex context over a built automaton, as ``RegexParser(pattern,
    config)`` makes it (the parser's config setter derives the characters the automaton
    lumps together as "anything else")."""
    from lmformatenforcer import RegexParser  # imported on the build thread, not with the plugin

    from .constraint import parser_config

    context = RegexParser._Context()
    context.pattern = fsm
    context.state_character_cache = {}
    RegexParser(context).config = parser_config()
    return context


class Automata:
    """Each pattern's automaton (lm-format-enforcer's ``RegexParser`` context: immutable
    once built apart from a cache of allowed characters per state, so every row may share
    it), built once, from a thread of its own, in the build process. Asked for on the
    event loop only."""

    def __init__(self) -> None:
        self._builder = Builder()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="millm-constraint-automata")
        self._built: OrderedDict[str, Future[Any]] = OrderedDict()

    def _build(self, pattern: str) -> Any:
        context = _context(self._builder.build(pattern, BUILD_LIMIT_S))
        log.info("pattern_automaton_built", pattern=pattern[:200], states=len(context.pattern.states))
        return context

    def future(self, pattern: str) -> Future[Any]:
        """``pattern``'s automaton, building it if nobody asked for it yet (a failed build
        is kept: the pattern fails again at once, unless the build process was at fault).
        Raises :class:`~millm_core.api.ServiceUnavailable` while :data:`MAX_QUEUED` builds
        are waiting or under way."""
        future = self._built.get(pattern)
        if future is not None and future.done() and (future.cancelled() or isinstance(future.exception(), BuilderUnavailable)):
            del self._built[pattern]  # not the pattern's fault: build it again
            future = None
        if future is None:
            if sum(not kept.done() for kept in self._built.values()) >= MAX_QUEUED:
                raise ServiceUnavailable(
                    f"{MAX_QUEUED} regex patterns are being built into automata; retry in a few seconds", code="constraint_automata_busy"
                )
            future = self._thread.submit(self._build, pattern)
            self._built[pattern] = future
            if len(self._built) > MAX_KEPT:  # the least recently asked for that is built (never one under way)
                oldest = next((key for key, kept in self._built.items() if kept.done()), None)
                if oldest is not None:
                    del self._built[oldest]
        else:
            self._built.move_to_end(pattern)
        return future

    def wait(
        self, patterns: Iterable[str], into: dict[str, Any], refuse: Refusal, ctx: RequestContext | None = None
    ) -> Callable[[], Awaitable[None]]:
        """A wait for ``ForwardPlan.add_wait``: every pattern's automaton into ``into``
        (for the rows' parsers), or ``refuse(reason)`` raised for a pattern that cannot be
        compiled, whose build was stopped, or that takes more than :data:`BUILD_WAIT_S`.
        A request (``ctx``: every call for it counts together) with more than
        :data:`PER_REQUEST` patterns not asked for before starts that many builds and is
        refused with a 503 to retry."""
        ordered = sorted(patterns)
        new = [pattern for pattern in ordered if pattern not in self._built]
        started = ctx.stash.setdefault(STARTED, lambda: [0]) if ctx is not None else [0]
        share = max(0, PER_REQUEST - started[0])
        if len(new) > share:
            for pattern in new[:share]:
                self.future(pattern)
                started[0] += 1
            raise ServiceUnavailable(
                f"{len(new)} of this request's regex patterns have no automaton yet, and a request starts at most {PER_REQUEST} "
                "builds: retry in a few seconds (each try starts the next ones)",
                code="constraint_automata_busy",
            )
        started[0] += len(new)
        futures = {pattern: self.future(pattern) for pattern in ordered}

        async def built() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BUILD_WAIT_S
            for pattern, future in futures.items():
                try:
                    if future.done():
                        into[pattern] = future.result()
                        continue
                    # shielded: a request that stops waiting leaves the build to finish for the next
                    # (whose outcome is then nobody's here: read, so that asyncio does not log it)
                    wrapped = asyncio.wrap_future(future)
                    wrapped.add_done_callback(lambda done: done.cancelled() or done.exception())
                    into[pattern] = await asyncio.wait_for(asyncio.shield(wrapped), max(0.0, deadline - loop.time()))
                except BuilderUnavailable as exc:
                    log.error("pattern_automaton_unavailable", error=str(exc))
                    raise ServiceUnavailable(
                        "regex automata cannot be built here now (the build process failed; the server log says why); retry later",
                        code="constraint_automata_unavailable",
                    ) from None
                except TimeoutError:
                    log.warning("pattern_automaton_slow", pattern=pattern[:200], waited_s=BUILD_WAIT_S)
                    raise refuse(
                        f"the automaton for pattern {pattern!r} takes more than {BUILD_WAIT_S:g} s to build; write the pattern with fewer "
                        "states (a repeat written out character by character after .* or + multiplies them)"
                    ) from None
                except Exception as exc:  # noqa: BLE001 - the build's failure, whatever its type
                    raise refuse(f"pattern {pattern!r} cannot be constrained: {exc}") from None

        return built

    def shutdown(self) -> None:
        """Stop the build thread and its process (a build under way is abandoned)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._builder.close()


def automata(app: AppContext) -> Automata:
    """The app's :class:`Automata` (made on first use)."""
    return app.stash.setdefault(AUTOMATA, Automata)


def shutdown_automata(app: AppContext) -> None:
    """At shutdown (the structured and tools plugins both call it): stop the builds."""
    if AUTOMATA in app.stash:
        app.stash[AUTOMATA].shutdown()
