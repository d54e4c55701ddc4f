"""Finds a model that ``--model`` names in the local Hugging Face cache (a repository id
such as ``HuggingFaceTB/SmolLM2-135M-Instruct``), strictly offline: a model that is not
already there is not found, never downloaded."""

from __future__ import annotations

import os

from millm_core.api import ModelLocation, Settings, hookimpl, local_revision

MILLM_PLUGIN_KIND = "models"


def cached_snapshot(name: str) -> str | None:
    """The local snapshot directory of repository ``name``, or None."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download, even by accident
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a core dependency
        return None
    try:
        return str(snapshot_download(repo_id=name, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None


@hookimpl(trylast=True)
def millm_locate_model(name: str, settings: Settings) -> ModelLocation | None:
    path = cached_snapshot(name)
    if path is None:
        return None
    return ModelLocation(path=path, served_name=settings.served_name or name, revision=local_revision(path))
