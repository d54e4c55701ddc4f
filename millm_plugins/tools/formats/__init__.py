"""Tool-call formats: the syntaxes models write function calls in, as data.

Each format renders calls exactly as its models write them, parses a reply back into content
and calls, and says how tool_choice forcing opens a call. Which format a model uses is read off
its chat template (``detect_format``), never off its name. Everything here is pure: no engine,
no request state."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .base import CallFormat, ForcedCall, ParsedCall, arguments_json
from .detect import detect_format, takes_tools
from .hermes import HERMES, HermesFormat
from .llama3 import LLAMA3, Llama3Format
from .pythonic import PYTHONIC, PythonicFormat
from .streaming import holdback

FORMATS: Mapping[str, CallFormat] = MappingProxyType({fmt.name: fmt for fmt in (HERMES, PYTHONIC, LLAMA3)})
"""The known formats by name (read-only)."""

__all__ = [
    "FORMATS",
    "HERMES",
    "LLAMA3",
    "PYTHONIC",
    "CallFormat",
    "ForcedCall",
    "HermesFormat",
    "Llama3Format",
    "ParsedCall",
    "PythonicFormat",
    "arguments_json",
    "detect_format",
    "holdback",
    "takes_tools",
]
