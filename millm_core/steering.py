"""The steering-set model: what a row is steered with, its canonical form and its hash.

An applied set is ``index -> strength`` for one SAE as the hook reads it: each strength
clamped to ±200 (``STRENGTH_LIMIT``) and every zero removed (−0.0 is a zero). Its canonical
form is UTF-8 lines, each ended by one LF:

    millm.steering-set/v1
    sae=<sae_id>
    <index>:<16 lowercase hex digits of the strength's IEEE-754 binary64, big-endian>

one line per applied feature, ascending index. The hash is ``"sha256:"`` and the SHA-256
of that text in lowercase hex. It covers the SAE and the features only: the layer travels
beside it. Bits rather than decimal text, because shortest-decimal formatting differs
between languages.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping

import msgspec

STRENGTH_LIMIT = 200.0
CANONICAL_HEADER = "millm.steering-set/v1"


def clamp(strength: float) -> float:
    return max(-STRENGTH_LIMIT, min(STRENGTH_LIMIT, float(strength)))


class AppliedSet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The features one SAE actually applies to a row: clamped, zeros dropped.
    ``clamped`` counts the features whose value the clamp changed (it is reported)."""

    sae_id: str
    features: tuple[tuple[int, float], ...]
    clamped: int = 0

    @classmethod
    def build(cls, sae_id: str, features: Iterable[tuple[int, float]] | Mapping[int, float]) -> AppliedSet:
        items = features.items() if isinstance(features, Mapping) else features
        applied: dict[int, float] = {}
        clamped = 0
        for index, strength in items:
            value = float(strength)
            if math.isnan(value):  # ±inf (an overflowed stored × λ) clamps like any value
                raise ValueError(f"feature {index}: strength is NaN")
            bounded = clamp(value)
            if bounded != 0.0:
                clamped += bounded != value
                applied[int(index)] = bounded
        return cls(sae_id=sae_id, features=tuple(sorted(applied.items())), clamped=clamped)

    def canonical_form(self) -> str:
        lines = [CANONICAL_HEADER, f"sae={self.sae_id}"]
        lines += [f"{index}:{struct.pack('>d', value).hex()}" for index, value in self.features]
        return "".join(line + "\n" for line in lines)

    @property
    def hash(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical_form().encode("utf-8")).hexdigest()
