"""``usage.prompt_tokens_details.cached_tokens`` over HTTP, with the openai SDK: a request
that repeats a long system prompt resumes its prefill from the cached prefix, says how
much, and answers with the same text as without it.

The expected counts are computed here from the tokenizer's own prompt ids: the whole
chunks (``CHUNK`` tokens) of the prefix two prompts share, leaving the last prompt token
to compute. Each test uses a system prompt no other test sends."""

from __future__ import annotations

import sysconfig
from typing import Any

import httpx
import openai

from millm_engines.transformers.prefix import CHUNK

from .helpers import chat_ids, json_frames


def _long_text(name: str, chars: int = 900) -> str:
    with open(f"{sysconfig.get_paths()['stdlib']}/{name}", encoding="utf-8") as fh:
        return fh.read()[:chars]


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _resumable(prompt: list[int], cached: list[int]) -> int:
    return min(_shared(prompt, cached), len(prompt) - 1) // CHUNK * CHUNK


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12, **extra)


def test_a_repeated_system_prompt_reports_cached_tokens_and_the_same_text(client: openai.OpenAI, tiny_engine: Any) -> None:
    system = {"role": "system", "content": _long_text("difflib.py")}
    first = [system, {"role": "user", "content": "Summarise the module."}]
    second = [system, {"role": "user", "content": "What does SequenceMatcher do?"}]
    ids_first, ids_second = chat_ids(tiny_engine, first), chat_ids(tiny_engine, second)
    assert _resumable(ids_second, ids_first) >= 2 * CHUNK  # a long shared system prompt

    cold = _chat(client, first)
    assert cold.usage.prompt_tokens == len(ids_first)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    other = _chat(client, second)
    assert other.usage.prompt_tokens_details.cached_tokens == _resumable(ids_second, ids_first)
    again = _chat(client, first)
    assert again.usage.prompt_tokens_details.cached_tokens == _resumable(ids_first, ids_first)
    assert again.choices[0].message.content == cold.choices[0].message.content

    stream = _chat(client, second, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == _resumable(ids_second, ids_second)
    assert text == other.choices[0].message.content


def test_text_completions_report_cached_tokens(server: Any, tiny_engine: Any) -> None:
    head = _long_text("argparse.py")
    url = server.base_url + "/v1/completions"
    ask = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    first = httpx.post(url, json={**ask, "prompt": head + "\n# one"}).json()
    second = httpx.post(url, json={**ask, "prompt": head + "\n# two"}).json()
    ids_first = tiny_engine.encode(head + "\n# one", add_special_tokens=True)
    ids_second = tiny_engine.encode(head + "\n# two", add_special_tokens=True)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": _resumable(ids_second, ids_first)}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    raw = httpx.post(url, json={**ask, "prompt": head + "\n# one", "stream": True}).content
    (usage,) = [f["usage"] for f in json_frames(raw) if f.get("usage")]
    assert usage["prompt_tokens_details"] == {"cached_tokens": _resumable(ids_first, ids_first)}


def test_every_choice_must_have_resumed_for_its_prompt_to_count(client: openai.OpenAI, tiny_engine: Any) -> None:
    """With ``n: 2`` a fresh prompt is prefilled by its first row and resumed by the second:
    the prompt counts once in ``prompt_tokens``, and as cached only when every row of it
    resumed."""
    messages = [{"role": "system", "content": _long_text("string.py")}, {"role": "user", "content": "Hi."}]
    ids = chat_ids(tiny_engine, messages)
    fresh = _chat(client, messages, n=2)
    again = _chat(client, messages, n=2)
    assert fresh.usage.prompt_tokens == again.usage.prompt_tokens == len(ids)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == _resumable(ids, ids) > 0
    assert [c.message.content for c in again.choices] == [c.message.content for c in fresh.choices]


def test_a_short_prompt_reports_zero_cached_tokens(client: openai.OpenAI) -> None:
    resp = _chat(client, [{"role": "user", "content": "Hello there."}])
    assert resp.usage.prompt_tokens_details is not None and resp.usage.prompt_tokens_details.cached_tokens == 0
