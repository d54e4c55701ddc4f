"""Offline GGUF test models: write a Hugging Face Llama checkpoint (such as the tiny test
model of :mod:`millm_engines.transformers.testing`) as an f32 GGUF file with
``gguf.GGUFWriter``, the way llama.cpp's own converter lays it out.

Two details matter. llama.cpp applies rotary embeddings to interleaved pairs while HF
rotates halves, so the q and k projections are permuted (as ``convert_hf_to_gguf.py``
does). And a freshly trained byte-level BPE vocabulary is declared with the ``gpt-2``
pre-tokenizer, which is the split a ByteLevel pre-tokenizer performs.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np

GGUF_VERSION = "gguf-v1"


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _tokenizer(writer: Any, hf_dir: str) -> None:
    import gguf

    with open(os.path.join(hf_dir, "tokenizer.json")) as fh:
        spec = json.load(fh)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as fh:
        config = json.load(fh)
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special: dict[str, bool] = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["content"]] = bool(added.get("special"))
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "vocabulary ids must be dense"
    tokens = [t for t, _ in by_id]
    types = [
        (gguf.TokenType.CONTROL if special[t] else gguf.TokenType.USER_DEFINED) if t in special else gguf.TokenType.NORMAL for t in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id)):
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if token in vocab:
            add(vocab[token])
    post = spec.get("post_processor") or {}
    writer.add_add_bos_token(post.get("type") == "TemplateProcessing" and any("SpecialToken" in p for p in post.get("single", [])))
    writer.add_add_eos_token(False)
    template = config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(hf_dir, "chat_template.jinja")):
        with open(os.path.join(hf_dir, "chat_template.jinja")) as fh:
            template = fh.read()
    if template:
        writer.add_chat_template(template)


def write_gguf(hf_dir: str, out_path: str, name: str = "tiny", quantization: str = "F32") -> str:
    """Write ``hf_dir`` (a ``LlamaForCausalLM`` checkpoint) to ``out_path`` as GGUF: f32,
    or with its matrices in Q8_0 (``quantization="Q8_0"``; norms stay f32, as llama.cpp's
    quantizer leaves them)."""
    import gguf

    if quantization not in ("F32", "Q8_0"):
        raise ValueError(f"quantization {quantization!r}: F32 or Q8_0")
    q8 = quantization == "Q8_0"
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as fh:
        cfg = json.load(fh)
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    _tokenizer(writer, hf_dir)

    def tensor(gguf_name: str, hf_name: str, permute_heads: int | None = None) -> None:
        array = weights[hf_name].astype(np.float32)
        array = _permute(array, permute_heads) if permute_heads else array
        if q8 and array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)

    tensor("token_embd.weight", "model.embed_tokens.weight")
    tensor("output_norm.weight", "model.norm.weight")
    tensor("output.weight", "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight")
    for i in range(cfg["num_hidden_layers"]):
        hf, blk = f"model.layers.{i}", f"blk.{i}"
        tensor(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight")
        tensor(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", heads)
        tensor(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", kv_heads)
        tensor(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight")
        tensor(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight")
        tensor(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight")
        tensor(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight")
        tensor(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight")
        tensor(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def tiny_gguf(hf_dir: str, root: str | None = None, file_name: str = "tiny.F32.gguf", quantization: str = "F32") -> str:
    """The tiny model as GGUF (f32, or Q8_0 matrices), cached beside the HF test models and
    rebuilt when missing."""
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "millm", "test-models", GGUF_VERSION)
    target = os.path.join(root, os.path.basename(os.path.normpath(hf_dir)), file_name)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    handle, staging = tempfile.mkstemp(suffix=".gguf", dir=os.path.dirname(target))
    os.close(handle)
    try:
        write_gguf(hf_dir, staging, quantization=quantization)
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target


FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}  # llama_ftype values


def requantized(source: str, tag: str, root: str | None = None) -> str:
    """``source`` (a GGUF file) quantized again to ``tag`` by llama.cpp's own quantizer,
    cached beside the test models: another real quantization of a real model, offline."""
    import llama_cpp as L

    root = root or os.path.join(os.path.expanduser("~"), ".cache", "millm", "test-models", GGUF_VERSION, "requantized")
    stem = os.path.basename(source).split(".")[0]
    target = os.path.join(root, f"{stem}.{tag}.gguf")
    if os.path.isfile(target):
        return target
    os.makedirs(root, exist_ok=True)
    handle, staging = tempfile.mkstemp(suffix=".gguf", dir=root)
    os.close(handle)
    try:
        params = L.llama_model_quantize_default_params()
        params.ftype = FILE_TYPES[tag]
        params.allow_requantize = True
        if L.llama_model_quantize(source.encode(), staging.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {source} to {tag}")
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return target
