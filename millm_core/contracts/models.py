"""``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from typing import Literal

import msgspec


class MillmModelDetails(msgspec.Struct, kw_only=True):
    """millm's own description of a served model. Unknown values are ``"unrecorded"``."""

    engine: str
    context_length: int
    d_model: int
    n_layers: int
    dtype: str
    revision: str
    quantization: str


class ModelCard(msgspec.Struct, kw_only=True):
    """The OpenAI model object plus a ``millm`` object."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    millm: MillmModelDetails


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
