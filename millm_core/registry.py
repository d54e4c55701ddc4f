"""The models this server serves, by served name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .engine import Engine, ModelInfo, ModelLocation


@dataclass
class ServedModel:
    """A loaded model and the engine serving it; ``location`` is where its files are,
    when the server loaded it (what unloading it gives back is estimated from them)."""

    info: ModelInfo
    engine: Engine
    location: ModelLocation | None = None

    @property
    def capabilities(self) -> frozenset[str]:
        return self.engine.capabilities


class ModelRegistry:
    """Served models by name. Lives in the app's lifespan state; no global instance."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, model: ServedModel) -> None:
        self._models[model.info.served_name] = model

    def remove(self, name: str) -> ServedModel | None:
        """Stop serving ``name``; the model it served, or None."""
        return self._models.pop(name, None)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)


@dataclass(frozen=True)
class SwitchTarget:
    """A model a request names that is not loaded, before the switch to it: ``name`` (its
    served name once loaded), the ``engine`` that would load it and that engine's declared
    ``capabilities``, and the loaded models the switch would unload (``residents``)."""

    name: str
    engine: str
    capabilities: frozenset[str]
    residents: tuple[str, ...]
