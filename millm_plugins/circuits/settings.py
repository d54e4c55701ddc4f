"""The circuits plugin's settings: the dial's configured envelope and the size limits of a
circuit-definition document (each a ``millm serve --<name>`` flag and a ``MILLM_<NAME>``
variable)."""

from __future__ import annotations

from dataclasses import dataclass

from millm_core.api import PluginSetting, Settings


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 2.0:
        raise ValueError("must be in [0, 2]")
    return number


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


INTENSITY_MIN = PluginSetting(
    "circuit_intensity_min",
    0.0,
    "the circuit dial's floor: a request's λ is clamped up to it (only an exact 0 / off goes below)",
    _fraction,
)
INTENSITY_MAX = PluginSetting("circuit_intensity_max", 2.0, "the circuit dial's ceiling: a request's λ is clamped down to it", _fraction)
MAX_LAYERS = PluginSetting("circuit_max_layers", 8, "the most layers (SAEs) one circuit may span", _positive)
MAX_MEMBERS = PluginSetting(
    "circuit_max_members_per_layer", 64, "the most members one circuit may have at one layer (clusters expanded)", _positive
)
MAX_EDGES = PluginSetting("circuit_max_edges", 256, "the most edges one circuit-definition document may carry", _positive)

ALL: tuple[PluginSetting[float] | PluginSetting[int], ...] = (INTENSITY_MIN, INTENSITY_MAX, MAX_LAYERS, MAX_MEMBERS, MAX_EDGES)


@dataclass(frozen=True)
class Limits:
    """The size limits an imported document is checked against."""

    layers: int
    members_per_layer: int
    edges: int


@dataclass(frozen=True)
class Envelope:
    """The configured range a circuit's λ is clamped into (with its declared range)."""

    floor: float
    ceiling: float


def limits_of(settings: Settings) -> Limits:
    return Limits(
        layers=int(MAX_LAYERS.get(settings)), members_per_layer=int(MAX_MEMBERS.get(settings)), edges=int(MAX_EDGES.get(settings))
    )


def envelope_of(settings: Settings) -> Envelope:
    return Envelope(floor=float(INTENSITY_MIN.get(settings)), ceiling=float(INTENSITY_MAX.get(settings)))
