"""The evidence ladder: what a circuit's rung means, and the ``X-miLLM-Circuit-Rung`` value.

The phrase for each rung is fixed here, never composed per request, so that a circuit below
rung 2 is never described as causal. A circuit's rung is the minimum over its edges (a
circuit without edges has no evidence: rung 0); a response steered by several circuits
carries the lowest of their rungs.
"""

from __future__ import annotations

HEADER = "X-miLLM-Circuit-Rung"

# rung -> (language, meaning)
LADDER: dict[int, tuple[str, str]] = {
    0: ("associated", "Mined co-occurrence only — unvalidated"),
    1: ("suggested (attribution-supported)", "Attribution evidence, not causal"),
    2: ("causally validated (edge)", "Each edge causally validated"),
    3: ("faithfulness-tested (circuit)", "The whole circuit was faithfulness-tested"),
}
VALIDATED = 2  # the first rung that may be called causal: below it, activation needs an acknowledgement


def language(rung: int) -> str:
    """The ladder's phrase for ``rung``."""
    return LADDER[rung][0]


def header_value(rung: int) -> str:
    """``<rung>; language="<phrase>"``: an RFC 8941 Integer with one String parameter (the
    phrases are printable ASCII without quotes or backslashes, so they need no escaping)."""
    return f'{rung}; language="{language(rung)}"'
