"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE
/v1/responses/{response_id}``, served as chat completions through the core's one request
pipeline, so every chat feature and extension works here too (steering, tools, structured
output, reasoning, lanes, …).

Stored responses (``previous_response_id``) live in the database, at most
``--responses-max-stored`` of them and ``--responses-max-stored-bytes`` bytes; reasoning
sent back encrypted
(``include: ["reasoning.encrypted_content"]``) is sealed with the key of
``--responses-key-file``, or with one generated once and kept in the database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from millm_core.api import AppContext, PluginSetting, RouteDoc, hookimpl

from .objects import DeletedResponse, ResponseObject
from .routes import STATE, ResponsesState, create_response, delete_response, get_response
from .schema import ResponsesRequest
from .sealing import Sealer, read_key_file, stored_key
from .storage import ResponseStore

NAME = "responses"


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


MAX_STORED = PluginSetting(
    "responses_max_stored", 1000, "responses kept for previous_response_id and GET /v1/responses/{id} (the oldest go first; 0 keeps none)", _count
)
MAX_STORED_BYTES = PluginSetting(
    "responses_max_stored_bytes",
    256 * 1024 * 1024,
    "bytes the stored responses may take in the database, their histories included (the oldest go first; 0 keeps none)",
    _count,
)
KEY_FILE = PluginSetting(
    "responses_key_file", "", "a file with the 32-byte key that seals encrypted reasoning (raw, hex or base64); empty: a key kept in the database"
)


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    register(MAX_STORED)
    register(MAX_STORED_BYTES)
    register(KEY_FILE)


@hookimpl
def millm_startup(app: AppContext) -> None:
    path = KEY_FILE.get(app.settings)
    key = read_key_file(path) if path else stored_key(app.store)
    store = ResponseStore(app.store, MAX_STORED.get(app.settings), MAX_STORED_BYTES.get(app.settings))
    app.stash[STATE] = ResponsesState(store=store, sealer=Sealer(key))


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    register(
        "/v1/responses",
        create_response,
        ["POST"],
        doc=RouteDoc(
            "Create a model response (OpenAI's Responses API, served as a chat completion)",
            request=ResponsesRequest,
            response=ResponseObject,
            errors=("400", "404", "500", "503"),
            events="with stream: true, `event:`/`data:` pairs from response.created to response.completed or response.incomplete",
        ),
    )
    register("/v1/responses/{response_id}", get_response, ["GET"], doc=RouteDoc("A stored response", response=ResponseObject, errors=("400", "404")))
    register(
        "/v1/responses/{response_id}", delete_response, ["DELETE"], doc=RouteDoc("Delete a stored response", response=DeletedResponse, errors=("400", "404"))
    )
