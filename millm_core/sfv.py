"""Serialisation of the RFC 8941 structured-field values millm's headers use.

Only serialisation lives here (a few lines, no dependency); tests parse every header
with an independent implementation (the ``http-sfv`` package).
"""

from __future__ import annotations

from collections.abc import Sequence


def percent_encode_nonprintable(text: str) -> str:
    """Percent-encode each UTF-8 byte outside printable ASCII, and ``%`` itself."""
    out: list[str] = []
    for ch in text:
        if 0x20 <= ord(ch) <= 0x7E and ch != "%":
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def sf_string(text: str) -> str:
    """An sf-string: printable ASCII only, with ``"`` and ``\\`` escaped."""
    if any(not 0x20 <= ord(ch) <= 0x7E for ch in text):
        raise ValueError("sf-string must be printable ASCII; percent-encode first")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def string_list(items: Sequence[str], max_bytes: int | None = None) -> str:
    """A List of Strings; with ``max_bytes``, entries that do not fit are replaced by a
    last entry ``"+N more"`` (the whole value stays within ``max_bytes``)."""
    encoded = [sf_string(percent_encode_nonprintable(item)) for item in items]
    value = ", ".join(encoded)
    if max_bytes is None or len(value) <= max_bytes:
        return value
    kept: list[str] = []
    for index, entry in enumerate(encoded):
        rest = len(encoded) - index - 1
        marker = sf_string(f"+{rest} more")
        candidate = ", ".join([*kept, entry, marker]) if rest else ", ".join([*kept, entry])
        if len(candidate) > max_bytes:
            break
        kept.append(entry)
    more = len(encoded) - len(kept)
    return ", ".join([*kept, sf_string(f"+{more} more")])
