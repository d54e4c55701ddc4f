"""Concurrent requests on the transformers engine: the same N greedy completions sent one
after another, then all at once, through the HTTP server, in one run.

With continuous batching, requests that arrive while others generate join the running
batch, so N at once should finish well before N one after another. The ratio printed is
aggregate tok/s (all at once) over aggregate tok/s (one after another); EOS is disabled, so
every request generates exactly ``--tokens`` tokens. Runs alternate, medians are compared.

Usage: python bench/bench_concurrency.py [--requests 8] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import bench_model_dir, save_results, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

PROMPTS = ["Write about the sea.", "Describe a market.", "Explain bread.", "A letter home.", "A village history.", "How violins are made.", "A robot painter.", "Why sunsets are red."]


def complete(base_url: str, prompt: str, tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    return int(CLIENT.post(base_url + "/v1/completions", json=body, timeout=600).json()["usage"]["completion_tokens"])


def one_after_another(base_url: str, n: int, tokens: int) -> float:
    started = time.perf_counter()
    total = sum(complete(base_url, PROMPTS[i % len(PROMPTS)], tokens) for i in range(n))
    return total / (time.perf_counter() - started)


def all_at_once(base_url: str, n: int, tokens: int) -> float:
    counts = [0] * n
    threads = [threading.Thread(target=lambda i=i: counts.__setitem__(i, complete(base_url, PROMPTS[i % len(PROMPTS)], tokens))) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=bench_model_dir(), served_name="bench"), settings)
        engine.eos_token_ids = frozenset()  # every request generates exactly --tokens tokens
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    results: dict[str, list[float]] = {"one_after_another": [], "all_at_once": []}
    with RunningServer(app) as server:
        wait_loaded(app)
        complete(server.base_url, PROMPTS[0], 4)  # warm-up
        for repeat in range(args.repeats):
            order = ("one_after_another", "all_at_once") if repeat % 2 == 0 else ("all_at_once", "one_after_another")
            for mode in order:
                run = one_after_another if mode == "one_after_another" else all_at_once
                results[mode].append(run(server.base_url, args.requests, args.tokens))
    medians = {mode: statistics.median(v) for mode, v in results.items()}
    report: dict[str, Any] = {
        "model": "bench (22M, float32)",
        "requests": args.requests,
        "tokens": args.tokens,
        "tok_per_s": medians,
        "samples": results,
        "ratio": medians["all_at_once"] / medians["one_after_another"],
    }
    print(json.dumps(report))
    print(
        f"\n{args.requests} requests x {args.tokens} tokens: one after another {medians['one_after_another']:.1f} tok/s, "
        f"all at once {medians['all_at_once']:.1f} tok/s -> {report['ratio']:.2f}x"
    )
    save_results("concurrency.json", [report])


if __name__ == "__main__":
    main()
