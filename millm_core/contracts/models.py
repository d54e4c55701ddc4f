"""``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from typing import Literal

import msgspec


class MillmModelDetails(msgspec.Struct, kw_only=True):
    """millm's own description of a model. ``state``: ``loaded`` (it answers now),
    ``loading``, ``unloading``, or ``available`` (not loaded: a request naming it loads it,
    unless ``--auto-load false``). The other values describe a loaded model; a model that
    is not loaded has only ``engine`` (the engine that would load it, when known without
    loading) and ``null`` for the rest. Unknown values of a loaded model are
    ``"unrecorded"``."""

    state: Literal["loaded", "loading", "unloading", "available"] = "loaded"
    engine: str | None
    context_length: int | None
    d_model: int | None
    n_layers: int | None
    dtype: str | None
    revision: str | None
    quantization: str | None


class ModelCard(msgspec.Struct, kw_only=True):
    """The OpenAI model object plus a ``millm`` object."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    millm: MillmModelDetails


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``: the models a client may name (the loaded ones, then with ``--auto-load`` those a request would load;
    only the locked one while a model is locked)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
