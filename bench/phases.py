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
  to the first stream's last chunk, over that window: the aggregate rate while every
  stream is decoding.

Content chunks stand for tokens: both servers send one per detokenised piece of text, so
a token whose text is held back (part of a multi-byte character) arrives with the next.
"""

from __future__ import annotations

import time


def content_chunk(chunk: dict[str, object]) -> bool:
    """Whether a parsed streamed chat chunk carries text (role and empty chunks do not)."""
    for choice in chunk.get("choices") or []:  # type: ignore[attr-defined]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            return True
    return False


def now() -> float:
    return time.perf_counter()


def phases(arrivals: list[list[float]], started: float) -> dict[str, float]:
    """``all_first_s`` and ``steady_tok_s`` (see the module) of streams whose content
    chunks arrived at ``arrivals[i]`` (perf_counter times), all sent at ``started``. A
    stream without content makes both NaN; a window too short to hold a chunk makes the
    rate NaN."""
    if not arrivals or any(not times for times in arrivals):
        return {"all_first_s": float("nan"), "steady_tok_s": float("nan")}
    all_first = max(times[0] for times in arrivals)
    first_end = min(times[-1] for times in arrivals)
    inside = sum(1 for times in arrivals for t in times if all_first < t <= first_end)
    window = first_end - all_first
    return {"all_first_s": all_first - started, "steady_tok_s": inside / window if window > 0 and inside else float("nan")}
