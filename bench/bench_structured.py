"""Structured output's cost on SmolLM2-135M (its real 49k vocabulary), in one run:

1. the constraint vocabulary: built from scratch, then loaded from the disk cache;
2. per-token rate of one json_schema-constrained request against the same request
   unconstrained (target: constrained time per token ≤ 1.3× unconstrained);
3. 8 concurrent constrained requests against 8 unconstrained, aggregate tok/s (target
   ≥ 0.8×).

The constrained schema is one long free-text string, so that the document stays open for
the whole budget (the cost of the string state is what most JSON tokens pay). Runs
alternate and medians are compared.

Usage: python bench/bench_structured.py [--tokens 48] [--requests 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import save_results, smollm2_dir, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_plugins.structured.vocab import tokenizer_data  # noqa: E402

STORY = {
    "type": "json_schema",
    "json_schema": {"name": "story", "schema": {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}},
}
PROMPTS = ["Write about the sea.", "Describe a market.", "Explain bread.", "A letter home.", "A village history.", "How violins are made.", "A robot painter.", "Why sunsets are red."]


def chat(base_url: str, prompt: str, tokens: int, constrained: bool) -> tuple[int, float]:
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    if constrained:
        body["response_format"] = STORY
    started = time.perf_counter()
    reply = CLIENT.post(base_url + "/v1/chat/completions", json=body, timeout=600).json()
    return int(reply["usage"]["completion_tokens"]), time.perf_counter() - started


def one(base_url: str, tokens: int, constrained: bool) -> float:
    """Seconds per generated token of one request (prefill included, the same for both)."""
    count, seconds = chat(base_url, PROMPTS[0], tokens, constrained)
    return seconds / max(count, 1)


def many(base_url: str, n: int, tokens: int, constrained: bool) -> float:
    counts = [0] * n

    def run(i: int) -> None:
        counts[i] = chat(base_url, PROMPTS[i % len(PROMPTS)], tokens, constrained)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})
    engine = load_engine(ModelLocation(path=smollm2_dir(), served_name="bench"), settings)

    with tempfile.TemporaryDirectory() as cache:
        built = tokenizer_data(engine, Path(cache))
        loaded = tokenizer_data(engine, Path(cache))
    vocab = {"build_s": built.built_s, "cached_load_s": loaded.built_s, "cached": loaded.cached}
    print(f"constraint vocabulary: built in {built.built_s:.2f} s, loaded from the disk cache in {loaded.built_s:.2f} s")

    def loader() -> ServedModel:
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    single: dict[str, list[float]] = {"free": [], "constrained": []}
    batch: dict[str, list[float]] = {"free": [], "constrained": []}
    with RunningServer(app) as server:
        wait_loaded(app)
        while CLIENT.post(  # warm-up: the server builds its own vocabulary first (503 meanwhile)
            server.base_url + "/v1/chat/completions",
            json={"model": "bench", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": STORY},
            timeout=600,
        ).status_code == 503:
            time.sleep(0.5)
        chat(server.base_url, PROMPTS[0], 4, False)
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for constrained in order:
                key = "constrained" if constrained else "free"
                single[key].append(one(server.base_url, args.tokens, constrained))
                batch[key].append(many(server.base_url, args.requests, args.tokens, constrained))
    per_token = {k: statistics.median(v) for k, v in single.items()}
    aggregate = {k: statistics.median(v) for k, v in batch.items()}
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (auto dtype)",
        "tokens": args.tokens,
        "requests": args.requests,
        "vocabulary": vocab,
        "seconds_per_token": per_token,
        "per_token_ratio": per_token["constrained"] / per_token["free"],
        "aggregate_tok_per_s": aggregate,
        "aggregate_ratio": aggregate["constrained"] / aggregate["free"],
        "samples": {"single": single, "batch": batch},
    }
    print(json.dumps(report))
    print(
        f"\none request: {per_token['free'] * 1000:.1f} ms/token free, {per_token['constrained'] * 1000:.1f} ms/token constrained "
        f"-> {report['per_token_ratio']:.2f}x (target <= 1.3x)\n"
        f"{args.requests} at once: {aggregate['free']:.1f} tok/s free, {aggregate['constrained']:.1f} tok/s constrained "
        f"-> {report['aggregate_ratio']:.2f}x (target >= 0.8x)"
    )
    save_results("structured.json", [report])


if __name__ == "__main__":
    main()
