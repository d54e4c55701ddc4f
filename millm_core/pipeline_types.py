"""What request hooks exchange with the core: problems, the forward plan, the outcome
and the finalisation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine import SamplingParams, TokenProcessor


@dataclass(frozen=True)
class Problem:
    """One reason to refuse a request. ``status``/``code``/``param`` follow the error
    table; the first problem of a request decides the response's status and code."""

    message: str
    param: str | None = None
    code: str = "invalid_parameter"
    status: int = 400


@dataclass(frozen=True)
class RowInfo:
    """What a processor factory knows about the row it builds for."""

    index: int
    prompt_index: int
    prompt_tokens: int


ProcessorFactory = Callable[[RowInfo], TokenProcessor]


@dataclass
class ForwardPlan:
    """How one request runs; built in pre-forward, owned by that request alone."""

    sampling: SamplingParams
    max_new_tokens: int
    processor_factories: list[ProcessorFactory] = field(default_factory=list)
    # layer -> vector added to that block's output for this request's rows (steering).
    deltas: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def add_processor(self, factory: ProcessorFactory) -> None:
        """Register a per-row processor factory; processors run in registration order."""
        self.processor_factories.append(factory)


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str
    completion_tokens: int


@dataclass(frozen=True)
class Outcome:
    """What actually ran, read after generation."""

    choices: tuple[ChoiceResult, ...]
    prompt_tokens: int
    completion_tokens: int
    cancelled: bool = False


@dataclass
class Finalization:
    """What finalize hooks contribute to the response."""

    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)
