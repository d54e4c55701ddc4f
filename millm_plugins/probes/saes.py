"""The SAE a ``sae_features`` probe reads: one the steering plugin attached (and can use)
at the probe's layer, from its in-memory snapshot (no I/O), and that millm encodes
faithfully (``SAE.encode_refusal``: an input normalisation it does not apply)."""

from __future__ import annotations

from typing import Any

from millm_core.api import AppContext
from millm_plugins.steering.public import STATE


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


def encode_refusal(sae: Any) -> str | None:
    """Why ``sae``'s activations, as millm encodes them, are not its own (None: they are)."""
    refusal = getattr(sae, "encode_refusal", None)
    return refusal if isinstance(refusal, str) else None


def usable(sae: Any | None, width: int) -> bool:
    """Whether a probe with ``width`` weights can read ``sae`` (attached, as wide, encoded
    faithfully)."""
    return sae is not None and sae.d_sae == width and encode_refusal(sae) is None
