"""Throughput of the Batch API against the same requests sent live, in one run: a batch
of ``--lines`` short greedy chat requests (uploaded with ``POST /v1/files``, created with
``POST /v1/batches``, timed from the upload to ``completed``) against the same bodies
posted to ``/v1/chat/completions`` by ``--concurrency`` clients at once (threads of a
process of their own, so that they do not share the server's interpreter). The batch runs
with ``--batch-concurrency`` equal to the live concurrency, so both sides keep the same
number of rows in the decode batch (8 by default: twice the server's own default of 4,
which the report says); the ratio is batch lines/s over live lines/s (target
≥ 1.0×). Model: the tiny test model (2 layers, float32; ``tiny_model_dir()``), whose
greedy answers are short and cheap, so the per-request overhead of each path shows.

Usage: python bench/bench_batch.py [--lines 1000] [--concurrency 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import httpx  # noqa: E402
from bench_decode import save_results, wait_loaded  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_engines.transformers.testing import tiny_model_dir  # noqa: E402
from millm_plugins.batches.plugin import CONCURRENCY  # noqa: E402

TOPICS = ["the sea", "a market", "bread", "a letter", "a village", "violins", "a robot", "sunsets", "rain", "a tree"]


def bodies(lines: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {"model": "bench", "messages": [{"role": "user", "content": f"Question {i}: say something about {TOPICS[i % len(TOPICS)]}."}],
         "max_tokens": max_tokens, "temperature": 0}
        for i in range(lines)
    ]  # fmt: skip


def live(base_url: str, requests: list[dict[str, Any]], concurrency: int) -> tuple[float, int]:
    """Seconds to answer every request with ``concurrency`` clients, and the tokens generated."""
    clients = [httpx.Client(base_url=base_url, timeout=600) for _ in range(concurrency)]

    def send(i: int) -> int:
        reply = clients[i % concurrency].post("/v1/chat/completions", json=requests[i])
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(send, range(len(requests))))
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
    return elapsed, tokens


def batch(base_url: str, requests: list[dict[str, Any]]) -> tuple[float, int]:
    """Seconds from uploading the batch to its completion, and the tokens generated."""
    content = "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
        for i, b in enumerate(requests)
    )
    with httpx.Client(base_url=base_url, timeout=600) as client:
        started = time.perf_counter()
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("bench.jsonl", content.encode())}).json()
        created = client.post(
            "/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        ).json()
        while (state := client.get(f"/v1/batches/{created['id']}").json())["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
    counts = state["request_counts"]
    if state["status"] != "completed" or counts["completed"] != len(requests):
        raise RuntimeError(f"the batch ended {state['status']} with {counts}")
    return elapsed, int(state["usage"]["output_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    host = build_host(load_settings(environ={}))
    settings = load_settings(
        {"log_level": "warning", "db": ":memory:", "batch_concurrency": args.concurrency},
        environ={},
        plugin_settings=host.plugin_settings(),
    )

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=tiny_model_dir(), served_name="bench"), settings)
        return ServedModel(info=engine.info, engine=engine)

    requests = bodies(args.lines, args.max_tokens)
    app = create_app(settings, host=host, loader=loader)
    with RunningServer(app) as server:
        wait_loaded(app)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
            clients.submit(live, server.base_url, requests[: args.concurrency], args.concurrency).result()  # warm-up
            live_s, live_tokens = clients.submit(live, server.base_url, requests, args.concurrency).result()
        batch_s, batch_tokens = batch(server.base_url, requests)
    report: dict[str, Any] = {
        "model": "tiny test model (2 layers, float32)",
        "lines": args.lines,
        "concurrency": args.concurrency,
        "batch_concurrency": args.concurrency,
        "batch_concurrency_default": CONCURRENCY.default,
        "max_tokens": args.max_tokens,
        "live": {"seconds": live_s, "lines_per_s": args.lines / live_s, "tokens": live_tokens},
        "batch": {"seconds": batch_s, "lines_per_s": args.lines / batch_s, "tokens": batch_tokens},
        "ratio": live_s / batch_s,
    }
    print(json.dumps(report))
    print(
        f"\n{args.lines} greedy chat lines: live at concurrency {args.concurrency} {report['live']['lines_per_s']:.1f} lines/s, "
        f"batch {report['batch']['lines_per_s']:.1f} lines/s -> {report['ratio']:.2f}x (target >= 1.0x); "
        f"the batch ran with --batch-concurrency {args.concurrency} (the server's default is {CONCURRENCY.default})"
    )
    if live_tokens != batch_tokens:
        print(f"note: the two sides generated different token counts ({live_tokens} live, {batch_tokens} batch)")
    save_results("batch.json", [report])


if __name__ == "__main__":
    main()
