"""Steering that other plugins contribute to a request: the steering plugin's public
extension point.

A plugin that keeps global steering of its own (the circuits plugin) registers a
:class:`Contributor` in its ``millm_startup``::

    from millm_plugins.steering.contrib import contributors

    @hookimpl
    def millm_startup(app):
        contributors(app).append(MyContributor(app))

The steering plugin stays the only writer of ``plan.deltas`` and of ``X-miLLM-Steering``.
In pre-forward it decides a request's steering from one snapshot of its state
(:class:`~.live.Live`) and asks each contributor, with that snapshot and the request's
parsed ``steering_intensity``, what it adds (:meth:`Contributor.contribute`). What comes
back is applied to the request's rows and reported with steering's own entries, under one
header:

- a request whose inline ``steering`` or ``profile`` replaces the global state never asks
  the contributors (their steering is replaced too);
- scoring and embeddings never reach pre-forward: they are never steered;
- a dial of 0 / ``"off"`` asks them (a contributor that takes the dial makes the request
  echo ``0.0``) but applies nothing;
- a contribution that could not be determined (``unknown``) makes the request report
  ``unknown;reason=…`` and run unsteered, as steering does for its own unreadable state;
- ``circuits`` members come first in the header, by id, then the SAE items by layer;
- ``changed`` is set on every member when steering's epoch moved, or when any
  contribution's ``moved()`` says its own state changed, while the request ran (one that
  applied nothing too: an operator activating something mid-request is a change);
- ``headers`` are set on the response (before generation: a stream gets them too) only
  when the contribution was applied.

A contributor runs on the event loop for every generation request: read memory only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from millm_core.api import AppContext, StashKey

from .intensity import Intensity
from .live import Live

if TYPE_CHECKING:
    from .apply import Entry


def _unmoved() -> bool:
    return False


@dataclass(frozen=True)
class CircuitMember:
    """One ``circuit;id=…;intensity=…;clamped=…?;composed?`` member of
    ``X-miLLM-Steering``: the circuit's id (a String), the λ it ran with, how many of its
    applied features the ±200 clamp changed (over all its layers; reported when above 0,
    as for every other member), and whether one of its layers carried another circuit
    too. The steering plugin serialises it (see ``apply.report``)."""

    id: str
    intensity: float
    composed: bool = False
    clamped: int = 0


@dataclass(frozen=True)
class Contribution:
    """What a contributor adds to one request.

    ``circuits``: report members (first in the header, by id); ``deltas``: layer → vector
    (float32 numpy or a tuple of floats, ``d_model`` long) those members add, summed with
    every other delta at that layer; ``entries``: SAE items applied and reported exactly as
    steering's own (a profile a contributor falls back to); ``base``: the contributor takes
    the request's dial (steering's own active profile and manual values then run as
    stored), and ``echo`` is the λ it resolved to (``X-miLLM-Steering-Intensity``);
    ``headers``: response headers for a request this contribution steers; ``unknown``: a
    reason token when its state cannot be determined; ``moved``: whether its state changed
    since this contribution was decided."""

    circuits: tuple[CircuitMember, ...] = ()
    deltas: Mapping[int, Any] = field(default_factory=dict)
    entries: tuple[Entry, ...] = ()
    base: bool = False
    echo: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    unknown: str | None = None
    moved: Callable[[], bool] = _unmoved


class Contributor(Protocol):
    """A plugin's global steering, asked once per generation request that runs with the
    global state."""

    def contribute(self, live: Live, dial: Intensity | None) -> Contribution | None:
        """What this request adds, decided from ``live`` (the snapshot the request's own
        steering is decided from) and its parsed dial (None: no ``steering_intensity``).
        With nothing active, return ``Contribution(moved=…)`` so that activating something
        while the request runs is reported ``changed`` (None: nothing to watch either).
        Must not raise for a request: report state that cannot be read with ``unknown``."""
        ...


CONTRIBUTORS = StashKey[list[Contributor]]("steering.contributors")


def contributors(app: AppContext) -> list[Contributor]:
    """The app's registered contributors (created empty on first use), in registration
    order. Append yours in ``millm_startup``."""
    return app.stash.setdefault(CONTRIBUTORS, list)
