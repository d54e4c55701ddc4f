"""The ``response_format`` request field: OpenAI's three shapes."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: the schema and its name. ``strict: false`` is
    accepted; the schema is enforced either way."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema: dict[str, Any] = msgspec.field(default_factory=dict)
    strict: bool | None | UnsetType = UNSET
    description: str | UnsetType = UNSET


class TextFormat(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    """Plain text: no constraint (the neutral value)."""


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object", kw_only=True):
    """Any one JSON object."""


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True):
    """A JSON document that validates against ``json_schema.schema``."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


def constrained_header(fmt: JsonObjectFormat | JsonSchemaFormat) -> str:
    """``X-miLLM-Constrained``: ``json_object``, or ``json_schema;name="<name>"`` (an RFC
    8941 token with a string parameter; the name's pattern needs no escaping)."""
    if isinstance(fmt, JsonObjectFormat):
        return "json_object"
    return f'json_schema;name="{fmt.json_schema.name}"'
