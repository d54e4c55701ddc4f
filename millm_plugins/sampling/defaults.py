"""What an absent sampling field means: each field on its own takes, in order, the
operator's value for the request's mode (``--sampling-defaults-thinking`` /
``--sampling-defaults-no-thinking``), the model's ``generation_config.json`` (the values
the file states, never the library's built-in ones), then OpenAI's default.

The mode is ``no-thinking`` when the request turns its reasoning off
(``chat_template_kwargs.enable_thinking: false``, or ``reasoning_effort: "none"``) and
``thinking`` otherwise, so a model without a reasoning block uses the thinking values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from millm_core.api import PluginSetting

FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 20),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}


def parse_defaults(text: str) -> dict[str, float]:
    """``"temperature=0.7,top_p=0.8,top_k=20"`` → a dict; names and ranges as the API's."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not sep or name not in _BOUNDS:
            raise ValueError(f"expected name=value pairs with names among {', '.join(FIELDS)}; got {part!r}")
        value = float(raw)
        low, high = _BOUNDS[name]
        if not low <= value <= high or (name == "top_k" and value != int(value)):
            raise ValueError(f"{name}={raw.strip()} is outside {low:g}..{high:g}")
        out[name] = value
    return out


THINKING = PluginSetting[dict[str, float]](
    "sampling_defaults_thinking", {}, "sampling values for fields a request leaves out, with thinking on: name=value pairs", parse_defaults
)
NO_THINKING = PluginSetting[dict[str, float]](
    "sampling_defaults_no_thinking", {}, "sampling values for fields a request leaves out, with thinking off: name=value pairs", parse_defaults
)


def mode_of(request: Any) -> str:
    """``no-thinking`` when the request turns reasoning off, else ``thinking``."""
    kwargs = getattr(request, "chat_template_kwargs", None)
    off = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False
    return "no-thinking" if off or getattr(request, "reasoning_effort", None) == "none" else "thinking"


def stated(engine: Any) -> dict[str, float]:
    """The sampling values the engine read off its model (``generation_defaults``: a
    transformers model's ``generation_config.json``) that the API's ranges admit."""
    found = getattr(engine, "generation_defaults", None)
    out: dict[str, float] = {}
    for name, value in (found.items() if isinstance(found, Mapping) else ()):
        if name in _BOUNDS and isinstance(value, int | float) and not isinstance(value, bool):
            low, high = _BOUNDS[name]
            if low <= value <= high and (name != "top_k" or (value == int(value) and value > 0)):  # top_k 0: no filter in HF terms
                out[name] = float(value)
    return out


def defaults(settings: Any, engine: Any, mode: str) -> Mapping[str, float]:
    """The values absent fields take for this engine's model in this mode. A model's
    generation_config.json states its thinking values (Qwen3's does): with thinking off
    only the operator's values apply."""
    if mode == "no-thinking":
        return dict(NO_THINKING.get(settings))
    return {**stated(engine), **THINKING.get(settings)}
