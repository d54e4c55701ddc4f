"""The SAE a ``sae_features`` probe reads: one the steering plugin attached (and can use)
at the probe's layer, from its in-memory snapshot (no I/O)."""

from __future__ import annotations

from typing import Any

from millm_core.api import AppContext
from millm_plugins.steering.api import STATE


def attached_sae(app: AppContext, sae_id: str, layer: int) -> Any | None:
    """The loaded SAE ``sae_id`` when it is attached and usable at ``layer``, else None
    (also when the steering plugin is not enabled)."""
    if STATE not in app.stash:
        return None
    live = app.stash[STATE].live
    entry = (sae_id, layer)
    if entry not in live.attachments or entry in live.unusable:
        return None
    return live.saes.get(sae_id)
