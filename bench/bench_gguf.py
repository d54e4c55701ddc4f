"""The GGUF engine through millm's HTTP server against llama-cpp-python's own server
(``python -m llama_cpp.server``), same file, same threads, in one run.

Both servers run as subprocesses on 127.0.0.1 and are driven by the same client code:
  - 1 stream: a greedy chat completion of up to ``--tokens`` tokens; tok/s from the
    completion tokens each server reports and the wall time.
  - 8 concurrent streams: eight streaming requests (different prompts) at once; aggregate
    tok/s = content chunks received / wall time, and how many streams were cut short
    (ended without a finish reason, or with no content).
Runs alternate between the servers, ``--repeats`` times, and medians are compared. The
peer runs with ``--interrupt_requests False``: by default it cuts concurrent streams short
(a 200 with no tokens), which would flatter any comparison; one extra 8-stream run with its
defaults records how many it cuts.

Usage: python bench/bench_gguf.py [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a map.",
    "Explain how bread rises, step by step, for a curious child.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter from a sailor to his sister about the sea.",
    "Tell the history of a small mountain village over a century.",
    "Describe how a violin is made, from wood to varnish.",
    "Write a story about a robot learning to paint.",
    "Explain why the sky changes colour at sunset.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            listed = httpx.get(url + "/v1/models", timeout=2)
            data = listed.json().get("data") if listed.status_code == 200 else None
            # millm lists its model while it loads ("millm": {"state": ...}); a peer once it is loaded
            if data and all((m.get("millm") or {}).get("state", "loaded") == "loaded" for m in data):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready")


class Server:
    def __init__(self, name: str, args: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        try:
            wait_ready(self.url, self.proc)
        except BaseException:
            self.stop()
            raise
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_stream(server: Server, tokens: int) -> float:
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600).json()
    return float(resp["usage"]["completion_tokens"]) / (time.perf_counter() - started)


def concurrent_streams(server: Server, tokens: int, streams: int) -> tuple[float, int]:
    counts = [0] * streams
    finished = [False] * streams

    def run(i: int) -> None:
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": tokens, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as resp:
                lines = list(resp.iter_lines())
        except httpx.HTTPError:  # the server dropped the stream: it counts as cut short
            return
        if True:
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        counts[i] += 1
                    if choice.get("finish_reason"):
                        finished[i] = True

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    cut = sum(1 for i in range(streams) if not finished[i] or counts[i] == 0)
    return sum(counts) / wall, cut


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from millm_plugins.smollm2.convert import packaged_gguf

    gguf = packaged_gguf()
    env_threads = str(args.threads)
    peer_args = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--n_threads", env_threads, "--n_ctx", "8192"]
    port = free_port()
    default_peer = Server("llama_cpp.server (defaults)", [*peer_args, "--port", str(port)], port)
    try:
        one_stream(default_peer, 8)
        _, default_cut = concurrent_streams(default_peer, args.tokens // 2, args.streams)
    finally:
        default_peer.stop()
    print(f"llama_cpp.server with its defaults: {default_cut}/{args.streams} concurrent streams cut short", flush=True)
    peer_port, millm_port = free_port(), free_port()
    peer = Server("llama_cpp.server", [*peer_args, "--port", str(peer_port), "--interrupt_requests", "False"], peer_port)
    ours = Server(
        "millm",
        [sys.executable, "-m", "millm_core.cli", "serve", "--engine", "gguf", "--port", str(millm_port), "--threads", env_threads, "--log-level", "warning", "--db", ":memory:"],
        millm_port,
    )
    results: dict[str, dict[str, list[float]]] = {s.name: {"single": [], "aggregate": [], "cut": []} for s in (peer, ours)}
    try:
        for server in (peer, ours):  # warm-up
            one_stream(server, 8)
        for repeat in range(args.repeats):
            for server in (peer, ours) if repeat % 2 == 0 else (ours, peer):
                results[server.name]["single"].append(one_stream(server, args.tokens))
                rate, cut = concurrent_streams(server, args.tokens // 2, args.streams)
                results[server.name]["aggregate"].append(rate)
                results[server.name]["cut"].append(cut)
                print(f"{server.name:18s} repeat {repeat}: 1 stream {results[server.name]['single'][-1]:.1f} tok/s, "
                      f"{args.streams} streams {rate:.1f} tok/s aggregate, cut short {cut}/{args.streams}", flush=True)
    finally:
        peer.stop()
        ours.stop()
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    summary = {
        "model": os.path.basename(gguf),
        "threads": args.threads,
        "tokens": args.tokens,
        "streams": args.streams,
        "medians": med,
        "peer_defaults_cut_short": default_cut,
        "single_ratio": med["millm"]["single"] / med["llama_cpp.server"]["single"],
        "aggregate_ratio": med["millm"]["aggregate"] / med["llama_cpp.server"]["aggregate"],
    }
    print(f"\n1 stream: millm {med['millm']['single']:.1f} vs llama_cpp.server {med['llama_cpp.server']['single']:.1f} tok/s -> {summary['single_ratio']:.2f}x")
    print(f"{args.streams} streams: millm {med['millm']['aggregate']:.1f} vs llama_cpp.server {med['llama_cpp.server']['aggregate']:.1f} tok/s -> {summary['aggregate_ratio']:.2f}x")
    print(f"streams cut short (median): millm {med['millm']['cut']:.0f}, llama_cpp.server {med['llama_cpp.server']['cut']:.0f} "
          f"(with its default settings: {default_cut}/{args.streams})")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "gguf.json"), "w") as fh:
        json.dump(summary, fh, indent=2)


if __name__ == "__main__":
    main()
