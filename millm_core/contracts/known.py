"""Request fields known to change the output, that the core does not declare itself.

OpenAI's and the API contract's (the spec's extensions) fields. Each belongs to a plugin
that declares it when enabled (``millm_register_request_fields``); when none does, a body
that sends one with a non-neutral value is refused with ``400 field_not_honoured`` naming
it, and a neutral value ("ask for what the server does anyway") is accepted silently. A
field in neither the contract nor this table cannot change the output and is reported in
``X-miLLM-Ignored-Fields``.

This is protocol knowledge (names and their neutral values), not feature logic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _never(_value: Any) -> bool:
    return False


def _number(expected: float) -> Callable[[Any], bool]:
    """Neutral when the value is this number (a JSON boolean is not a number)."""
    return lambda v: not isinstance(v, bool) and isinstance(v, int | float) and v == expected


# field -> which sent values are neutral (null is always neutral).
KNOWN_FIELDS: Mapping[str, Callable[[Any], bool]] = {
    # OpenAI
    "logprobs": lambda v: v is False,
    "top_logprobs": _never,
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: v == {"type": "text"},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: v is True,
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "reasoning_effort": _never,
    "prediction": _never,
    "audio": _never,
    "modalities": lambda v: v == ["text"],
    "echo": lambda v: v is False,
    "suffix": _never,
    "best_of": _number(1),
    # OpenAI's generation fields, where an endpoint does not declare them (embeddings)
    "seed": _never,
    "n": _number(1),
    "max_tokens": _never,
    "max_completion_tokens": _never,
    # the API contract's extensions, and vLLM's that clients commonly send
    "top_k": _never,
    "min_p": _number(0),
    "repetition_penalty": _number(1),
    "min_tokens": _number(0),
    "ignore_eos": lambda v: v is False,
    "allowed_token_ids": _never,
    "return_tokens_as_token_ids": lambda v: v is False,
    "scoring_precision": lambda v: v == "native",
    "steering": _never,
    "profile": _never,
    "steering_intensity": _never,
    "circuit": _never,
    "return_sae_activations": _never,
    "probes": _never,
    "thinking_budget": _never,
    "enable_thinking": _never,
    "class": lambda v: v == "interactive",
    "pooling": lambda v: v == "mean",
    "normalize": lambda v: v is False,
    "dimensions": _never,
}


def is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` for the known field ``name`` asks for nothing."""
    if value is None:
        return True
    check = KNOWN_FIELDS.get(name)
    return bool(check and check(value))
