"""What a schema may ask of the constraint's automata before any row runs.

A ``pattern`` (and the pythonic call pattern) becomes a finite automaton whose size grows
with the pattern's repeat counts (``[a-z]{0,20000}`` takes minutes to build). It is built
off the model thread, in a process of its own (:mod:`.automata`), but a build still costs
a core and keeps the request (and new patterns after it) waiting; repeat counts are
therefore bounded at validation, where a request is still cheap to refuse.
"""

from __future__ import annotations

import re
import re._parser as sre  # the stdlib's own regex parser: repeats as the engine reads them
from dataclasses import dataclass
from typing import Any

MAX_REPEAT = 256
# Beside an unbounded repeat (``*``, ``+``, ``{n,}``), a bounded one multiplies the
# deterministic automaton's states: ``.*a.{12}b`` takes 15 s to build here, ``.{8}`` 0.1 s.
MAX_REPEAT_BESIDE_UNBOUNDED = 8
# The pattern written out with every bounded repeat expanded (``(ab){90}`` is 180 items,
# nested repeats multiply): the automaton has about that many states. 1,600 is two
# 256-character strings of a forced pythonic call (0.4 s to build here); 4 of them, 3,100
# states, took 1.4 s, and nested repeats minutes.
MAX_EXPANDED = 1600


@dataclass
class _Cost:
    unbounded: int = 0  # how many unbounded repeats
    widest: int = 0  # the largest bounded repeat count
    widest_text: str = ""
    widest_open: int = 0  # the largest n of an open repeat {n,}
    widest_open_text: str = ""


def _cost(items: Any, cost: _Cost) -> int:
    """The expanded size of parsed ``items``; records repeats in ``cost``."""
    size = 0
    for op, arg in items:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
            low, high, sub = arg
            inner = _cost(sub, cost)
            if high is sre.MAXREPEAT or high == sre.MAXREPEAT:
                cost.unbounded += 1
                size += inner * max(low, 1)
                if low > cost.widest_open:  # {n,}: n copies, then a loop
                    cost.widest_open, cost.widest_open_text = low, f"{{{low},}}"
            else:
                if high > cost.widest:
                    cost.widest, cost.widest_text = high, f"{{{low},{high}}}" if low != high else f"{{{high}}}"
                size += inner * max(high, 1)
        elif op is sre.SUBPATTERN:
            size += _cost(arg[-1], cost)
        elif op is sre.BRANCH:
            size += sum(_cost(branch, cost) for branch in arg[1])
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            size += _cost(arg[1], cost)
        else:
            size += 1
    return size


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is too costly to compile (None: it is not). Repeats are read by
    Python's own regex parser, so nested repeats, ``{,n}`` and escaped backslashes count as
    the engine reads them."""
    try:
        parsed = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError):  # a syntax Python's parser lacks: count as written
        return _written_problem(pattern)
    cost = _Cost()
    expanded = _cost(list(parsed), cost)
    for count, text in ((cost.widest, cost.widest_text), (cost.widest_open, cost.widest_open_text)):
        if count > MAX_REPEAT:
            return f"pattern repeat count {text} exceeds {MAX_REPEAT}"
    if cost.unbounded and cost.widest > MAX_REPEAT_BESIDE_UNBOUNDED:
        return f"pattern repeat count {cost.widest_text} beside an unbounded repeat exceeds {MAX_REPEAT_BESIDE_UNBOUNDED}"
    if cost.unbounded > 1 and cost.widest_open > MAX_REPEAT_BESIDE_UNBOUNDED:  # ``^.{12,}$`` alone is cheap
        return f"pattern repeat count {cost.widest_open_text} beside another unbounded repeat exceeds {MAX_REPEAT_BESIDE_UNBOUNDED}"
    if expanded > MAX_EXPANDED:
        return f"the pattern written out with its repeats expanded has {expanded} items, more than {MAX_EXPANDED}"
    return None


_REPEAT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_UNBOUNDED = re.compile(r"[*+]|\{\d+,\}")


def _written_problem(pattern: str) -> str | None:
    """The repeat rules over the pattern's text, for a pattern Python's parser cannot
    read (every ``{…}`` counts, escaped or not: refusing too much is the safe side)."""
    unbounded = bool(_UNBOUNDED.search(pattern))
    for match in _REPEAT.finditer(pattern):
        low, comma, high = match.groups()
        counts = [int(c) for c in (low, high) if c]
        if any(c > MAX_REPEAT for c in counts):
            return f"pattern repeat count {match.group(0)} exceeds {MAX_REPEAT}"
        if unbounded and (not comma or high) and counts and max(counts) > MAX_REPEAT_BESIDE_UNBOUNDED:
            return f"pattern repeat count {match.group(0)} beside an unbounded repeat exceeds {MAX_REPEAT_BESIDE_UNBOUNDED}"
    return None


def schema_pattern_problems(schema: Any) -> list[tuple[str, str]]:
    """``(JSON pointer, reason)`` for every ``pattern`` in ``schema`` that is too costly,
    found without recursion."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                where = f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"
                if key == "pattern" and isinstance(value, str):
                    reason = pattern_problem(value)
                    if reason:
                        found.append((where, reason))
                stack.append((value, where))
        elif isinstance(node, list):
            stack.extend((value, f"{pointer}/{index}") for index, value in enumerate(node))
    return found
