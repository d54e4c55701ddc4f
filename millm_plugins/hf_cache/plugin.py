"""The local Hugging Face cache, strictly offline: finds a model that ``--model`` names
there (a repository id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``), and offers every
checkpoint the cache holds as a model (``GET /api/models``; a request naming it loads it).
A model that is not already there is not found, never downloaded. GGUF files of the cache
are the GGUF engine plugin's to offer (by quantization tag)."""

from __future__ import annotations

import os
from collections.abc import Callable

from millm_core.api import ModelLocation, ModelSource, Settings, hookimpl, local_revision

MILLM_PLUGIN_KIND = "models"


def cache_root() -> str:
    """The hub cache directory (``HF_HUB_CACHE``, ``HF_HOME``, or the default)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


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


def cached_checkpoints(root: str | None = None) -> dict[str, str]:
    """``{"org/Repo": snapshot}`` for each cached model repository with a checkpoint
    (a ``config.json``) in a snapshot: the one ``refs/main`` names, else the newest."""
    root = root or cache_root()
    found: dict[str, str] = {}
    if not os.path.isdir(root):
        return found
    for entry in sorted(os.listdir(root)):
        if not entry.startswith("models--"):
            continue
        try:
            snapshot = _snapshot(os.path.join(root, entry))
        except OSError:  # unreadable, or gone while listed: not offered
            continue
        if snapshot is not None:
            found[entry.removeprefix("models--").replace("--", "/", 1)] = snapshot
    return found


def _snapshot(repo_dir: str) -> str | None:
    """The snapshot of a cached repository that holds a checkpoint: the one ``refs/main``
    names, else the newest."""
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", "main")
    main = None
    if os.path.isfile(ref):
        with open(ref) as fh:
            main = fh.read().strip()
    revisions = sorted(os.listdir(snapshots), key=lambda r: (r == main, os.path.getmtime(os.path.join(snapshots, r))))
    for revision in reversed(revisions):
        snapshot = os.path.join(snapshots, revision)
        if os.path.isfile(os.path.join(snapshot, "config.json")):
            return snapshot
    return None


@hookimpl(trylast=True)
def millm_locate_model(name: str, settings: Settings) -> ModelLocation | None:
    path = cached_snapshot(name)
    if path is None:
        return None
    return ModelLocation(path=path, served_name=settings.served_name or name, revision=local_revision(path))


def _source(repo: str, snapshot: str) -> ModelSource:
    def materialise(settings: Settings) -> ModelLocation:
        return ModelLocation(path=snapshot, served_name=repo, revision=local_revision(snapshot))

    return ModelSource(name=repo, materialise=materialise, description="a checkpoint in the local Hugging Face cache")


@hookimpl
def millm_register_model_sources(register: Callable[[ModelSource], None]) -> None:
    for repo, snapshot in cached_checkpoints().items():
        register(_source(repo, snapshot))
