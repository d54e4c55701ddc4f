"""``X-miLLM-Probe-Verdicts``: the results of a non-streamed response as an RFC 8941 List,
one member per probe, window (and choice, when the request has several rows), in the
body's order.

Each member is the probe's name as a String, with parameters in this order (``?``: only
when it applies): ``id`` (String), ``window`` (Token), ``outcome`` (Token), ``reason``
(Token), ``verdict``? (Token), ``score``? (Decimal, rounded to 3 places; left out past
RFC 8941's 12 integer digits), ``threshold``? (Decimal, the same way), ``choice``?
(Integer). For example::

    "honesty";id="honesty-1f2e3d4c";window=response;outcome=scored;reason=ok;verdict=flagged;score=0.912;threshold=0.5

The value is at most ``MAX_BYTES`` (4 KiB): when the members do not fit, the first ones
that do are sent, then a Token member ``omitted`` whose ``count`` says how many were left
out (``omitted;count=12``). The body's ``millm_probe_verdicts`` is always complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from .results import ProbeResult

NAME = "X-miLLM-Probe-Verdicts"
MAX_BYTES = 4096
_MAX_DECIMAL = 1e12


def sf_string(text: str) -> str:
    """An sf-string; characters outside printable ASCII are percent-encoded (and so is ``%``)."""
    out: list[str] = []
    for ch in text:
        if 0x20 <= ord(ch) <= 0x7E and ch != "%":
            out.append("\\" + ch if ch in '"\\' else ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return '"' + "".join(out) + '"'


def sf_decimal(value: float) -> str | None:
    """An sf-decimal rounded to 3 fractional digits, or None when it has no such form."""
    rounded = round(value, 3)
    if not abs(rounded) < _MAX_DECIMAL:
        return None
    text = f"{rounded:.3f}".rstrip("0")
    text = text + "0" if text.endswith(".") else text
    return "0.0" if text in ("-0.0", "-0.") else text


def member(result: ProbeResult, with_choice: bool) -> str:
    params = [f"id={sf_string(result.probe.id)}", f"window={result.window}", f"outcome={result.outcome}", f"reason={result.reason}"]
    if result.verdict is not None:
        params.append(f"verdict={result.verdict}")
    if result.score is not None and (score := sf_decimal(result.score)) is not None:
        params.append(f"score={score}")
    if (threshold := sf_decimal(result.threshold)) is not None:
        params.append(f"threshold={threshold}")
    if with_choice and result.served.choice is not None:
        params.append(f"choice={result.served.choice}")
    return ";".join([sf_string(result.name), *params])


def value(results: Sequence[ProbeResult], limit: int = MAX_BYTES) -> str:
    """The header's value for ``results`` (already in order), at most ``limit`` bytes:
    past it, the members that fit and ``omitted;count=N``."""
    with_choice = len({r.served.choice for r in results}) > 1
    members = [member(r, with_choice) for r in results]  # printable ASCII: a character is a byte
    whole = ", ".join(members)
    if len(whole) <= limit:
        return whole
    kept, size = 0, 0
    for text in members:
        grown = size + (2 if kept else 0) + len(text)
        tail = f"omitted;count={len(members) - kept - 1}"
        if grown + 2 + len(tail) > limit:
            break
        kept, size = kept + 1, grown
    tail = f"omitted;count={len(members) - kept}"
    return ", ".join([*members[:kept], tail])
