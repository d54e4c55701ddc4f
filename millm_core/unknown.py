"""Find the fields of a request body that its contract does not declare.

msgspec skips unknown fields while decoding; this walk over the raw JSON and the
contract's type info recovers their locations (``"foo"``, ``"messages[2].name"``), so
they are reported instead of dropped.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec.inspect as mi


@cache
def _struct_info(type_: type) -> mi.StructType:
    info = mi.type_info(type_)
    assert isinstance(info, mi.StructType)
    return info


def _structs_in(info: mi.Type) -> list[mi.StructType]:
    """Struct types a value of ``info`` may take (through unions and Meta wrappers)."""
    if isinstance(info, mi.StructType):
        return [info]
    if isinstance(info, mi.UnionType):
        out: list[mi.StructType] = []
        for member in info.types:
            out.extend(_structs_in(member))
        return out
    if isinstance(info, mi.Metadata):
        return _structs_in(info.type)
    return []


def _list_items(info: mi.Type) -> mi.Type | None:
    if isinstance(info, mi.Metadata):
        return _list_items(info.type)
    if isinstance(info, mi.UnionType):
        for member in info.types:
            found = _list_items(member)
            if found is not None:
                return found
        return None
    if isinstance(info, mi.ListType):
        return info.item_type
    return None


def _walk(value: Any, info: mi.StructType, prefix: str, out: list[str]) -> None:
    fields = {f.encode_name: f for f in info.fields}
    for key, item in value.items():
        field = fields.get(key)
        location = f"{prefix}.{key}" if prefix else key
        if field is None and key == info.tag_field:  # a tagged Struct's tag ("type") is read, not unknown
            continue
        if field is None:
            out.append(location)
            continue
        if isinstance(item, dict):
            structs = _structs_in(field.type)
            if len(structs) == 1:
                _walk(item, structs[0], location, out)
        elif isinstance(item, list):
            item_type = _list_items(field.type)
            structs = _structs_in(item_type) if item_type is not None else []
            if len(structs) == 1:
                for index, element in enumerate(item):
                    if isinstance(element, dict):
                        _walk(element, structs[0], f"{location}[{index}]", out)


def unknown_fields(raw: dict[str, Any], type_: type) -> list[str]:
    """Locations of keys in ``raw`` that ``type_`` (a Struct) does not declare."""
    out: list[str] = []
    _walk(raw, _struct_info(type_), "", out)
    return out
