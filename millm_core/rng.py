"""Counter-based random numbers for sampling.

A row's draw is a pure function of ``(seed, stream, position, purpose)``: it does not
depend on which other rows shared the batch, on arrival order, or on any generator state
carried between steps. ``stream`` separates the rows of one request (its choices or
prompts) so that ``n`` seeded choices are not copies of each other.

The mixing function is SplitMix64 (Steele, Lea & Flood 2014) applied to a combination of
the counters; its output is turned into a float in [0, 1) from the top 53 bits.
"""

from __future__ import annotations

import secrets

_MASK = (1 << 64) - 1

PURPOSE_SAMPLE = 1
PURPOSE_FRESH_SEED = 2


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def draw_u64(seed: int, stream: int, position: int, purpose: int) -> int:
    """A 64-bit value determined by the four counters alone."""
    h = _splitmix64(seed & _MASK)
    h = _splitmix64(h ^ (stream & _MASK))
    h = _splitmix64(h ^ (position & _MASK))
    return _splitmix64(h ^ (purpose & _MASK))


def uniform(seed: int, stream: int, position: int, purpose: int = PURPOSE_SAMPLE) -> float:
    """A float in [0, 1) determined by the four counters alone. Engines draw a row's
    token with ``uniform(row.sampling.seed, row.sampling.stream, position)`` where
    ``position`` is the index of the token being drawn in the row's whole sequence
    (prompt length + tokens generated so far), so the draw never depends on the batch."""
    return (draw_u64(seed, stream, position, purpose) >> 11) * (1.0 / (1 << 53))


def fresh_seed() -> int:
    """A seed for a request that sent none: 64 bits from the operating system's CSPRNG.
    Never derived from anything the client sends (an ``X-Request-Id`` replayed twice must
    not replay the sample), and never reported as the client's seed."""
    return secrets.randbits(64)
