"""An attacker posting 4 MiB bodies in a loop, against a server that also streams for a
well-behaved client: does the event loop stay responsive?

Measured in one run, alternating quiet and attacked phases: the p50/p99 latency of
``GET /api/health`` and the tok/s of an unrelated greedy stream. The attackers run in
their own processes (on the same 2 cores: the stream's pace also measures the CPU the
attack takes, not only whether the event loop stays free). Printed ratios: attacked
stream pace over quiet stream pace (target close to 1), and the attacked health p99 in ms
(target under 100 ms). The attacker's bodies are valid JSON of 4 MiB (just under the
default limit) that the server must parse and refuse.

Usage: python bench/bench_attack.py [--attackers 2] [--repeats 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import httpx  # noqa: E402
from bench_decode import bench_model_dir, save_results  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

BODY_BYTES = 4 * 1024 * 1024 - 4096


def attack_bodies() -> list[tuple[str, bytes]]:
    """4 MiB bodies the server must parse and then refuse or serve: a chat with one huge
    message for a model that does not exist, and an embeddings request of 64 long inputs
    (tokenised, then refused for the context window)."""
    filler = "a" * (BODY_BYTES - 200)
    chat = json.dumps({"model": "nobody", "messages": [{"role": "user", "content": filler}], "x": 1}).encode()
    part = "word " * ((BODY_BYTES - 2000) // 64 // 5)
    embed = json.dumps({"model": "bench", "input": [part] * 64}).encode()
    return [("/v1/chat/completions", chat), ("/v1/embeddings", embed)]


def stream_pace(base_url: str, tokens: int) -> float:
    body = {"model": "bench", "prompt": "Write about the sea.", "max_tokens": tokens, "temperature": 0, "stream": True}
    started, count = time.perf_counter(), 0
    with CLIENT.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                count += 1
    return count / (time.perf_counter() - started)


def health_latencies(base_url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get(base_url + "/api/health")
            out.append((time.perf_counter() - started) * 1000)
            time.sleep(0.01)


def attacker(base_url: str, stop: Any, bodies: list[tuple[str, bytes]], sent: Any) -> None:
    """Runs in its own process, so the attack's client work does not share the server's GIL."""
    with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as client:
        while not stop.is_set():
            for path, body in bodies:
                client.post(base_url + path, content=body)
                with sent.get_lock():
                    sent.value += 1


def phase(base_url: str, attackers: int, tokens: int, bodies: list[tuple[str, bytes]]) -> dict[str, float]:
    stop, latencies = threading.Event(), []  # type: ignore[var-annotated]
    context = multiprocessing.get_context("spawn")
    halt, sent = context.Event(), context.Value("i", 0)
    prober = threading.Thread(target=health_latencies, args=(base_url, stop, latencies))
    procs = [context.Process(target=attacker, args=(base_url, halt, bodies, sent)) for _ in range(attackers)]
    for proc in procs:
        proc.start()
    prober.start()
    time.sleep(1.0 if attackers else 0.5)
    pace = stream_pace(base_url, tokens)
    stop.set()
    halt.set()
    prober.join()
    for proc in procs:
        proc.join(60)
    ordered = sorted(latencies)
    return {
        "stream_tok_s": pace,
        "health_p50_ms": ordered[len(ordered) // 2],
        "health_p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "attack_requests": float(sent.value),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=bench_model_dir(), served_name="bench"), settings)
        engine.eos_token_ids = frozenset()
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    bodies = attack_bodies()
    runs: dict[str, list[dict[str, float]]] = {"quiet": [], "attacked": []}
    with RunningServer(app) as server:
        while not len(app.state.millm.models):
            if app.state.millm.load_error:
                raise RuntimeError(app.state.millm.load_error)
            time.sleep(0.1)
        stream_pace(server.base_url, 4)  # warm-up
        for repeat in range(args.repeats):
            order = ("quiet", "attacked") if repeat % 2 == 0 else ("attacked", "quiet")
            for mode in order:
                runs[mode].append(phase(server.base_url, args.attackers if mode == "attacked" else 0, args.tokens, bodies))
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    report: dict[str, Any] = {
        "model": "bench (22M, float32)",
        "attackers": args.attackers,
        "body_bytes": [len(b) for _, b in bodies],
        "medians": medians,
        "runs": runs,
        "stream_ratio": medians["attacked"]["stream_tok_s"] / medians["quiet"]["stream_tok_s"],
    }
    print(json.dumps(report))
    print(
        f"\n{args.attackers} attacker processes x 4 MiB chat and embeddings bodies: stream {medians['quiet']['stream_tok_s']:.1f} -> "
        f"{medians['attacked']['stream_tok_s']:.1f} tok/s ({report['stream_ratio']:.2f}x); /api/health p99 "
        f"{medians['quiet']['health_p99_ms']:.1f} -> {medians['attacked']['health_p99_ms']:.1f} ms"
    )
    save_results("attack.json", [report])


if __name__ == "__main__":
    main()
