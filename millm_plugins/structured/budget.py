"""What a schema may ask of the constraint's automata before any row runs.

A ``pattern`` (and the pythonic call pattern) becomes a finite automaton when a row's
parser is built, on the model thread, between decode steps: its size grows with the
pattern's repeat counts (``[a-z]{0,20000}`` takes minutes), and every row in the batch
would wait. Repeat counts are therefore bounded at validation, where a request is still
cheap to refuse.
"""

from __future__ import annotations

import re
from typing import Any

MAX_REPEAT = 256
# Beside an unbounded repeat (``*``, ``+``, ``{n,}``), a bounded one multiplies the
# deterministic automaton's states: ``.*a.{12}b`` takes 15 s to build here, ``.{8}`` 0.1 s.
MAX_REPEAT_BESIDE_UNBOUNDED = 8
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:(,)(\d*))?\}")
_UNBOUNDED = re.compile(r"(?<!\\)[*+]|(?<!\\)\{\d+,\}")


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is too costly to compile (None: it is not)."""
    unbounded = bool(_UNBOUNDED.search(pattern))
    for match in _REPEAT.finditer(pattern):
        low, comma, high = match.groups()
        counts = [int(low)] + ([int(high)] if high else [])
        if any(c > MAX_REPEAT for c in counts):
            return f"pattern repeat count {match.group(0)} exceeds {MAX_REPEAT}"
        bounded = not comma or bool(high)
        if unbounded and bounded and max(counts) > MAX_REPEAT_BESIDE_UNBOUNDED:
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
