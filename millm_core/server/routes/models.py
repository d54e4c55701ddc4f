"""``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ...codec import encode
from ...contracts.models import MillmModelDetails, ModelCard, ModelList
from ...errors import ModelNotFound
from ...registry import ServedModel
from .common import app_state


def card(model: ServedModel) -> ModelCard:
    info = model.info
    return ModelCard(
        id=info.served_name,
        created=info.created,
        owned_by=info.owned_by,
        millm=MillmModelDetails(
            engine=info.engine,
            context_length=info.context_length,
            d_model=info.d_model,
            n_layers=info.n_layers,
            dtype=info.dtype,
            revision=info.revision,
            quantization=info.quantization,
        ),
    )


async def list_models(request: Request) -> Response:
    state = app_state(request)
    locked = state.lifecycle.locked  # a locked server lists its one model
    return Response(
        encode(ModelList(data=[card(m) for m in state.models if locked in (None, m.info.served_name)])), media_type="application/json"
    )


async def get_model(request: Request) -> Response:
    state = app_state(request)
    name = request.path_params["model_id"]
    model = state.models.get(name)
    if model is None:
        raise ModelNotFound(f"The model '{name}' does not exist on this server", param="model")
    return Response(encode(card(model)), media_type="application/json")
