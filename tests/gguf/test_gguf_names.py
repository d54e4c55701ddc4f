"""GGUF names from files and from the local Hugging Face cache (found offline)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from millm_core.errors import ConfigError
from millm_engines.gguf import naming


@pytest.mark.parametrize(
    ("file", "tag", "stem"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1", "SmolLM2-135M-Instruct"),
        ("llama-3-8b-instruct-q4_k_m.gguf", "Q4_K_M", "llama-3-8b-instruct"),
        ("model-F16.gguf", "F16", "model"),
        ("plain.gguf", None, "plain"),
    ],
)
def test_tags_and_stems_from_file_names(file: str, tag: str | None, stem: str) -> None:
    assert naming.tag_of_filename(file) == tag
    assert naming.stem(file) == stem


def test_file_types_name_their_quantization() -> None:
    assert [naming.tag_of_file_type(t) for t in (0, 1, 3, 15)] == ["F32", "F16", "Q4_1", "Q4_K_M"]


def fake_cache(root: pathlib.Path, gguf_path: str, repo: str, files: list[str]) -> None:
    snapshot = root / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(gguf_path, snapshot / name)


def test_cached_repositories_are_offered_per_quantization(tmp_path: pathlib.Path, gguf_path: str) -> None:
    fake_cache(tmp_path, gguf_path, "acme/Tiny-GGUF", ["tiny.Q8_0.gguf", "tiny.F32.gguf", "README.md"])
    fake_cache(tmp_path, gguf_path, "acme/Solo-GGUF", ["solo.Q4_K_M.gguf"])
    found = naming.cached_gguf_repos(str(tmp_path))
    assert sorted(found) == ["acme/Solo-GGUF", "acme/Tiny-GGUF"]
    assert sorted(found["acme/Tiny-GGUF"]) == ["F32", "Q8_0"]
    assert naming.pick("acme/Solo-GGUF", found["acme/Solo-GGUF"])[0] == "Q4_K_M"
    with pytest.raises(ConfigError, match="acme/Tiny-GGUF:F32, acme/Tiny-GGUF:Q8_0"):
        naming.pick("acme/Tiny-GGUF", found["acme/Tiny-GGUF"])


def test_millm_lists_and_refuses_cached_names(tmp_path: pathlib.Path, gguf_path: str) -> None:
    fake_cache(tmp_path, gguf_path, "acme/Tiny-GGUF", ["tiny.Q8_0.gguf", "tiny.F32.gguf"])
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path)}
    listed = subprocess.run([sys.executable, "-m", "millm_core.cli", "models"], capture_output=True, text=True, env=env, timeout=120)
    names = [line.split("\t")[0] for line in listed.stdout.splitlines()]
    assert {"acme/Tiny-GGUF", "acme/Tiny-GGUF:F32", "acme/Tiny-GGUF:Q8_0"} <= set(names)
    bare = subprocess.run([sys.executable, "-m", "millm_core.cli", "serve", "--model", "acme/Tiny-GGUF", "--port", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 2 and "acme/Tiny-GGUF:F32, acme/Tiny-GGUF:Q8_0" in bare.stderr


def test_the_packaged_model_has_one_name_per_engine(tmp_path: pathlib.Path) -> None:
    """The smollm2 plugin offers the packaged model twice, each under the name it is served
    by: converted for transformers, and the GGUF file itself (the default on ``--engine
    gguf``). Naming the conversion on ``--engine gguf`` is refused with the other name (it
    used to load the same file again under a second name)."""
    from millm_core.config import load_settings
    from millm_core.lifecycle import candidates
    from millm_core.loading import locate
    from millm_core.server.app import build_host

    settings = load_settings({"engine": "gguf", "cache_dir": str(tmp_path)}, environ={})
    host = build_host(settings)
    default = locate(settings, host)
    assert default.served_name == "SmolLM2-135M-Instruct-GGUF:Q4_1" and default.path.endswith(".gguf")
    listed = candidates(settings, host)
    # Each name is offered where its engine may serve it: not the conversion under --engine gguf.
    assert "SmolLM2-135M-Instruct-GGUF:Q4_1" in listed and "SmolLM2-135M-Instruct" not in listed
    unforced = load_settings({"cache_dir": str(tmp_path)}, environ={})
    assert {"SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-GGUF:Q4_1"} <= set(candidates(unforced, build_host(unforced)))
    assert listed["SmolLM2-135M-Instruct-GGUF:Q4_1"].locate().path == default.path
    named = load_settings({"engine": "gguf", "cache_dir": str(tmp_path), "model": "SmolLM2-135M-Instruct"}, environ={})
    with pytest.raises(ConfigError, match=r"--engine gguf serves the packaged file itself as SmolLM2-135M-Instruct-GGUF:Q4_1"):
        locate(named, host)
    assert not list(tmp_path.iterdir())  # nothing was converted
    # The mirror: the GGUF file's name under an engine that does not serve it.
    forced = load_settings({"engine": "transformers", "cache_dir": str(tmp_path), "model": "SmolLM2-135M-Instruct-GGUF:Q4_1"}, environ={})
    with pytest.raises(ConfigError, match=r"--engine transformers serves the packaged model as SmolLM2-135M-Instruct"):
        locate(forced, build_host(forced))
