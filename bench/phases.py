"""The two phases of concurrent streams started at once, from when each content chunk arrived.

An aggregate over a short run (tokens / wall time from the first send to the last finish)
mixes two things a batched server does very differently: bringing every stream in (each
prompt's prefill) and then decoding all of them together. It also depends on the texts:
a stream that stops early leaves the batch smaller for the rest of the run. To compare a
server's decoding with a batched decode ceiling (one call per step for every sequence),
the bench splits the run at two instants:

- ``all_first_s``: from the first send until every stream has its first content chunk
  (every prompt prefilled and its first token out);
- ``steady_tok_s``: content chunks of all streams that arrived after that instant and up
  to the first stream's last chunk, over that window (``steady_window_s``, holding
  ``steady_chunks``): the aggregate rate while every stream is decoding.

Content chunks stand for tokens: both servers send one per detokenised piece of text, so
a token whose text is held back (part of a multi-byte character) arrives with the next.
A stream that ends before the last one starts (a serial server) leaves no such window:
the rate is then NaN, and :func:`median` and :func:`jsonable` treat NaN as "no value".
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from typing import Any

NAN = float("nan")


def content_chunk(chunk: dict[str, Any]) -> bool:
    """Whether a parsed streamed chat chunk carries text (role and empty chunks do not)."""
    return any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or [])


def now() -> float:
    return time.perf_counter()


def phases(arrivals: list[list[float]], started: float) -> dict[str, float]:
    """``all_first_s``, ``steady_tok_s``, ``steady_window_s`` and ``steady_chunks`` (see
    the module) of streams whose content chunks arrived at ``arrivals[i]`` (perf_counter
    times), all sent at ``started``. A stream without content makes them all NaN; no window
    (a stream ended before another began) makes the steady values NaN."""
    if not arrivals or any(not times for times in arrivals):
        return {"all_first_s": NAN, "steady_tok_s": NAN, "steady_window_s": NAN, "steady_chunks": NAN}
    all_first = max(times[0] for times in arrivals)
    first_end = min(times[-1] for times in arrivals)
    inside = sum(1 for times in arrivals for t in times if all_first < t <= first_end)
    window = first_end - all_first
    if window <= 0 or not inside:
        return {"all_first_s": all_first - started, "steady_tok_s": NAN, "steady_window_s": NAN, "steady_chunks": NAN}
    return {"all_first_s": all_first - started, "steady_tok_s": inside / window, "steady_window_s": window, "steady_chunks": float(inside)}


def median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN; NaN when none are."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else NAN


def jsonable(value: Any) -> Any:
    """``value`` with every NaN float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def shown(value: float, fmt: str = ".1f") -> str:
    """A value for a printed line: "n/a" for NaN."""
    return "n/a" if math.isnan(value) else format(value, fmt)
