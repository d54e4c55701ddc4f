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
    """The item type of the list a value of ``info`` may be (through unions and Meta)."""
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


def _struct_for(value: dict[str, Any], info: mi.Type) -> mi.StructType | None:
    """The Struct type ``value`` decodes as under ``info``: the only one, or the member of
    a tagged union whose tag ``value`` carries (None when that cannot be told)."""
    structs = _structs_in(info)
    if len(structs) == 1:
        return structs[0]
    tagged = [s for s in structs if s.tag_field is not None and value.get(s.tag_field) == s.tag]
    return tagged[0] if len(tagged) == 1 else None


def _walk_value(value: Any, info: mi.Type, location: str, out: list[str]) -> None:
    """Report the unknown keys of ``value`` (at ``location``), typed ``info``: objects
    that decode as a Struct, and lists of them at any depth."""
    if isinstance(value, dict):
        struct = _struct_for(value, info)
        if struct is not None:
            _walk(value, struct, location, out)
    elif isinstance(value, list):
        item_type = _list_items(info)
        if item_type is not None:
            for index, element in enumerate(value):
                _walk_value(element, item_type, f"{location}[{index}]", out)


def _walk(value: dict[str, Any], info: mi.StructType, prefix: str, out: list[str]) -> None:
    fields = {f.encode_name: f for f in info.fields}
    for key, item in value.items():
        field = fields.get(key)
        location = f"{prefix}.{key}" if prefix else key
        if field is None and key == info.tag_field:  # a tagged Struct's tag ("type") is read, not unknown
            continue
        if field is None:
            out.append(location)
            continue
        _walk_value(item, field.type, location, out)


def unknown_fields(raw: dict[str, Any], type_: type) -> list[str]:
    """Locations of keys in ``raw`` that ``type_`` (a Struct) does not declare."""
    out: list[str] = []
    _walk(raw, _struct_info(type_), "", out)
    return out
