"""The scoring plugin's request fields, and the wire Structs of scoring responses
(OpenAI's legacy and chat logprobs shapes)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from millm_core.api import GENERATION_ENDPOINTS, Capability, RequestField, Usage

OWNER = "scoring"
SCORING_MODE = "scoring mode"

LOGPROBS: RequestField[bool | int] = RequestField(
    "logprobs", bool | int, GENERATION_ENDPOINTS, owner=OWNER, neutral=lambda v: v is False, requires=Capability.SCORING,
    condition=SCORING_MODE, description="scoring mode: true on chat, the number of alternatives (0-20) on completions",
)  # fmt: skip
TOP_LOGPROBS: RequestField[int] = RequestField(
    "top_logprobs", int, ("chat.completions",), owner=OWNER, requires=Capability.SCORING,
    condition="with logprobs: true", description="alternatives to list (0-20) beside the scored token",
)  # fmt: skip
ALLOWED_TOKEN_IDS: RequestField[list[int]] = RequestField(
    "allowed_token_ids", list[int], GENERATION_ENDPOINTS, owner=OWNER, requires=Capability.SCORING,
    condition=SCORING_MODE, description="scoring mode: rank only these token ids",
)  # fmt: skip
TOKENS_AS_IDS: RequestField[bool] = RequestField(
    "return_tokens_as_token_ids", bool, GENERATION_ENDPOINTS, owner=OWNER, neutral=lambda v: v is False,
    requires=Capability.SCORING, condition=SCORING_MODE, description='name tokens as "token_id:<id>"',
)  # fmt: skip
Precision = Literal["native", "float32"]
PRECISION: RequestField[Precision] = RequestField(
    "scoring_precision", Precision, ("completions",), owner=OWNER, neutral=lambda v: v == "native",
    requires=Capability.SCORING, condition=SCORING_MODE, description="float32: score on a temporary float32 copy of the model",
)  # fmt: skip
FIELDS: tuple[RequestField[Any], ...] = (LOGPROBS, TOP_LOGPROBS, ALLOWED_TOKEN_IDS, TOKENS_AS_IDS, PRECISION)


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy shape, one entry per scored position (here: one)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionScoringChoice(msgspec.Struct, kw_only=True):
    """One scored prompt of a text completion in scoring mode: ``text`` is its most probable allowed next token. ``logprobs``
    (the legacy shape) only when the request sent ``logprobs``; ``finish_reason`` is always ``length``."""

    index: int
    text: str
    finish_reason: Literal["length"] = "length"
    logprobs: CompletionLogprobs | None = None


class CompletionScoringResponse(msgspec.Struct, kw_only=True):
    """A scored text completion: ``text`` is the most probable allowed next token."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionScoringChoice]
    usage: Usage
    scoring_precision: Literal["native", "float32"] | UnsetType = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    """One alternative in a chat scoring choice's ``top_logprobs``: the token (its text, or ``token_id:<id>``), its
    log-probability and the UTF-8 bytes of its text."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    """The scored next token of a chat scoring choice: the token (its text, or ``token_id:<id>``), its log-probability, the
    UTF-8 bytes of its text, and the alternatives ``top_logprobs`` asked for."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's chat ``logprobs`` object of a scoring choice: ``content`` has one entry, the scored next position."""

    content: list[TokenLogprob]


class ScoredMessage(msgspec.Struct, kw_only=True):
    """The message of a chat scoring choice: ``content`` is the text of the most probable allowed next token (nothing is generated)."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatScoringChoice(msgspec.Struct, kw_only=True):
    """One scored conversation of a chat completion in scoring mode (``messages``, then each of ``extra_messages``).
    ``logprobs`` only with ``logprobs: true``; ``finish_reason`` is always ``length``."""

    index: int
    message: ScoredMessage
    finish_reason: Literal["length"] = "length"
    logprobs: ChatLogprobs | None = None


class ChatScoringResponse(msgspec.Struct, kw_only=True):
    """A scored chat: ``content`` is the most probable allowed next token."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatScoringChoice]
    usage: Usage
