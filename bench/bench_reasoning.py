"""The cost of the reasoning plugin per token on SmolLM2-135M, in one run: decode tok/s of
greedy requests on SmolLM2 served with a reasoning template (examples/templates/
smollm2-think.jinja: every generated token is reasoning, so the row owner, its hold-back
and the loop guard's detector run at every step) against the same requests on the same
loaded model served without the reasoning plugin, alone and 8 at once (target: <= 5 %
slower). Runs alternate and medians are compared.

Usage: python bench/bench_reasoning.py [--tokens 128] [--requests 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import aggregate_rate, save_results, smollm2_dir, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "templates", "smollm2-think.jinja")
PROMPTS = ["Write about the sea.", "Describe a market.", "Explain bread.", "A letter home.", "A village history.", "How violins are made.", "A robot painter.", "Why sunsets are red."]


def chat(base_url: str, prompt: str, tokens: int, reasoning: bool) -> int:
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    response = CLIENT.post(base_url + "/v1/chat/completions", json=body, timeout=600)
    reply = response.json()
    assert ("x-millm-reasoning" in response.headers) == reasoning, response.headers
    return int(reply["usage"]["completion_tokens"])


def rate(base_url: str, n: int, tokens: int, reasoning: bool) -> float:
    """Aggregate generated tokens per second of ``n`` requests sent at once."""
    return aggregate_rate(lambda i: chat(base_url, PROMPTS[i % len(PROMPTS)], tokens, reasoning), n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with_plugin = load_settings({"log_level": "warning", "db": ":memory:", "chat_template": TEMPLATE}, environ={})
    without = load_settings({"log_level": "warning", "db": ":memory:", "chat_template": TEMPLATE, "block_plugins": ("reasoning",)}, environ={})
    engine = load_engine(ModelLocation(path=smollm2_dir(), served_name="bench"), with_plugin)

    def loader() -> ServedModel:
        return ServedModel(info=engine.info, engine=engine)

    single: dict[str, list[float]] = {"plain": [], "reasoning": []}
    batch: dict[str, list[float]] = {"plain": [], "reasoning": []}
    apps = {True: create_app(with_plugin, host=build_host(with_plugin), loader=loader), False: create_app(without, host=build_host(without), loader=loader)}
    with RunningServer(apps[True]) as on, RunningServer(apps[False]) as off:
        wait_loaded(apps[True])
        wait_loaded(apps[False])
        urls = {True: on.base_url, False: off.base_url}
        for reasoning in (True, False):
            chat(urls[reasoning], PROMPTS[0], 4, reasoning)  # warm-up
        for repeat in range(args.repeats):
            for reasoning in (False, True) if repeat % 2 == 0 else (True, False):
                key = "reasoning" if reasoning else "plain"
                single[key].append(rate(urls[reasoning], 1, args.tokens, reasoning))
                batch[key].append(rate(urls[reasoning], args.requests, args.tokens, reasoning))
    one = {k: statistics.median(v) for k, v in single.items()}
    many = {k: statistics.median(v) for k, v in batch.items()}
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (auto dtype), examples/templates/smollm2-think.jinja",
        "tokens": args.tokens,
        "requests": args.requests,
        "single_tok_per_s": one,
        "single_ratio": one["reasoning"] / one["plain"],
        "aggregate_tok_per_s": many,
        "aggregate_ratio": many["reasoning"] / many["plain"],
        "samples": {"single": single, "batch": batch},
    }
    print(json.dumps(report))
    print(
        f"\none request: {one['plain']:.1f} tok/s without the plugin, {one['reasoning']:.1f} tok/s reasoning -> {report['single_ratio']:.3f}x\n"
        f"{args.requests} at once: {many['plain']:.1f} tok/s without, {many['reasoning']:.1f} tok/s reasoning "
        f"-> {report['aggregate_ratio']:.3f}x (target >= 0.95x)"
    )
    save_results("reasoning.json", [report])


if __name__ == "__main__":
    main()
