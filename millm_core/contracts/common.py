"""Pieces shared by chat and text completions."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

# Ranges are the API contract; out-of-range values are refused, never clamped.
Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 = greedy")]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=0, le=2**32 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
# No upper bound here: --max-rows-per-request governs rows (400 too_many_rows).
ChoiceCount = Annotated[int, Meta(ge=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=1024)]
StopList = Annotated[list[StopString], Meta(max_length=4)]

FinishReason = Literal["stop", "length"]


class StreamOptions(msgspec.Struct, kw_only=True):
    """OpenAI ``stream_options``. Usage comes on the final chunk unless
    ``include_usage`` is ``false``."""

    include_usage: bool | None | UnsetType = UNSET


class SamplingFields(msgspec.Struct, kw_only=True):
    """OpenAI's sampling and length fields, common to chat and text completions.

    The core declares OpenAI's fields that some enabled plugin or the core itself
    always honours. Extensions (``top_k``, ``steering``, scoring fields, …) are declared by
    the plugins that own them and joined on at start-up
    (:mod:`millm_core.requestfields`); known output-changing fields that nothing declares
    are refused by name (:mod:`millm_core.contracts.known`).
    """

    model: str
    stream: bool | None | UnsetType = UNSET
    stream_options: StreamOptions | None | UnsetType = UNSET
    temperature: Temperature | None | UnsetType = UNSET
    top_p: TopP | None | UnsetType = UNSET
    n: ChoiceCount | None | UnsetType = UNSET
    max_tokens: PositiveInt | None | UnsetType = UNSET
    max_completion_tokens: PositiveInt | None | UnsetType = UNSET
    seed: Seed | None | UnsetType = UNSET
    stop: StopString | StopList | None | UnsetType = UNSET
    frequency_penalty: Penalty | None | UnsetType = UNSET
    presence_penalty: Penalty | None | UnsetType = UNSET
    # ``user`` is deliberately not declared: millm does not read it, so it is reported
    # in X-miLLM-Ignored-Fields like any other unread field.


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """OpenAI's breakdown of ``prompt_tokens``: ``cached_tokens`` is the part of the
    prompt the engine resumed from retained state (the KV cache of an earlier prompt
    sharing its prefix) instead of prefilling; 0 when none."""

    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request (all choices together)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Always present on chat and text completions, as OpenAI sends it.
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET
    # Breakdowns a plugin reports (for example ``reasoning_tokens``, ``rewound_tokens``,
    # both counted in ``completion_tokens``); absent when none does.
    completion_tokens_details: dict[str, int] | UnsetType = UNSET
