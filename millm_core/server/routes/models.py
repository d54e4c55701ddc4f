"""``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ...codec import encode
from ...contracts.models import MillmModelDetails, ModelCard, ModelList
from ...errors import ModelNotFound
from ...lifecycle import ModelEntry
from ...registry import ServedModel
from ..state import AppState, app_state
from .lifecycle import catalog


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


def unloaded_card(entry: ModelEntry) -> ModelCard:
    """The card of a model that is not loaded: its state and, when known, its engine."""
    return ModelCard(
        id=entry.id,
        created=0,
        owned_by="millm",
        millm=MillmModelDetails(
            state=entry.state,
            engine=entry.engine,
            context_length=None,
            d_model=None,
            n_layers=None,
            dtype=None,
            revision=None,
            quantization=None,
        ),
    )


async def cards(state: AppState) -> list[ModelCard]:
    """The models OpenAI clients may name: the loaded ones, then (``--auto-load``) every
    one a request would load; only the locked one while a model is locked."""
    locked = state.lifecycle.locked
    loaded = [m for m in state.models if locked in (None, m.info.served_name)]
    listed = [card(m) for m in loaded]
    if locked is None and state.settings.auto_load:
        for entry in (await catalog(state)).data:
            if state.models.get(entry.id) is None:
                listed.append(unloaded_card(entry))
    for model_card in listed:
        if model_card.millm.state == "loaded" and model_card.id in state.lifecycle.unloading:
            model_card.millm.state = "unloading"
    return listed


async def list_models(request: Request) -> Response:
    return Response(encode(ModelList(data=await cards(app_state(request)))), media_type="application/json")


async def get_model(request: Request) -> Response:
    state = app_state(request)
    name = request.path_params["model_id"]
    found = next((c for c in await cards(state) if c.id == name), None)
    if found is None:
        raise ModelNotFound(f"The model '{name}' does not exist on this server", param="model")
    return Response(encode(found), media_type="application/json")
