"""Circuits: multi-layer interventions across several SAEs, imported from a
circuit-definition document, activated for every request, scaled by one intensity dial, and
reported with the evidence ladder.

The plugin owns its routes (``/api/circuits``), its tables and its settings. It steers
through the steering plugin's public extension point (:mod:`millm_plugins.steering.contrib`):
the steering plugin decides each request's steering once, asks this plugin what the active
circuits add, applies it as per-row deltas and reports it in ``X-miLLM-Steering``
(``circuit`` members), with ``X-miLLM-Circuit-Rung`` set before generation when a circuit
genuinely steers the request. The steering plugin must therefore be enabled too; without
it the circuits are kept and listed but never steer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from millm_core.api import AppContext, PluginSetting, hookimpl
from millm_plugins.steering.api import dials_of
from millm_plugins.steering.contrib import Contribution, contributors
from millm_plugins.steering.intensity import Intensity
from millm_plugins.steering.live import Live

from . import api, settings
from .api import CIRCUITS, circuits_of
from .book import CircuitState
from .serve import contribution, decide

NAME = "circuits"
log = structlog.get_logger("millm.circuits")


class CircuitSteering:
    """The active circuits as a steering contributor (one per app)."""

    def __init__(self, app: AppContext) -> None:
        self.app = app

    def contribute(self, live: Live, dial: Intensity | None) -> Contribution | None:
        state = circuits_of(self.app)
        book = state.book  # one snapshot, in memory
        if not any(row.active for row in book.rows.values()):
            return None
        try:
            servings = decide(book, live, dial, settings.envelope_of(self.app.settings), dials_of(self.app))
            return contribution(servings, live, dial, lambda: state.book.epoch != book.epoch)
        except Exception:  # noqa: BLE001 - never guess: the request reports unknown and runs unsteered
            log.exception("circuits_contribution_failed")
            return Contribution(unknown="read_failed")


@hookimpl
def millm_register_settings(register: Callable[[PluginSetting[Any]], None]) -> None:
    for setting in settings.ALL:
        register(setting)


@hookimpl
def millm_register_routes(register: Callable[..., None]) -> None:
    for path, handler, methods, doc in api.ROUTES:
        register(path, handler, methods, doc=doc)


@hookimpl
def millm_startup(app: AppContext) -> None:
    """Migrate the plugin's tables, restore the stored circuits (their dials and which are
    active), watch the database for other servers' writes, and join the steering plugin's
    decision as a contributor."""
    state = app.stash[CIRCUITS] = CircuitState(store=app.store)
    state.start_watching()
    contributors(app).append(CircuitSteering(app))


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    """Stop watching the database."""
    if CIRCUITS in app.stash:
        circuits_of(app).stop_watching()
