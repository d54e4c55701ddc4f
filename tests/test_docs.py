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


@pytest.mark.parametrize(("page", "index", "lang", "code"), blocks(), ids=[f"{b[0]}#{b[1]}" for b in blocks()])
def test_example_runs(request: pytest.FixtureRequest, page: str, index: int, lang: str, code: str) -> None:
    server = request.getfixturevalue("gguf_server" if page == "gguf.md" else "server")
    code = localise(code, server.base_url)
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
