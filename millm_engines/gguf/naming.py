"""GGUF model names. A GGUF model is served as ``<name>:<QUANT>`` — its quantization tag
is part of the name, so several quantizations of one repository can be listed side by
side — and a bare ``<name>`` is refused: 404 naming the one model when a single
quantization is served, 400 ``ambiguous_model_name`` naming the tags when several are.

Repositories in the local Hugging Face cache (``org/Repo-GGUF``) are offered as
``org/Repo-GGUF:QUANT`` per ``.gguf`` file, found without any network access.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from millm_core.api import ConfigError, InvalidRequest, ModelNotFound

# Tags as llama.cpp's quantize tool names them, longest first so Q4_K_M beats Q4_K.
_TAGS = sorted(
    [
        "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0",
        "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_M", "IQ3_S", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
    ],
    key=len,
    reverse=True,
)  # fmt: skip
_FROM_FILE = re.compile(r"[.\-_](" + "|".join(_TAGS) + r")$", re.I)


class AmbiguousModelName(InvalidRequest):
    code = "ambiguous_model_name"


def tag_of_file_type(file_type: int | None) -> str | None:
    """``general.file_type`` as a tag (``MOSTLY_Q4_1`` → ``Q4_1``)."""
    if file_type is None:
        return None
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf ships with the gguf extra
        return None
    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def tag_of_filename(path: str) -> str | None:
    match = _FROM_FILE.search(os.path.basename(path).removesuffix(".gguf"))
    return match.group(1).upper() if match else None


def stem(path: str) -> str:
    """The file's name without ``.gguf`` and without a trailing quantization tag."""
    base = os.path.basename(path).removesuffix(".gguf")
    return _FROM_FILE.sub("", base) or base


def served_name(base: str, tag: str) -> str:
    return f"{base}:{tag}"


def hf_cache_root() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_gguf_repos(root: str | None = None) -> dict[str, dict[str, str]]:
    """``{"org/Repo": {"Q4_K_M": path, …}}`` for GGUF files in the local HF cache."""
    root = root or hf_cache_root()
    found: dict[str, dict[str, str]] = {}
    if not os.path.isdir(root):
        return found
    for entry in sorted(os.listdir(root)):
        if not entry.startswith("models--"):
            continue
        repo = entry.removeprefix("models--").replace("--", "/", 1)
        snapshots = os.path.join(root, entry, "snapshots")
        try:
            revisions = sorted(os.listdir(snapshots))
        except OSError:  # not a model repository, or gone while listed
            continue
        for revision in revisions:
            for directory, _, files in os.walk(os.path.join(snapshots, revision)):
                for name in sorted(files):
                    tag = tag_of_filename(name) if name.endswith(".gguf") else None
                    if tag:
                        found.setdefault(repo, {})[tag] = os.path.join(directory, name)
    return found


def pick(repo: str, tags: dict[str, str]) -> tuple[str, str]:
    """A bare repository name on the command line: its one quantization, or an error
    naming the tags."""
    if len(tags) == 1:
        tag, path = next(iter(tags.items()))
        return tag, path
    raise ConfigError(f"{repo} has several quantizations in the local cache; name one: " + ", ".join(served_name(repo, t) for t in sorted(tags)))


def refuse_bare_name(name: str, served: Iterable[str]) -> None:
    """Raise for a request naming a GGUF repository without its tag."""
    tags = sorted(s.split(":", 1)[1] for s in served if ":" in s and s.split(":", 1)[0] == name)
    if len(tags) == 1:
        raise ModelNotFound(f"model {name!r} is served as {served_name(name, tags[0])!r}; GGUF names carry their quantization", param="model")
    if len(tags) > 1:
        raise AmbiguousModelName(
            f"model {name!r} is served in several quantizations; name one of: {', '.join(served_name(name, t) for t in tags)}", param="model"
        )
