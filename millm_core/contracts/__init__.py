"""msgspec Structs for every request, response, stream chunk and error on the wire.

Optional wire fields default to ``UNSET`` so that "not sent" and "sent as null" stay
distinguishable; ranges are part of the contract (``Meta``) and so appear in the
published schema.
"""

import msgspec

from ..context import Endpoint
from .chat import ChatCompletionRequest
from .completions import CompletionRequest
from .embeddings import EmbeddingRequest

# The request contract of each endpoint, as the policy table and the schemas see them.
ENDPOINT_CONTRACTS: dict[Endpoint, type[msgspec.Struct]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
}
