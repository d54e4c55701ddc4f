"""Plugin-owned request fields, and each endpoint's request type built from them.

The core's contracts declare OpenAI's own fields only. A plugin that honours a field of
its own (``steering``, ``top_k``, ``allowed_token_ids``, …) declares it with
:class:`RequestField` in ``millm_register_request_fields``; at start-up the core joins the
enabled plugins' fields onto each endpoint's base contract (``msgspec.defstruct``), so a
body is still decoded in one typed pass, a range error names the plugin's field, and the
field appears in ``/v1/openapi.json`` and ``/api/policy`` with its real schema.

A field that no enabled plugin declares but that is known to change the output
(:data:`millm_core.contracts.known.KNOWN_FIELDS`) is refused by name unless its value is
neutral; any other undeclared field is reported in ``X-miLLM-Ignored-Fields``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar, cast

import msgspec
from msgspec import UNSET, Meta, UnsetType

from .context import Endpoint
from .errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class RequestField(Generic[T]):
    """A request field a plugin owns.

    ``type`` is any type msgspec decodes (a Struct, a ``Literal``, an ``Annotated`` with
    ``Meta`` ranges); the endpoint declares it as ``type | None`` with default ``UNSET``, so
    "not sent" and "sent as null" stay distinguishable and both mean "no change".
    ``neutral(value)`` says which sent values also ask for nothing (they are accepted
    everywhere, even where nothing honours the field). Owning a field honours it on
    ``endpoints`` when the engine has ``requires``; ``condition`` says when it applies, for
    the policy table; ``description`` is the field's description in ``/v1/openapi.json``.
    Read it with :meth:`get` / :meth:`sent`.
    """

    name: str
    type: Any
    endpoints: tuple[Endpoint, ...]
    owner: str
    neutral: Callable[[Any], bool] | None = None
    requires: str | None = None
    condition: str = ""
    description: str = ""

    def get(self, request: object) -> T | None:
        """The value the request sent, or None when it sent nothing (or null)."""
        value = getattr(request, self.name, UNSET)
        if value is None or value is UNSET:
            return None
        return cast(T, value)

    def sent(self, request: object) -> bool:
        """Whether the request sent a non-null value."""
        return self.get(request) is not None

    def is_neutral(self, value: Any) -> bool:
        return value is None or value is UNSET or bool(self.neutral and self.neutral(value))


def build_request_types(
    bases: Mapping[Endpoint, type[msgspec.Struct]], fields: Iterable[RequestField[Any]]
) -> dict[Endpoint, type[msgspec.Struct]]:
    """Each endpoint's request type: its base contract plus the fields registered for it.

    Raises :class:`ConfigError` when a plugin field shadows a core field or two plugins
    declare the same field on one endpoint (the server must not start ambiguous).
    """
    per_endpoint: dict[Endpoint, dict[str, RequestField[Any]]] = {endpoint: {} for endpoint in bases}
    for field in fields:
        for endpoint in field.endpoints:
            if endpoint not in bases:
                raise ConfigError(f"plugin {field.owner!r} declares field {field.name!r} on unknown endpoint {endpoint!r}")
            base = bases[endpoint]
            if field.name in base.__struct_fields__:
                raise ConfigError(f"plugin {field.owner!r} declares field {field.name!r}, which the core's {endpoint} contract already has")
            other = per_endpoint[endpoint].get(field.name)
            if other is not None:
                raise ConfigError(f"plugins {other.owner!r} and {field.owner!r} both declare field {field.name!r} on {endpoint}")
            per_endpoint[endpoint][field.name] = field
    built: dict[Endpoint, type[msgspec.Struct]] = {}
    for endpoint, base in bases.items():
        extra = per_endpoint[endpoint]
        if not extra:
            built[endpoint] = base
            continue
        spec = [(name, _described(extra[name]) | None | UnsetType, UNSET) for name in sorted(extra)]
        joined = msgspec.defstruct(base.__name__, spec, bases=(base,), kw_only=True, module=base.__module__)
        joined.__doc__ = base.__doc__
        built[endpoint] = joined
    return built


def owned_fields(fields: Iterable[RequestField[Any]], endpoint: Endpoint) -> dict[str, RequestField[Any]]:
    """The registered fields of one endpoint, by name."""
    return {f.name: f for f in fields if endpoint in f.endpoints}


def _described(field: RequestField[Any]) -> Any:
    """The field's type, carrying its ``description`` into the published schema."""
    return Annotated[field.type, Meta(description=field.description)] if field.description else field.type


def request_types_with(fields: Iterable[RequestField[Any]]) -> dict[Endpoint, type[msgspec.Struct]]:
    """The endpoints' request types as a server whose enabled plugins declare ``fields``
    would build them (for a plugin publishing its own schema document)."""
    from .contracts import ENDPOINT_CONTRACTS

    return build_request_types(ENDPOINT_CONTRACTS, fields)
