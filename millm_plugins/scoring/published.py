"""``docs/schemas/millm-scoring-api-v1.json``: the scoring API's requests, responses and
refusal, generated from the Structs the code uses. ``python -m millm_plugins.scoring.published PATH``
writes it (``make schemas``); a test fails when the committed file drifts."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec

from millm_core.api import ErrorResponse, request_types_with

from .schema import FIELDS, ChatScoringResponse, CompletionScoringResponse

VERSION = "millm-scoring-api-v1"


def scoring_document() -> dict[str, Any]:
    # The request types of a scoring-only server (``--plugins scoring``).
    requests = request_types_with(FIELDS)
    CompletionRequest, ChatCompletionRequest = requests["completions"], requests["chat.completions"]  # noqa: N806
    types = [CompletionRequest, CompletionScoringResponse, ChatCompletionRequest, ChatScoringResponse, ErrorResponse]
    (completion_req, completion_resp, chat_req, chat_resp, error), defs = msgspec.json.schema_components(types)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": VERSION,
        "title": "millm scoring API (next-token log-probabilities)",
        "description": (
            "Scoring mode: logprobs or allowed_token_ids with max_tokens 1 and n 1. One forward pass per prompt, "
            "nothing generated. scoring_precision float32 runs the pass on a temporary float32 copy, or is refused "
            "with 409 scoring_precision_unavailable and the X-miLLM-Scoring-Precision-Reason header "
            "(model_not_float32_castable, memory, device, busy)."
        ),
        "endpoints": {
            "POST /v1/completions": {"request": completion_req, "response": completion_resp},
            "POST /v1/chat/completions": {"request": chat_req, "response": chat_resp},
        },
        "refusals": {
            "400": error,
            "409": {"allOf": [error], "description": "float32 cannot be served: code scoring_precision_unavailable, param scoring_precision"},
            "500": {"allOf": [error], "description": "non_finite_logits: NaN/+inf reaching the answer, or a reported token at -inf"},
        },
        "$defs": defs,
    }


def render() -> str:
    return json.dumps(scoring_document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised by `make schemas`
    from millm_core.api import configure_logging

    configure_logging("console", "warning")
    with open(sys.argv[1] if len(sys.argv) > 1 else f"docs/schemas/{VERSION}.json", "w") as fh:
        fh.write(render())
