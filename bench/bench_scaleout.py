"""Ray Serve scale-out: aggregate tok/s of the tiny model on 1 replica against 2 replicas
on the same machine, in one run, through Ray Serve's HTTP proxy both times.

Each configuration gets the whole machine: one replica with every core for its model
thread, or two with half the cores each (``--threads``). The same N greedy completions are
sent all at once to each (the same prompts, so the same tokens); the ratio printed is the
2-replica median over the 1-replica median. On 2 cores the point is that it works, not a
gain: Ray's proxy, router and controller share the cores with the replicas. (The tiny
model's steps are mostly Python on one model thread, so two replicas' threads on two cores
still measured about 1.2x here.) On a machine with a GPU or a group of cores for each
replica, the ratio is what scale-out buys.

Usage: python bench/bench_scaleout.py [--requests 16] [--tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import save_results  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.plugins import PluginHost  # noqa: E402
from millm_engines.transformers.testing import tiny_model_dir  # noqa: E402

PROMPTS = ["Write about the sea.", "Describe a market.", "Explain bread.", "A letter home.", "A village history.", "How violins are made.", "A robot painter.", "Why sunsets are red."]


def complete(base_url: str, prompt: str, tokens: int) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    resp = CLIENT.post(base_url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    return int(resp.json()["usage"]["completion_tokens"]), resp.headers["x-millm-replica"]


def all_at_once(base_url: str, n: int, tokens: int) -> tuple[float, set[str]]:
    """Aggregate tok/s of ``n`` completions sent at once, and the replicas that served them."""
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        done = list(pool.map(lambda i: complete(base_url, PROMPTS[i % len(PROMPTS)], tokens), range(n)))
        elapsed = time.perf_counter() - started
    return sum(count for count, _ in done) / elapsed, {replica for _, replica in done}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    configure_logging("console", "warning")

    import ray
    from ray import serve

    from millm_plugins.rayserve.deployment import APP_NAME, build_app

    cores = os.cpu_count() or 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=cores, object_store_memory=100 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    results: dict[str, list[float]] = {}
    served: dict[str, list[str]] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        with tempfile.TemporaryDirectory() as folder:
            for replicas in (1, 2):
                threads = max(1, cores // replicas)
                values = {"model": tiny_model_dir(), "served_name": "tiny", "db": os.path.join(folder, "millm.db"), "log_level": "warning", "threads": threads}
                settings = load_settings(values, environ={}, plugin_settings=PluginHost.declared_settings())
                options = {"num_cpus": cores / replicas}
                serve.run(build_app(settings, num_replicas=replicas, ray_actor_options=options), name=APP_NAME, route_prefix="/")
                key = f"{replicas}_replica{'s' if replicas > 1 else ''}"
                all_at_once(base_url, args.requests, args.tokens)  # warm-up: every replica's first steps
                results[key], seen = [], set()
                for _ in range(args.repeats):
                    rate, replicas_seen = all_at_once(base_url, args.requests, args.tokens)
                    results[key].append(rate)
                    seen |= replicas_seen
                served[key] = sorted(seen)
                serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    medians = {key: statistics.median(v) for key, v in results.items()}
    report: dict[str, Any] = {
        "model": "tiny (2-layer Llama, float32)",
        "cores": cores,
        "requests": args.requests,
        "tokens": args.tokens,
        "tok_per_s": medians,
        "samples": results,
        "replicas_that_served": served,
        "ratio": medians["2_replicas"] / medians["1_replica"],
    }
    print(json.dumps(report))
    print(
        f"\n{args.requests} requests x {args.tokens} tokens at once on {cores} cores: 1 replica {medians['1_replica']:.1f} tok/s, "
        f"2 replicas {medians['2_replicas']:.1f} tok/s -> {report['ratio']:.2f}x"
    )
    save_results("scaleout.json", [report])


if __name__ == "__main__":
    main()
