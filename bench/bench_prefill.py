"""What prefilling prompts together gains, and what keeping each prompt's numbers its own
costs, on the transformers engine's lean prefill (millm_engines.transformers.leanprefill).

SmolLM2-135M-Instruct in bfloat16, engine-level (no HTTP), ``--prompts`` (8) chat prompts
of different lengths, prefilled four ways on the same loaded model, alternating, medians of
``--repeats``:
  - hf_alone: each prompt alone through HF's forward, one after another (what the engine
    did before the lean prefill; what it still does where the lean prefill's load check
    fails);
  - lean_alone: each prompt alone through the lean prefill;
  - lean_shared: all prompts in the lean prefill's shared passes (what requests arriving
    together get now);
  - hf_padded: all prompts in one left-padded HF forward pass (what a server that batches
    prefill without invariance does; each prompt's numbers then depend on the others).
It checks that every prompt's logits, keys and values from lean_shared equal lean_alone's
bit for bit (the invariance), and reports lean_shared against hf_alone (the gain) and
against hf_padded (the cost of invariance; issue #15 asks for under 15 %).

Usage: python bench/bench_prefill.py [--repeats 5] [--prompts 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from bench_decode import save_results, smollm2_dir  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_engines.transformers.leanprefill import LeanPrefill, Prompt  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_engines.transformers.settings import FAST_DECODE, PREFIX_CACHE_MB  # noqa: E402

QUESTIONS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain step by step.", "Write a haiku about autumn leaves.",
             "List three colours and one thing of each colour.", "Why is the sky blue?",
             "Say hello in French and in German.", "ok"]  # fmt: skip


def hf_alone(model: Any, prompts: list[list[int]]) -> None:
    with torch.inference_mode():
        for prompt in prompts:
            model(input_ids=torch.tensor([prompt]), cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)


def hf_padded(model: Any, prompts: list[list[int]], pad: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt) :] = torch.tensor(prompt)
        mask[r, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)


def lean_alone(lean: LeanPrefill, prompts: list[list[int]]) -> list[Prompt]:
    done = [Prompt(p) for p in prompts]
    for prompt in done:
        lean.run([prompt])
    return done


def lean_shared(lean: LeanPrefill, prompts: list[list[int]]) -> list[Prompt]:
    done = [Prompt(p) for p in prompts]
    lean.run(done)
    return done


def same(a: list[Prompt], b: list[Prompt]) -> bool:
    return all(
        x.logits is not None
        and y.logits is not None
        and torch.equal(x.logits, y.logits)
        and all(torch.equal(s, t) for s, t in zip([*x.keys, *x.values], [*y.keys, *y.values], strict=True))
        for x, y in zip(a, b, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    configure_logging("console", "warning")
    settings = load_settings({"dtype": "bfloat16", "prefix_cache_mb": 0}, environ={}, plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB])
    engine = load_engine(ModelLocation(path=smollm2_dir(), served_name="bench"), settings)
    if engine.lean is None:
        print(f"the lean prefill is off on this machine: {engine.lean_refusal}")
        save_results("prefill.json", [{"available": False, "refusal": engine.lean_refusal}])
        return
    lean, model = engine.lean, engine.model
    texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    prompts = [list(engine.render_chat([{"role": "user", "content": t}])) for t in texts]
    variants: dict[str, Callable[[], object]] = {
        "hf_alone": lambda: hf_alone(model, prompts),
        "lean_alone": lambda: lean_alone(lean, prompts),
        "lean_shared": lambda: lean_shared(lean, prompts),
        "hf_padded": lambda: hf_padded(model, prompts, engine._pad_id),
    }
    for run in variants.values():
        run()  # warm up
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    ms = {name: statistics.median(s) * 1000 for name, s in samples.items()}
    invariant = same(lean_alone(lean, prompts), lean_shared(lean, prompts))
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, medians of {args.repeats}, rows block {lean.block}")
    for name in variants:
        print(f"  {name:12s} {ms[name]:7.1f} ms")
    gain, cost = ms["hf_alone"] / ms["lean_shared"], ms["lean_shared"] / ms["hf_padded"]
    print(f"shared passes vs HF one at a time: {gain:.2f}x faster; vs one padded HF pass (not invariant): {cost:.2f}x the time")
    print(f"every prompt's logits, keys and values in shared passes equal its prefill alone: {invariant}")
    save_results("prefill.json", [{"available": True, "prompt_tokens": lengths, "block": lean.block, "ms": ms, "samples_s": samples,
                                   "gain_vs_hf_alone": gain, "cost_vs_hf_padded": cost, "invariant": invariant}])  # fmt: skip


if __name__ == "__main__":
    main()
