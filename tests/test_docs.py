"""Every ``python`` and ``bash`` example in README.md and docs/ runs against a real server.

Examples address the default deployment (http://127.0.0.1:8000, SmolLM2-135M-Instruct);
the test points them at a server running the tiny model. The GGUF page's examples address
``millm serve --engine gguf`` and run against the tiny model written as GGUF. Blocks fenced as ``console``,
``text`` or ``toml`` are illustrations and are not run.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```", re.M | re.S)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks() -> list[tuple[str, int, str, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(FENCE.finditer(page.read_text())):
            if match["lang"] in ("python", "bash"):
                found.append((page.name, index, match["lang"], match["body"]))
    return found


def localise(code: str, base_url: str) -> str:
    return (
        code.replace("http://127.0.0.1:8000", base_url)
        .replace("SmolLM2-135M-Instruct-GGUF:Q4_1", "tiny:F32")
        .replace("SmolLM2-135M-Instruct", "tiny")
    )


def test_docs_have_examples() -> None:
    langs = {lang for _, _, lang, _ in blocks()}
    assert langs == {"python", "bash"}
    assert len(blocks()) >= 10


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
        httpx.delete(base_url + "/api/saes/smollm2-l10")


@pytest.mark.parametrize(("page", "index", "lang", "code"), blocks(), ids=[f"{b[0]}#{b[1]}" for b in blocks()])
def test_example_runs(request: pytest.FixtureRequest, tmp_path: pathlib.Path, tiny_engine, page: str, index: int, lang: str, code: str) -> None:  # type: ignore[no-untyped-def]
    server = request.getfixturevalue("gguf_server" if page == "gguf.md" else "server")
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
