"""The function-calling request fields: ``tools``, ``tool_choice``, ``parallel_tool_calls``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class FunctionSpec(msgspec.Struct, kw_only=True):
    """A function the model may call: its name, what it does, and its arguments' JSON
    Schema (``parameters``; absent means no arguments are described)."""

    name: FunctionName
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET
    strict: bool | None | UnsetType = UNSET


class Tool(msgspec.Struct, kw_only=True):
    """One tool offered to the model (only functions exist)."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(msgspec.Struct, kw_only=True):
    """The ``function`` object of a forcing ``tool_choice``: the name of the function the model must call."""

    name: FunctionName


class ForceFunction(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ForceFunction

MAX_TOOLS = 128


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the plain OpenAI objects a chat template reads."""
    return [msgspec.to_builtins(t) for t in tools]


def forced_name(choice: ToolChoice | None) -> str | None:
    """The function a ``tool_choice`` names, if it names one."""
    return choice.function.name if isinstance(choice, ForceFunction) else None


def unset(value: object) -> bool:
    return value is None or value is UNSET
