"""The intensity dial λ: ``steering_intensity`` on a request and a cluster's stored dial.

A request's λ is a number in [0, 2] or ``"off"`` / ``"min"`` / ``"max"``. ``"off"`` and 0
turn steering off for the request. ``"min"`` / ``"max"`` are the base's declared
``intensity_range`` intersected with the [0, 2] envelope; without a declared range they are
the configured ``cluster_intensity_min`` / ``cluster_intensity_max``. A number is capped at
that maximum; a number below the floor is honoured (dialing down toward off always is).
The resolved λ is what the response reports, so a cap is never silent.
"""

from __future__ import annotations

import math
from typing import Any

from millm_core.api import Problem

ENVELOPE = (0.0, 2.0)
SYMBOLS = ("off", "min", "max")

Intensity = float | str  # a validated request value: a number in the envelope, or a symbol


def parse(value: Any) -> tuple[Intensity | None, list[Problem]]:
    """The request's ``steering_intensity``, or the problem with it."""
    low, high = ENVELOPE
    if isinstance(value, str):
        if value in SYMBOLS:
            return value, []
        return None, [Problem(f"steering_intensity must be a number in [{low}, {high}] or one of {', '.join(SYMBOLS)}; got {value!r}", param="steering_intensity")]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        return None, [Problem(f"steering_intensity must be a number in [{low}, {high}] or one of {', '.join(SYMBOLS)}; got {value!r}", param="steering_intensity")]
    return float(value), []


def is_off(value: Intensity) -> bool:
    return value == "off" or (not isinstance(value, str) and value == 0.0)


def bounds(declared: tuple[float, float] | None, floor: float, ceiling: float) -> tuple[float, float]:
    """The dial's [min, max] for a base: its declared range, else the configured one, each
    intersected with the envelope."""
    low, high = declared if declared is not None else (floor, ceiling)
    low, high = max(low, ENVELOPE[0]), min(high, ENVELOPE[1])
    return min(low, high), high


def resolve(value: Intensity, declared: tuple[float, float] | None, floor: float, ceiling: float) -> float:
    """The λ a request's dial value means for a base with ``declared`` range."""
    if is_off(value):
        return 0.0
    low, high = bounds(declared, floor, ceiling)
    if value == "min":
        return low
    if value == "max":
        return high
    assert isinstance(value, float)
    return min(value, high)


def clamped_bounds(declared: tuple[float, float] | None, floor: float, ceiling: float) -> tuple[float, float]:
    """The dial's [min, max] under the circuit rule: the declared range intersected with the
    configured [floor, ceiling] (and the envelope); without a declared range, that
    configured range."""
    if declared is None:
        return bounds(None, floor, ceiling)
    return bounds((max(declared[0], floor), min(declared[1], ceiling)), floor, ceiling)


def resolve_clamped(value: Intensity, declared: tuple[float, float] | None, floor: float, ceiling: float) -> float:
    """The λ a dial value means under the circuit rule: clamped at *both* ends into
    :func:`clamped_bounds`, so a number below the floor resolves to the floor; only an
    exact 0 or ``"off"`` is honoured below it. With no declared range and a floor of 0,
    ``"min"`` is 0, the same as ``"off"``."""
    if is_off(value):
        return 0.0
    low, high = clamped_bounds(declared, floor, ceiling)
    if value == "min":
        return low
    if value == "max":
        return high
    assert isinstance(value, float)
    return min(max(value, low), high)
