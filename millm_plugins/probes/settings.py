"""The probes plugin's settings (each a ``millm serve --<name>`` flag and a
``MILLM_<NAME>`` variable)."""

from __future__ import annotations

from millm_core.api import PluginSetting


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def _tolerance(value: str) -> float:
    number = float(value)
    if not 0.0 < number < float("inf"):
        raise ValueError("must be a positive number")
    return number


MAX_ARMED = PluginSetting("probes_max_armed", 16, "the most probes armed at once (the arming gate 'limit')", _positive)
PARITY_TOLERANCE = PluginSetting(
    "probes_parity_tolerance", 1e-3,
    "the largest |score - expected| a probe's test vector may show when it is armed (a document may ask for less)", _tolerance,
)  # fmt: skip
EVENTS_MAX = PluginSetting("probes_events_max", 100_000, "the most probe results kept in the events log (the oldest go first)", _positive)
SCORE_MAX_INPUTS = PluginSetting("probes_score_max_inputs", 32, "the most inputs one POST /api/probes/score may send", _positive)
SCORE_MAX_TOKENS = PluginSetting(
    "probes_score_max_tokens", 8192, "the most tokens (over all inputs) one POST /api/probes/score may read", _positive
)

ALL = (MAX_ARMED, PARITY_TOLERANCE, EVENTS_MAX, SCORE_MAX_INPUTS, SCORE_MAX_TOKENS)
