"""Every ``python`` and ``bash`` example in README.md, docs/ and CONTRIBUTING.md runs.

Examples address the default deployment (http://127.0.0.1:8000, SmolLM2-135M-Instruct);
the test points them at a server running the tiny model. The GGUF page's examples address
``millm serve --engine gguf`` and run against the tiny model written as GGUF; the tools and
responses pages' address SmolLM2 served with the example Hermes template, and run against
the tiny model served with that template; the reasoning page's address a reasoning model
(``Qwen3-0.6B``) and run against ``tiny-think`` (the tiny model with a reasoning template).
Blocks fenced as ``json`` must
be JSON (a document, or the members of one), and a member named like a request field must
decode as that field. Blocks fenced as ``console``, ``text`` or ``toml`` are illustrations
and are not run.

A ``python`` block of CONTRIBUTING.md whose first line is a ``# <path>.py`` comment is a
file of a plugin author's project (a plugin module, a test module): those files are
written into an empty directory, and ``pytest`` runs there with the kit's fixtures, as
in a third party's package.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```", re.M | re.S)
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), CONTRIBUTING]
PROJECT_FILE = re.compile(r"\A# (?P<path>[\w./-]+\.py)\n")


def blocks() -> list[tuple[str, int, str, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(FENCE.finditer(page.read_text())):
            if match["lang"] in ("python", "bash") and not PROJECT_FILE.match(match["body"]):
                found.append((page.name, index, match["lang"], match["body"]))
    return found


def project_files() -> dict[str, str]:
    """CONTRIBUTING.md's project files: path -> content."""
    files: dict[str, str] = {}
    for match in FENCE.finditer(CONTRIBUTING.read_text()):
        marker = PROJECT_FILE.match(match["body"])
        if match["lang"] == "python" and marker:
            assert marker["path"] not in files, f"{marker['path']} appears twice"
            files[marker["path"]] = match["body"]
    return files


def localise(code: str, base_url: str) -> str:
    return (
        code.replace("http://127.0.0.1:8000", base_url)
        .replace("SmolLM2-135M-Instruct-GGUF:Q4_1", "tiny:F32")
        .replace("SmolLM2-135M-Instruct", "tiny")
        .replace("Qwen3-0.6B", "tiny-think")
    )


def test_docs_have_examples() -> None:
    langs = {lang for _, _, lang, _ in blocks()}
    assert langs == {"python", "bash"}
    assert len(blocks()) >= 10


def json_blocks() -> list[tuple[str, int, str]]:
    return [(page.name, index, m["body"]) for page in PAGES for index, m in enumerate(FENCE.finditer(page.read_text())) if m["lang"] == "json"]


@pytest.mark.parametrize(("page", "index", "body"), json_blocks(), ids=[f"{b[0]}#{b[1]}" for b in json_blocks()])
def test_json_example_is_json_and_its_request_fields_decode(page: str, index: int, body: str) -> None:
    """A ``json`` block is a JSON document, or the members of one (a fragment of a request
    or a reply: ``"key": value``); a member named like a plugin's request field decodes
    as that field's type, as the server would decode it."""
    import msgspec

    from millm_core.config import load_settings
    from millm_core.plugins import PluginHost

    try:
        json.loads(body)
        return
    except json.JSONDecodeError:
        members = json.loads("{" + body + "}")  # a fragment: fails the test if it is not JSON either
    fields = {f.name: f for f in PluginHost.build(load_settings({}, environ={})).request_fields()}
    for key, value in members.items():
        if key in fields:
            msgspec.json.decode(json.dumps(value), type=fields[key].type)


@contextlib.contextmanager
def walkthrough_sae(base_url: str, d_model: int, folder: pathlib.Path) -> Iterator[None]:
    """The README walkthrough steers with a feature of the SAE it trained on SmolLM2; on the
    tiny model a random SAE of the same width stands in, attached for that example only."""
    import httpx
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {"W_enc": rng.normal(size=(d_model, 2048)), "b_enc": np.zeros(2048), "W_dec": rng.normal(size=(2048, d_model)), "b_dec": np.zeros(d_model)}
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_model, "d_sae": 2048, "architecture": "standard"}))
    assert httpx.post(base_url + "/api/saes", json={"path": str(folder), "id": "smollm2-l10"}).status_code == 201
    httpx.post(base_url + "/api/saes/smollm2-l10/attach", json={"layer": 1})
    try:
        yield
    finally:
        httpx.delete(base_url + "/api/saes/smollm2-l10", headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("page", "index", "lang", "code"), blocks(), ids=[f"{b[0]}#{b[1]}" for b in blocks()])
def test_example_runs(request: pytest.FixtureRequest, tmp_path: pathlib.Path, tiny_engine, page: str, index: int, lang: str, code: str) -> None:  # type: ignore[no-untyped-def]
    server = request.getfixturevalue({"gguf.md": "gguf_server", "tools.md": "tools_server", "responses.md": "tools_server", "reasoning.md": "reasoning_server"}.get(page, "server"))
    code = localise(code, server.base_url)
    setup = walkthrough_sae(server.base_url, tiny_engine.info.d_model, tmp_path) if '"steering"' in code and page == "README.md" else contextlib.nullcontext()
    with setup:
        run_example(page, index, lang, code)


def run_example(page: str, index: int, lang: str, code: str) -> None:
    if lang == "python":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{page}#{index}", "exec"), {"__name__": "__docs__"})
        assert out.getvalue(), "an example should show something"
    else:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        body = json.loads(result.stdout)
        assert "error" not in body, body


def test_contributing_project_passes_its_tests(tmp_path: pathlib.Path) -> None:
    """The plugin modules and tests CONTRIBUTING.md shows, run as a plugin author runs them:
    pytest in their own directory, the millm fixtures coming from its pytest11 entry points."""
    files = project_files()
    assert any(path.startswith("tests/") for path in files) and len(files) >= 4
    for path, code in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_examples_directory(server) -> None:  # type: ignore[no-untyped-def]
    chat = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "chat.py"), "--base-url", server.base_url + "/v1", "--seed", "3", "hello"],
        capture_output=True, text=True, timeout=60,
    )
    assert chat.returncode == 0, chat.stderr
    assert "prompt +" in chat.stdout and "completion tokens]" in chat.stdout
    headers = subprocess.run(["bash", str(ROOT / "examples" / "headers.sh"), server.base_url], capture_output=True, text=True, timeout=60)
    assert headers.returncode == 0, headers.stderr
    lowered = headers.stdout.lower()
    assert 'x-millm-seed: 7;scope="request"' in lowered
    assert 'x-millm-ignored-fields: "user", "messages[0].name"' in lowered


def test_every_setting_has_a_row_in_the_configuration_page() -> None:
    """docs/configuration.md names every core setting and every installed plugin's, by flag
    and environment variable, with the plugin's default shown where it is a plain value."""
    from millm_core.config import Settings
    from millm_core.plugins import PluginHost

    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `--([a-z0-9-]+)`.*$", page, re.M)}
    internal = {"plugin_values"}  # not a flag: where plugin settings' values live
    core = [name for name in Settings.__struct_fields__ if name not in internal]
    plugins = PluginHost.declared_settings()
    for name in [*core, *(s.name for s in plugins)]:
        flag = name.replace("_", "-")
        assert flag in rows, f"--{flag} has no row in docs/configuration.md"
        assert f"`MILLM_{name.upper()}`" in rows[flag], f"--{flag}'s row does not name MILLM_{name.upper()}"
    for setting in plugins:
        if isinstance(setting.default, bool):
            shown = str(setting.default).lower()
        elif isinstance(setting.default, int | float) and not isinstance(setting.default, bool):
            shown = str(setting.default)
        else:
            continue
        assert f"| `{shown}`" in rows[setting.name.replace("_", "-")], f"--{setting.name}: the page does not show its default {shown}"
