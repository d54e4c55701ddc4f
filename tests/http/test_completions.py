"""/v1/completions: verbatim prompts, lists, add_special_tokens, streaming."""

from __future__ import annotations

import httpx
import openai
import pytest

from .helpers import hf_reference, json_frames


def test_prompt_list_gives_one_choice_per_prompt(client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    prompts = ["import os\n", "The capital of France is"]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    for prompt, choice in zip(prompts, resp.choices):
        ids = tiny_engine.tokenizer(prompt)["input_ids"]  # the tokenizer's own rule: BOS added
        assert (choice.text, choice.finish_reason) == hf_reference(tiny_engine, ids, 10)
    assert resp.usage.prompt_tokens == sum(len(tiny_engine.tokenizer(p)["input_ids"]) for p in prompts)


def test_add_special_tokens_false_drops_the_bos(client, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    with_bos = client.completions.create(model="tiny", prompt="hello world", max_tokens=1)
    without = client.completions.create(model="tiny", prompt="hello world", max_tokens=1, extra_body={"add_special_tokens": False})
    assert with_bos.usage.prompt_tokens == without.usage.prompt_tokens + 1
    raw_ids = tiny_engine.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    greedy = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0, extra_body={"add_special_tokens": False})
    assert greedy.choices[0].text == hf_reference(tiny_engine, raw_ids, 8)[0]


def test_prompt_that_tokenises_to_nothing_is_refused(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=["ok", ""], max_tokens=2, extra_body={"add_special_tokens": False})
    assert info.value.body["param"] == "prompt[1]"


def test_streamed_completion_matches_non_streamed(server, client) -> None:  # type: ignore[no-untyped-def]
    plain = client.completions.create(model="tiny", prompt=["a b c", "def"], max_tokens=12, temperature=0)
    body = {"model": "tiny", "prompt": ["a b c", "def"], "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
        chunks = json_frames(resp.read())
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [c.text for c in plain.choices]
    assert reasons == [c.finish_reason for c in plain.choices]
    final = [c for c in chunks if c["choices"]][-1]
    assert "usage" in final and final["usage"]["prompt_tokens"] == plain.usage.prompt_tokens
