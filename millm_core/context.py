"""Per-request state: the RequestContext that every request hook receives, and a typed
stash where plugins keep their own per-request state (after pytest's ``Stash``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast

from .config import Settings

T = TypeVar("T")

Endpoint = Literal["chat.completions", "completions", "embeddings"]


class StashKey(Generic[T]):
    """A typed key: ``KEY = StashKey[int]()`` then ``ctx.stash[KEY] = 3``."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """A mapping from StashKey[T] to T; keys are compared by identity."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return cast(T, self._data[key])

    def get(self, key: StashKey[T], default: T) -> T:
        return cast(T, self._data.get(key, default))

    def __contains__(self, key: StashKey[Any]) -> bool:
        return key in self._data


@dataclass
class RequestContext:
    """One request's context, created by the core and passed to every request hook.

    Plugins add response headers with :meth:`set_header` (any time before the response
    starts: in validate or pre-forward for a stream) and keep private state in ``stash``.
    """

    request_id: str
    endpoint: Endpoint
    settings: Settings
    headers: dict[str, str]
    stream: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    response_headers: dict[str, str] = field(default_factory=dict)
    ignored_fields: list[str] = field(default_factory=list)
    stash: Stash = field(default_factory=Stash)
    # The app's shared state (``AppState``): plugins reach their runtime state through it.
    services: Any = None

    def set_header(self, name: str, value: str) -> None:
        self.response_headers[name] = value
