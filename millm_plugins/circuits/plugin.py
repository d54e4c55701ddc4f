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

from millm_core.api import AppContext, ConfigError, PluginSetting, hookimpl
from millm_plugins.steering.contrib import Contribution, contributors
from millm_plugins.steering.public import STATE, Intensity, Live, dials_of

from . import api, settings
from .api import CIRCUITS, circuits_of
from .book import Book, CircuitState
from .serve import SLICE_FALLBACK, Serving, contribution, decide

NAME = "circuits"
log = structlog.get_logger("millm.circuits")


class CircuitSteering:
    """The active circuits as a steering contributor (one per app)."""

    def __init__(self, app: AppContext) -> None:
        self.app = app

    def contribute(self, live: Live, dial: Intensity | None) -> Contribution | None:
        state = circuits_of(self.app)
        book = state.book  # one snapshot, in memory

        def epoch_moved() -> bool:
            return state.book.epoch != book.epoch

        if not any(row.active for row in book.rows.values()):
            # Nothing to apply, but a circuit activated while the request runs is an
            # operator write during it: the report must still say ``changed``.
            return Contribution(moved=epoch_moved)
        try:
            servings = decide(book, live, dial, settings.envelope_of(self.app.settings), dials_of(self.app))
            return contribution(servings, live, dial, self._watch(epoch_moved, book, servings, live))
        except Exception:  # noqa: BLE001 - never guess: the request reports unknown and runs unsteered
            log.exception("circuits_contribution_failed")
            return Contribution(unknown="read_failed", moved=epoch_moved)

    def _watch(self, epoch_moved: Callable[[], bool], book: Book, servings: list[Serving], live: Live) -> Callable[[], bool]:
        """``moved`` for a request decided from ``book`` and ``live``: the circuits epoch,
        and the backing clusters of the circuits serving in ``slice_fallback``. A write to
        one of those (its dial, its features, deleting it) changes what such a circuit
        applies without moving either epoch (the steering plugin does not know the cluster
        is in use), so it is compared here by value."""
        backing = {
            name: live.profiles.get(name)
            for serving in servings
            if serving.mode == SLICE_FALLBACK and (name := _backing(book, serving.id)) is not None
        }
        if not backing:
            return epoch_moved
        steering = self.app.stash[STATE]

        def moved() -> bool:
            now = steering.live.profiles
            return epoch_moved() or any(now.get(name) != used for name, used in backing.items())

        return moved


def _backing(book: Book, circuit_id: str) -> str | None:
    row = book.rows.get(circuit_id)
    return row.circuit.backing_cluster if row is not None and row.circuit is not None else None


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
    decision as a contributor. A dial floor above its ceiling stops start-up."""
    low, high = float(settings.INTENSITY_MIN.get(app.settings)), float(settings.INTENSITY_MAX.get(app.settings))
    if low > high:
        raise ConfigError(f"--circuit-intensity-min {low:g} is above --circuit-intensity-max {high:g}")
    state = app.stash[CIRCUITS] = CircuitState(store=app.store)
    state.start_watching()
    contributors(app).append(CircuitSteering(app))


@hookimpl
def millm_shutdown(app: AppContext) -> None:
    """Stop watching the database."""
    if CIRCUITS in app.stash:
        circuits_of(app).stop_watching()
