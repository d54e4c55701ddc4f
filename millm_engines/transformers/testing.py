"""Offline test models for the transformers engine, reusable by plugin authors: a tiny
Llama-architecture checkpoint (or a Qwen2 one, for the generic HF forward) with a freshly
trained byte-level BPE tokenizer, built in seconds from local text (the interpreter's own
standard library) and cached on disk.

The weights are random (fixed seed): outputs are meaningless but deterministic, which is
what tests of serving mechanics need. torch and transformers are imported inside the
builder only.

This module is also a pytest plugin (entry point ``millm_transformers =
"millm_engines.transformers.testing"`` in the ``pytest11`` group): its fixture
``millm_tiny_model`` is the tiny model loaded once per session.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from typing import TYPE_CHECKING, Any, cast

import pytest

if TYPE_CHECKING:
    from millm_core.api import ServedModel

TINY_VERSION = "tiny-llama-v1"
BOS, EOS, PAD = "<s>", "<|im_end|>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, "</s>", "<|im_start|>", EOS]
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS_FILES = ("textwrap.py", "string.py", "json/decoder.py", "json/encoder.py", "argparse.py", "difflib.py")


def _corpus() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    texts: list[str] = []
    for rel in _CORPUS_FILES:
        path = os.path.join(stdlib, rel)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
    texts.append("The capital of France is Paris. Héllo wörld — naïve café 東京 🙂\n" * 20)
    return texts


def build_tokenizer(vocab_size: int = 1024) -> Any:  # a PreTrainedTokenizerFast
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # The tokenizer's own rule adds a BOS, as Llama-style tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def build_tiny_model(
    path: str,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    context: int = 512,
    chat_template: bool = True,
    seed: int = 0,
    architecture: str = "llama",
    sliding_window: int | None = None,
) -> str:
    """Write a tiny checkpoint (config, safetensors, tokenizer) to ``path``: a Llama, or
    with ``architecture="qwen2"`` a Qwen2 (biased q/k/v projections; no lean decode step),
    whose last layer uses a sliding window of ``sliding_window`` tokens when one is given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: Any
    if architecture == "llama":
        if sliding_window is not None:
            raise ValueError("the tiny Llama has no sliding window")
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif architecture == "qwen2":
        window: dict[str, Any] = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=layers - 1) if sliding_window else {}
        model = Qwen2ForCausalLM(Qwen2Config(**common, **window))
    else:
        raise ValueError(f"no tiny {architecture!r} builder (llama, qwen2)")
    # Larger weights than the default init give peaked, varied next-token distributions,
    # so greedy text is not one token repeated.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.35)
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_model_dir(
    root: str | None = None, *, chat_template: bool = True, context: int = 512, architecture: str = "llama", sliding_window: int | None = None
) -> str:
    """The cached tiny model directory, built once (atomically) if missing. ``context``
    other than 512 gives the same weights with a longer window (tool prompts are long);
    ``architecture`` and ``sliding_window`` as for :func:`build_tiny_model`."""
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "millm", "test-models")
    base = TINY_VERSION if architecture == "llama" else f"tiny-{architecture}-v1" + (f"-sw{sliding_window}" if sliding_window else "")
    name = base + ("" if chat_template else "-no-template") + ("" if context == 512 else f"-ctx{context}")
    target = os.path.join(root, name)
    marker = os.path.join(target, "millm_source.json")
    if os.path.isfile(marker):
        return target
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        build_tiny_model(staging, chat_template=chat_template, context=context, architecture=architecture, sliding_window=sliding_window)
        with open(os.path.join(staging, "millm_source.json"), "w") as fh:
            json.dump({"revision": name, "quantization": "none"}, fh)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_tiny_model(path: str | None = None, served_name: str = "tiny") -> ServedModel:
    """The tiny model (built by :func:`tiny_model_dir` unless ``path`` is given) loaded on
    the transformers engine with default settings, served as ``served_name``."""
    from millm_core.api import Engine, ModelLocation, ServedModel, Settings, local_revision

    from .loader import load_engine

    path = path or tiny_model_dir()
    location = ModelLocation(path=path, served_name=served_name, revision=local_revision(path))
    engine = load_engine(location, Settings(log_level="warning"))
    # mypy cannot see that an engine with its own batch type is an Engine.
    return ServedModel(info=engine.info, engine=cast("Engine", engine))


@pytest.fixture(scope="session")
def millm_tiny_model() -> ServedModel:
    """The tiny Llama-architecture model (random weights, byte-level BPE tokenizer, ChatML
    template), built once and cached under ``~/.cache/millm/test-models``, loaded once per
    session on the transformers engine and served as ``tiny``. Pass it to
    ``millm_server_factory`` or drive ``millm_tiny_model.engine`` directly."""
    return load_tiny_model()
