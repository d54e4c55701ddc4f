"""The OpenAPI 3.1 document, generated from the contract Structs, and a plain HTML page
for people. ``python -m millm_core.openapi PATH`` writes the document (``make schemas``);
a test fails when docs/schemas/openapi.json differs from what the code generates.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from . import __version__
from .context import Endpoint
from .contracts.chat import ChatCompletionChunk, ChatCompletionResponse
from .contracts.completions import CompletionChunk, CompletionResponse
from .contracts.embeddings import EmbeddingResponse
from .contracts.errors import ErrorResponse
from .contracts.models import ModelCard, ModelList
from .fields import PolicyCell

# Response types; each endpoint's request type is built at start-up from the plugins' fields.
_TYPES: list[Any] = [
    ChatCompletionResponse, ChatCompletionChunk, CompletionResponse, CompletionChunk,
    EmbeddingResponse, ModelList, ModelCard, ErrorResponse, PolicyCell,
]
_REF = "#/components/schemas/{name}"

_ERRORS = {
    "400": "Refused: invalid JSON or value, a field nothing honours, unused fields in strict mode, context length exceeded",
    "404": "Unknown model, or the named object does not exist",
    "409": "The object exists already",
    "401": "An API key is required (--api-key) and none or a wrong one was sent",
    "413": "Request body over the configured limit",
    "415": "A write to /api without Content-Type: application/json",
    "500": "Unexpected failure (details in the server log under the request id)",
    "503": "No model loaded, the queue or the server is full, not enough memory, or the database is busy (see Retry-After)",
}


def _ref(type_: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=type_.__name__)}


def _errors(*codes: str) -> dict[str, Any]:
    return {
        code: {"description": _ERRORS[code], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        for code in codes
    }


def _generation(summary: str, request: type, response: type, chunk: type) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "parameters": [
                {"name": "X-miLLM-Strict", "in": "header", "required": False, "description": "true or 1: refuse unused fields", "schema": {"type": "string", "enum": ["true", "1", "false", "0", "TRUE", "FALSE"]}},
            ],
            "responses": {
                "200": {
                    "description": "The completion; with stream: true, Server-Sent Events of chunks ending with data: [DONE]",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": {"type": "string", "description": f"data: {chunk.__name__} frames"}},
                    },
                },
                **_errors("400", "404", "413", "500", "503"),
            },
        }
    }


@dataclass(frozen=True)
class RouteDoc:
    """How a plugin's route appears in the OpenAPI document: passed as ``doc=`` to the
    ``register`` callable of ``millm_register_routes``. ``request``/``response`` are
    msgspec Structs (None: no JSON body); ``errors`` are the error statuses it can answer;
    ``events``, when set, says that the success status may instead be a Server-Sent Events
    stream, and describes its events."""

    summary: str
    request: type | None = None
    response: type | None = None
    status: int = 200
    errors: tuple[str, ...] = ("400", "404")
    events: str | None = None


Documented = tuple[str, str, RouteDoc]  # (path, method, doc)


def _operation(path: str, method: str, doc: RouteDoc) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": doc.summary}
    params = re.findall(r"{(\w+)(?::\w+)?}", path)
    if params:
        op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in params]
    if doc.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(doc.request)}}}
    ok: dict[str, Any] = {"description": doc.summary}
    if doc.response is not None:
        ok["content"] = {"application/json": {"schema": _ref(doc.response)}}
    if doc.events is not None:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string", "description": doc.events}}
    guarded = ("415",) if method.upper() in ("POST", "PUT", "PATCH", "DELETE") and path.startswith("/api/") else ()
    op["responses"] = {str(doc.status): ok, **_errors(*doc.errors, *(("413",) if doc.request else ()), *guarded)}
    return op


def openapi_document(
    request_types: Mapping[Endpoint, type],
    extra_responses: Sequence[tuple[str, type]] = (),
    routes: Sequence[Documented] = (),
    embeddings: bool = True,
) -> dict[str, Any]:
    """The whole document, deterministic for a given code version and plugin set.
    ``request_types`` are the endpoints' request types (the core's contracts joined with
    the enabled plugins' fields); ``extra_responses`` are plugins' additional 200 bodies
    per path (``millm_register_schemas``); ``routes`` are plugins' documented routes
    (``millm_register_routes`` with ``doc=``); ``embeddings``: whether a plugin serves
    ``/v1/embeddings``."""
    route_types = {t for _, _, doc in routes for t in (doc.request, doc.response) if t is not None}
    extra_types = sorted({t for _, t in extra_responses} | route_types, key=lambda t: t.__name__)
    served = [t for e, t in request_types.items() if embeddings or e != "embeddings"]
    _, components = msgspec.json.schema_components([*served, *_TYPES, *extra_types], ref_template=_REF)
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation("Chat completion", request_types["chat.completions"], ChatCompletionResponse, ChatCompletionChunk),
        "/v1/completions": _generation("Text completion (no chat template)", request_types["completions"], CompletionResponse, CompletionChunk),
    }
    if embeddings:
        paths["/v1/embeddings"] = {
            "post": {
                "summary": "Embeddings (the embeddings plugin)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request_types["embeddings"])}}},
                "responses": {
                    "200": {"description": "One vector per input", "content": {"application/json": {"schema": _ref(EmbeddingResponse)}}},
                    **_errors("400", "404", "413", "500", "503"),
                },
            }
        }
    paths |= {
        "/v1/models": {"get": {"summary": "Served models", "responses": {"200": {"description": "The list", "content": {"application/json": {"schema": _ref(ModelList)}}}}}},
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One served model",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model", "content": {"application/json": {"schema": _ref(ModelCard)}}}, **_errors("404")},
            }
        },
        "/api/policy": {
            "get": {
                "summary": "The field policy table: every field × endpoint × engine, honoured or refused",
                "responses": {"200": {"description": "The table", "content": {"application/json": {"schema": {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref(PolicyCell)}}}}}}},
            }
        },
    }
    for path, method, doc in sorted(routes, key=lambda r: (r[0], r[1])):
        paths.setdefault(re.sub(r"{(\w+):\w+}", r"{\1}", path), {})[method.lower()] = _operation(path, method, doc)
    for path, type_ in sorted(extra_responses, key=lambda pt: (pt[0], pt[1].__name__)):
        operation = next(iter(paths[path].values()))
        body = operation["responses"]["200"]["content"]["application/json"]
        options = body["schema"]["anyOf"] if "anyOf" in body["schema"] else [body["schema"]]
        body["schema"] = {"anyOf": [*options, _ref(type_)]}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "millm",
            "version": __version__,
            "description": "An OpenAI-compatible model server for interpretability research. Every field is honoured, reported or refused.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }


def render(document: dict[str, Any]) -> str:
    """Serialise as the committed file is written."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def _describe(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " | ".join(_describe(p) for p in prop["anyOf"])
    kind = prop.get("type", prop.get("const", "any"))
    if kind == "array":
        kind = f"array of {_describe(prop.get('items', {}))}"
    if "enum" in prop:
        kind = " | ".join(json.dumps(v) for v in prop["enum"])
    limits = [f"{k} {prop[k]}" for k in ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems") if k in prop]
    return f"{kind} ({', '.join(limits)})" if limits else str(kind)


def html_page(document: dict[str, Any]) -> str:
    """A self-contained page listing each endpoint and its request fields (no scripts,
    nothing fetched from elsewhere)."""
    schemas = document["components"]["schemas"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>millm API</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.2em .6em;text-align:left;vertical-align:top}"
        "code{background:#f3f3f3}</style></head><body>",
        f"<h1>millm API {html.escape(document['info']['version'])}</h1>",
        f"<p>{html.escape(document['info']['description'])} Machine-readable: <a href='/v1/openapi.json'>/v1/openapi.json</a>.</p>",
    ]
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            parts.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2><p>{html.escape(op['summary'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if not body:
                continue
            schema = schemas[body["$ref"].rsplit("/", 1)[-1]]
            required = set(schema.get("required", []))
            parts.append("<table><tr><th>field</th><th>type</th><th>required</th></tr>")
            for name, prop in schema.get("properties", {}).items():
                parts.append(
                    f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(_describe(prop))}</td>"
                    f"<td>{'yes' if name in required else ''}</td></tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


def installed_document() -> dict[str, Any]:
    """The document with every installed plugin's contributions (the committed file)."""
    from .config import Settings
    from .server.app import assemble, build_host

    host = build_host(Settings())
    assembly = assemble(host)
    return openapi_document(assembly.request_types, host.response_schemas(), host.documented_routes(), assembly.embeddings)


if __name__ == "__main__":  # pragma: no cover - exercised by `make schemas`
    from millm_core.logs import configure_logging

    configure_logging("console", "warning")
    target = sys.argv[1] if len(sys.argv) > 1 else "docs/schemas/openapi.json"
    with open(target, "w") as fh:
        fh.write(render(installed_document()))
