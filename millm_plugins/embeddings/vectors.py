"""Engine-agnostic embedding rules: input limits, context checks, normalisation, encoding."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence

from millm_core.api import ContextLengthExceeded, InvalidRequest, MillmError

LISTED_OVER_LIMIT = 16


def check_inputs(texts: Sequence[str], single: bool, max_inputs: int) -> None:
    """Refuse empty inputs and more than ``max_inputs`` strings."""
    if not texts:
        raise InvalidRequest("input is empty; send a string or a non-empty list of strings", param="input")
    if len(texts) > max_inputs:
        raise InvalidRequest(
            f"input has {len(texts)} strings; this server embeds at most {max_inputs} per request "
            "(EMBEDDINGS_MAX_INPUTS); split the request",
            param="input",
        )
    empty = [i for i, text in enumerate(texts) if text == ""]
    if empty:  # param is the field (as the contract says); the message names the indexes
        if single:
            raise InvalidRequest("input is an empty string; every input needs text", param="input")
        listed = ", ".join(str(i) for i in empty[:LISTED_OVER_LIMIT])
        raise InvalidRequest(f"input has empty strings at index {listed}; every input needs text", param="input")


def check_lengths(lengths: Sequence[int], limit: int, single: bool) -> None:
    """Refuse, naming every over-limit index (up to 16, then a count), inputs longer than
    ``limit`` tokens. Inputs are never truncated."""
    over = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if not over:
        return
    shown = ", ".join(f"input[{i}] has {n} tokens" for i, n in over[:LISTED_OVER_LIMIT])
    more = f", and {len(over) - LISTED_OVER_LIMIT} more" if len(over) > LISTED_OVER_LIMIT else ""
    raise ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens: {shown}{more}. Shorten or split the inputs.",
        param="input" if single else f"input[{over[0][0]}]",
    )


def finish_vector(vector: list[float], index: int, normalize: bool) -> list[float]:
    """Apply ``normalize`` and refuse non-finite or (when normalising) zero vectors."""
    if not all(math.isfinite(v) for v in vector):
        raise MillmError(f"the embedding of input[{index}] is not finite", code="embedding_vector_invalid", status=500)
    if not normalize:
        return vector
    norm = math.sqrt(math.fsum(v * v for v in vector))
    if norm == 0.0:
        raise MillmError(f"the embedding of input[{index}] has zero norm and cannot be normalised", code="embedding_vector_invalid", status=500)
    return [v / norm for v in vector]


def encode_base64(vector: Sequence[float]) -> str:
    """Little-endian float32, base64 — what OpenAI's ``encoding_format: base64`` returns."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
