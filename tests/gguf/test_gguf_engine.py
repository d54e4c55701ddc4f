"""The GGUF engine against the transformers engine on the same f32 weights, and the
file writer against llama.cpp's own reading of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from millm_core.engine import RowSpec, SamplingParams
from millm_engines.gguf.llama import Piece

PROMPTS = ["The capital of France is", "def main():\n    return", "Héllo wörld 東京 🙂"]


def greedy(engine: Any, ids: list[int], n: int) -> list[int]:
    batch = engine.open_batch([RowSpec(prompt_ids=tuple(ids), sampling=SamplingParams(temperature=0.0), max_new_tokens=n)])
    try:
        return [engine.step(batch, [None])[0] for _ in range(n)]
    finally:
        engine.close(batch)


def test_file_matches_the_hf_weights(gguf_model, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    engine = gguf_model.engine
    assert (gguf_model.info.engine, gguf_model.info.quantization, gguf_model.info.served_name) == ("gguf", "F32", "tiny:F32")
    for text in PROMPTS:
        ids = tiny_engine.encode(text, add_special_tokens=True)
        assert engine.encode(text, add_special_tokens=True) == ids  # the same tokenizer, BOS rule included
        [logits] = engine.llm.decode([Piece(t, 0, p, p == len(ids) - 1) for p, t in enumerate(ids)])
        engine.llm.forget(0)
        with torch.no_grad():
            reference = tiny_engine.model(torch.tensor([ids])).logits[0, -1].float().numpy()
        np.testing.assert_allclose(logits, reference, atol=2e-3, rtol=0)


def test_greedy_text_equals_the_transformers_engine(gguf_model, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    for text in PROMPTS:
        ids = tiny_engine.encode(text, add_special_tokens=True)
        assert greedy(gguf_model.engine, ids, 24) == greedy(tiny_engine, ids, 24)


def test_chat_render_follows_the_bos_rule(gguf_model, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_start|>"}]
    assert gguf_model.engine.render_chat(messages) == tiny_engine.render_chat(messages)
    ids = gguf_model.engine.render_chat(messages)
    assert ids.count(tiny_engine.tokenizer.bos_token_id) == 1  # the template writes the BOS; none is added


def test_rows_joining_a_running_batch_get_what_they_get_alone(gguf_model, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    engine = gguf_model.engine
    prompts = [tiny_engine.encode(t, add_special_tokens=True) for t in PROMPTS]
    alone = [greedy(engine, ids, 12) for ids in prompts]
    batch = engine.open_batch([RowSpec(prompt_ids=tuple(prompts[0]), sampling=SamplingParams(temperature=0.0), max_new_tokens=12)])
    got: list[list[int]] = [[]]
    for step in range(3 + 12):
        if step == 3:  # two rows join mid-generation; their prompts prefill beside a decode
            engine.join(batch, [RowSpec(prompt_ids=tuple(p), sampling=SamplingParams(temperature=0.0), max_new_tokens=12) for p in prompts[1:]])
            got += [[], []]
        tokens = engine.step(batch, [None] * len(got))
        for row, token in zip(got, tokens, strict=True):
            row.append(token)
        if step == 11:  # the first row is done: drop it
            engine.retain(batch, [1, 2])
            finished = got.pop(0)
            assert finished == alone[0]
    engine.close(batch)
    assert got == alone[1:]


def test_a_rewind_frees_the_rows_kv_cells(gguf_model, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    """A rewound row's sequence keeps the cache positions before the re-fed token only (all
    of them freed when it goes back to its prompt, which the next step runs again); the
    sequence stays the row's until the batch closes."""
    import llama_cpp as L

    engine = gguf_model.engine
    ids = tiny_engine.encode(PROMPTS[0], add_special_tokens=True)
    free = list(engine._free_seqs)
    batch = engine.open_batch([RowSpec(prompt_ids=tuple(ids), sampling=SamplingParams(temperature=0.0), max_new_tokens=12)])
    seq = batch.rows[0].seq

    def last_position() -> int:
        return int(L.llama_memory_seq_pos_max(engine.llm.memory, seq))

    try:
        for _ in range(8):
            engine.step(batch, [None])
        assert last_position() == len(ids) + 6  # the prompt and 7 of the 8 draws were fed
        engine.rewind(batch, 0, 3)
        assert last_position() == len(ids) + 3  # the 5th draw is fed again at len(ids) + 4
        engine.rewind(batch, 0, 5)
        assert last_position() == -1
        assert seq not in engine._free_seqs
        engine.step(batch, [None])
        assert last_position() == len(ids) - 1
    finally:
        engine.close(batch)
    assert engine._free_seqs == free


def test_dtype_other_than_auto_is_refused_not_ignored(gguf_path: str) -> None:
    """A GGUF file's precision is its quantization: --dtype cannot be honoured, so it is
    refused at load instead of being silently dropped."""
    import pytest

    from millm_core.errors import ConfigError

    from .helpers import load_gguf

    with pytest.raises(ConfigError, match="--dtype bfloat16 cannot apply to a GGUF model"):
        load_gguf(gguf_path, dtype="bfloat16")


def test_the_kv_cache_is_a_stream_per_sequence_and_the_preflight_counts_it(gguf_path: str, tiny_dir: str) -> None:
    """Each of the 8 sequences gets the model's whole context (the cache is far below the
    2 GiB default budget), and the memory a load needs counts that cache: f32 keys and
    values of every layer's KV heads, from the HF config the file was written from."""
    import json
    import os

    from millm_core.config import load_settings
    from millm_core.engine import ModelLocation
    from millm_core.plugins import PluginHost
    from millm_engines.gguf.plugin import _preflight

    from .helpers import load_gguf

    with open(os.path.join(tiny_dir, "config.json")) as fh:
        cfg = json.load(fh)
    cell = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 4  # keys and values, f32
    context = cfg["max_position_embeddings"]
    model = load_gguf(gguf_path)
    try:
        assert model.info.context_length == context and model.engine.cells_per_seq == context
        assert model.engine.llm.n_cells == 8 * context
    finally:
        model.engine.llm.close()
    settings = load_settings({}, environ={}, plugin_settings=PluginHost.declared_settings())
    plan = _preflight(ModelLocation(path=gguf_path, served_name="x"), settings)
    assert plan.need["cpu"] == os.path.getsize(gguf_path) + 8 * context * cell
    # --gguf-kv-cells shares the cells equally; a stream shorter than the context serves less
    short = load_gguf(gguf_path, gguf_kv_cells=8 * 256)
    try:
        assert short.info.context_length == 256 and short.engine.cells_per_seq == 256 == short.engine.llm.n_cells // 8
    finally:
        short.engine.llm.close()
