"""The reasoning plugin on the GGUF engine (llama.cpp): the tiny model written as GGUF and
served with the reasoning template. The forced close, the redirect and the loop guard
(llama.cpp rows rewound) against a second GGUF copy stepped directly, alone and in a
shared batch."""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from millm_core.config import load_settings
from millm_core.server.app import build_host
from millm_core.testing import RunningServer

from ..conftest import TEMPLATES
from ..gguf.helpers import load_gguf
from .helpers import CLOSE, FORCE, ScriptPlugin, forcing, reference, split, texts

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
OPEN = {"open_thinking": True}
TEMPLATE = os.path.join(TEMPLATES, "think.jinja")


@pytest.fixture(scope="module")
def ref(gguf_path: str) -> Any:
    return load_gguf(gguf_path, "ref", chat_template=TEMPLATE).engine


@pytest.fixture(scope="module")
def srv(make_server, gguf_path: str) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(ScriptPlugin(), "script")
    with make_server(host=host, models=[load_gguf(gguf_path, "tiny-think", chat_template=TEMPLATE)]) as server:
        yield server


def chat(srv: RunningServer, script: list[int | None] | None = None, **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny-think", "messages": MESSAGES, "temperature": 0, "max_tokens": 30, "chat_template_kwargs": OPEN, **body}
    headers = {"x-script": json.dumps(script)} if script is not None else {}
    resp = httpx.post(srv.base_url + "/v1/chat/completions", json=payload, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def pair(body: dict[str, Any]) -> tuple[Any, Any]:
    message = body["choices"][0]["message"]
    return message.get("reasoning_content"), message["content"]


def test_budget_redirect_and_loop_guard_on_llama_cpp(srv: RunningServer, ref: Any) -> None:
    ids = list(ref.render_chat(MESSAGES, **OPEN))
    first = reference(ref, ids, 5)
    prefix = "" if texts(ref, first).endswith("\n") else "\n"
    close = list(ref.encode(prefix + CLOSE + "\n\n", add_special_tokens=False))
    closed_at_5 = split(texts(ref, reference(ref, ids, 30, forcing(5, close))))
    budget = chat(srv, thinking_budget=5)
    assert pair(budget) == closed_at_5
    assert budget["choices"][0]["thinking_budget_forced_at"] == 5
    # An end of turn drawn at step 5 becomes the same close (one more draw counted).
    eos = min(ref.eos_token_ids)
    redirected = chat(srv, [None] * 5 + [eos], max_tokens=31)
    assert pair(redirected) == closed_at_5
    # A token repeated 16 times: the 16th is taken back and banned for that step.
    [token] = ref.encode(" no", add_special_tokens=False)[:1]
    looped = chat(srv, [token] * 20)
    biases = {i: {token: FORCE} for i in range(15)} | {15: {token: -FORCE}}
    assert pair(looped) == split(texts(ref, reference(ref, ids, 29, biases)))
    assert looped["usage"]["completion_tokens_details"]["rewound_tokens"] == 1


def test_rewound_rows_share_llama_cpp_batches_with_others(srv: RunningServer, ref: Any) -> None:
    eos = min(ref.eos_token_ids)
    cases: list[tuple[list[int | None] | None, dict[str, Any]]] = [
        ([None] * 5 + [eos], {"max_tokens": 31}),
        (None, {"thinking_budget": 4}),
        (None, {"messages": [{"role": "user", "content": "Count to ten."}]}),
        (None, {"chat_template_kwargs": {"enable_thinking": False}}),
    ]
    solo = [pair(chat(srv, script, **body)) for script, body in cases]
    with concurrent.futures.ThreadPoolExecutor(len(cases) * 2) as pool:
        together = [pair(f.result()) for f in [pool.submit(chat, srv, script, **body) for script, body in cases * 2]]
    assert together == solo * 2
