"""The extension points structured output and function calling are built on, used by
small third-party-style plugins on real servers: ``millm_render_chat``, a processor's
``allowed_tokens`` mask (on both engines) and its ``end`` → ``RowEnd``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from millm_core.api import ChatRender, ForwardPlan, RequestContext, RowEnd, RowInfo, ServedModel, hookimpl
from millm_core.config import load_settings
from millm_core.server.app import build_host

MESSAGES = [{"role": "user", "content": "hello there", "name": "ann"}]
VOWELS = "aeiou"


class PiratePlugin:
    """Adds a system message to every chat and renders the user's ``name``."""

    @hookimpl
    def millm_render_chat(self, ctx: RequestContext, request: Any, model: ServedModel, chat: ChatRender) -> None:
        chat.messages.insert(0, {"role": "system", "content": "Answer like a pirate."})
        for target, message in zip(chat.messages[1:], request.messages, strict=True):
            if isinstance(message.name, str):
                target["content"] = f"{message.name}: {target['content']}"
        chat.rendered_fields.add("name")


class Vowels:
    """Lets its row draw only the single-character vowel tokens (and EOS)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.seen: list[int] = []

    def logit_bias(self) -> None:
        return None

    def allowed_tokens(self) -> list[int]:
        return self.allowed

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        return text, False

    def flush(self) -> str:
        return ""

    def end(self, finish_reason: str) -> RowEnd:
        return RowEnd(fields={"tool_calls": [{"index": 0, "id": "call_v", "type": "function", "function": {"name": "vowels", "arguments": "{}"}}]}, finish_reason="tool_calls")


class VowelPlugin:
    def __init__(self) -> None:
        self.allowed: list[int] = []

    @hookimpl
    def millm_pre_forward(self, ctx: RequestContext, request: Any, plan: ForwardPlan) -> None:
        if ctx.headers.get("x-vowels") != "1" or ctx.model is None:
            return
        engine = ctx.model.engine
        ids = {i for ch in VOWELS for i in engine.encode(ch, add_special_tokens=False)[:1] if engine.decode([i]) == ch}
        allowed = sorted(ids | set(engine.eos_token_ids))

        def make(_row: RowInfo) -> Vowels:
            return Vowels(allowed)

        plan.add_processor(make)


def _host(*plugins: object) -> Any:
    host = build_host(load_settings(environ={}))
    for index, plugin in enumerate(plugins):
        host.register(plugin, f"test-{index}")
    return host


def test_render_chat_changes_the_prompt_and_marks_what_it_rendered(make_server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    with make_server() as plain_srv:
        plain = httpx.post(plain_srv.base_url + "/v1/chat/completions", json=body)
    with make_server(host=_host(PiratePlugin())) as srv:
        pirate = httpx.post(srv.base_url + "/v1/chat/completions", json=body)
    assert plain.headers["x-millm-ignored-fields"] == '"messages[0].name"'
    assert "x-millm-ignored-fields" not in pirate.headers  # the plugin rendered it
    # The system turn and the name are in the prompt.
    assert pirate.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 5


@pytest.mark.parametrize("engine", ["transformers", "gguf"])
def test_a_mask_confines_every_draw_and_end_shapes_the_choice(make_server, tiny_model, gguf_model, engine: str) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model if engine == "transformers" else gguf_model
    # (GGUF takes no seed yet: its draws are fresh, and 16 of them still leave the vowels.)
    seed = {"seed": 3} if engine == "transformers" else {}
    body = {"model": model.info.served_name, "messages": [{"role": "user", "content": "spell"}], "max_tokens": 16, "temperature": 1.0, **seed}
    with make_server(host=_host(VowelPlugin()), models=[model]) as srv:
        free = httpx.post(srv.base_url + "/v1/chat/completions", json=body).json()["choices"][0]
        masked = httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers={"X-Vowels": "1"}).json()["choices"][0]
    assert set(free["message"]["content"]) - set(VOWELS)  # unmasked, the model writes other characters
    text = masked["message"]["content"] or ""
    assert set(text) <= set(VOWELS)
    assert masked["finish_reason"] == "tool_calls"
    assert masked["message"]["tool_calls"] == [{"id": "call_v", "type": "function", "function": {"name": "vowels", "arguments": "{}"}}]
    if not text:
        assert masked["message"]["content"] is None
