"""How much memory a request's rows need on this engine, estimated before they run, so
admission can refuse with ``503 insufficient_memory`` instead of the kernel killing the
server mid-step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PretrainedConfig

from millm_core.api import host_available_bytes

# Headroom the estimate keeps free for everything else (the allocator, other requests'
# growth, Python objects).
HEADROOM_BYTES = 256 * 2**20
# The estimate covers the KV cache, the prefill activations and the logits; a factor for
# what it does not model (temporaries, fragmentation).
SAFETY = 1.5


def available_bytes(device: torch.device) -> int:
    """Memory still usable on ``device``: free CUDA memory, else MemAvailable (Linux)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def rows_bytes(config: PretrainedConfig, dtype: torch.dtype, prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """Bytes the rows need: their KV cache at full length, the widest prefill's
    activations and attention scores, and a float32 logits row each."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    vocab = int(text.vocab_size)
    width = torch.tensor([], dtype=dtype).element_size()
    rows = len(prompt_lengths)
    tokens = sum(prompt_lengths) + rows * max_new_tokens
    kv = 2 * layers * kv_heads * head_dim * width * tokens
    longest = max(prompt_lengths, default=0)
    prefill = rows * longest * (4 * hidden + 2 * inter) * width + rows * heads * longest * longest * 4
    logits = rows * vocab * 4 * 2
    return int(SAFETY * (kv + prefill + logits))


def shortfall(
    config: PretrainedConfig, dtype: torch.dtype, device: torch.device, prompt_lengths: Sequence[int], max_new_tokens: int,
    probe: Callable[[torch.device], int] = available_bytes, admitted: Sequence[tuple[int, int]] = (),
) -> str | None:  # fmt: skip
    """None when the rows fit in what ``device`` has free now, less what the rows admitted
    before them may still take; else the refusal's reason. An admitted row counts at its
    full need (its KV cache at full length): conservative for running rows, whose
    allocated part the probe already sees, and exact for queued ones, which the probe
    cannot see at all."""
    need = rows_bytes(config, dtype, prompt_lengths, max_new_tokens)
    promised = sum(rows_bytes(config, dtype, [length], budget) for length, budget in admitted)
    free = probe(device)
    if need + promised + HEADROOM_BYTES <= free:
        return None
    beside = f", {promised / 2**20:.0f} MiB of it promised to {len(admitted)} row(s) admitted before" if admitted else ""
    return (
        f"{len(prompt_lengths)} row(s) of up to {max(prompt_lengths, default=0) + max_new_tokens} tokens need about "
        f"{need / 2**20:.0f} MiB on {device}; {free / 2**20:.0f} MiB are available{beside}"
    )
