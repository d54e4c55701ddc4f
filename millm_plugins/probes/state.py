"""The plugin's per-app state (in the app's stash): the probe book, the events log, and
each served model's identity (computed once per engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from millm_core.api import AppContext, ServedModel, StashKey

from .book import ProbeBook
from .detector import identity_of
from .document import ModelIdentity
from .events import EventLog


@dataclass
class ProbesState:
    book: ProbeBook
    events: EventLog
    identities: dict[str, tuple[object, ModelIdentity]] = field(default_factory=dict)

    def identity(self, model: ServedModel) -> ModelIdentity:
        """The model's identity; cached per served name while its engine is the same."""
        cached = self.identities.get(model.info.served_name)
        if cached is not None and cached[0] is model.engine:
            return cached[1]
        identity = identity_of(model)
        self.identities[model.info.served_name] = (model.engine, identity)
        return identity


STATE = StashKey[ProbesState]("probes.state")


def state_of(app: AppContext) -> ProbesState:
    """The app's probes state, created by the plugin's ``millm_startup``."""
    return app.stash[STATE]
