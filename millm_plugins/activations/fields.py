"""The ``return_sae_activations`` request field and the plugin's limits."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from millm_core.api import GENERATION_ENDPOINTS, Capability, PluginSetting, RequestField

NAME = "activations"

MAX_TOP_K = PluginSetting("sae_activations_max_top_k", 64, "the largest top_k return_sae_activations accepts", int)
MAX_ENTRIES = PluginSetting(
    "sae_activations_max_entries", 65_536, "the most (position, feature) entries one return_sae_activations request may ask for", int
)

NonNegative = Annotated[int, Meta(ge=0)]


class PositionRange(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Absolute positions ``start`` (inclusive) to ``end`` (exclusive) over
    prompt-then-generated tokens."""

    start: NonNegative
    end: NonNegative


Positions = Literal["last", "prompt", "completion", "all"] | PositionRange


class ReturnSAEActivations(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a request asks to read: an attached SAE (``sae_id``; optional when exactly
    one is attached; ``layer`` picks among several attachments), the candidate ``features`` (default: all), the ``top_k`` largest per
    position, which ``positions`` and the ``read_point`` (before or after this layer's
    steering delta)."""

    sae_id: str | None = None
    layer: Annotated[int, Meta(ge=0)] | None = None  # beyond the spec: picks one of an SAE's several attachments
    features: Annotated[list[NonNegative], Meta(min_length=1)] | None = None  # [] would ask for nothing
    top_k: Annotated[int, Meta(ge=1)] = 8
    positions: Positions = "completion"
    read_point: Literal["post_steering", "pre_steering"] = "post_steering"


FIELD: RequestField[ReturnSAEActivations] = RequestField(
    "return_sae_activations", ReturnSAEActivations, GENERATION_ENDPOINTS, owner=NAME, requires=Capability.TAPS,
    description="return this request's activations of an attached SAE under millm.sae_activations",
)  # fmt: skip
