"""millm against ``transformers serve --continuous-batching`` on SmolLM2-135M-Instruct in
bfloat16 on CPU, through HTTP, one server at a time, in one run.

Both serve the same local checkpoint (the default model's converted directory). For each
server, started alone, measured and stopped, greedy streaming chat completions measure
  - 1 stream: up to ``--tokens`` (128) new tokens; tok/s from the completion tokens the
    server reports (``usage`` in the last chunk; content chunks where it sends none);
  - ``--streams`` (8) streams of ``--tokens // 2`` (64) tokens, different prompts, sent at
    once: aggregate tok/s = completion tokens / wall time from the first send to the last
    finish;
  - the same with prompts whose replies run the whole ``--tokens // 2`` (bench_gguf's
    story prompts), split into its two phases (bench/phases.py): when every stream had
    its first token, and the aggregate while all of them decode (the short prompts above
    end some replies after a dozen tokens, which leaves that phase a few steps long);
  - batch invariance (first round only: the peer is slow on this machine): each prompt's
    solo text (one request at a time), then the first prompt 8 times at once (how many
    equal its solo text, how many distinct texts), and the 8 different prompts at once
    (the throughput run's texts: how many equal their solo texts).
Two rounds alternate the order of the servers; medians are compared.

The peer runs offline (``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``) with ``--dtype
bfloat16 --device cpu`` and a paged cache sized for this workload (``--cb-block-size 32
--cb-num-blocks 128 --cb-max-batch-tokens 512``): its defaults size the cache and the
attention mask from free memory (~6 GiB here) and decode about 4x slower. ``--threads N``
gives both servers N CPU threads (millm ``--threads``, ``OMP_NUM_THREADS`` for the peer). Its
/v1/chat/completions takes the model id it lists (the directory path). If it cannot
start, it is reported unavailable and only millm is measured.

Usage: python bench/bench_peers.py [--tokens 128] [--streams 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import smollm2_dir  # noqa: E402
from bench_gguf import PROMPTS as LONG_PROMPTS  # noqa: E402
from bench_gguf import Server, free_port  # noqa: E402
from client import CLIENT  # noqa: E402
from phases import content_chunk, jsonable, median, now, phases, shown  # noqa: E402

PROMPTS = ["Tell me about the sea.", "hi", "What is 2 + 2? Explain step by step.", "Write a haiku.",
           "List three colours.", "Why is the sky blue?", "Say hello in French and in German.", "ok"]  # fmt: skip  # tests/e2e/test_invariance_e2e.py
MILLM = "millm"
PEER = "transformers serve"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start(name: str, model_dir: str, threads: int | None) -> Server:
    port = free_port()
    env = {**OFFLINE, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    if name == MILLM:
        args = [sys.executable, "-m", "millm_core.cli", "serve", "--dtype", "bfloat16", "--port", str(port), "--log-level", "warning", "--db", ":memory:"]
        return Server(name, args + (["--threads", str(threads)] if threads else []), port, env=env)
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
    args = [exe, "serve", "--continuous-batching", "--dtype", "bfloat16", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--cb-block-size", "32", "--cb-num-blocks", "128", "--cb-max-batch-tokens", "512", model_dir]  # fmt: skip
    return Server(name, args, port, env=env)


def stream(server: Server, prompt: str, tokens: int, arrivals: list[float] | None = None) -> tuple[str, int]:
    """(text, completion tokens) of one greedy streaming chat completion; the arrival time of
    each content chunk goes into ``arrivals`` when given."""
    body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    parts: list[str] = []
    usage: int | None = None
    with CLIENT.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if arrivals is not None and content_chunk(chunk):
                arrivals.append(now())
            for choice in chunk.get("choices") or []:
                if content := (choice.get("delta") or {}).get("content"):
                    parts.append(content)
            if chunk.get("usage"):
                usage = int(chunk["usage"]["completion_tokens"])
    return "".join(parts), usage if usage is not None else len(parts)


def at_once(server: Server, prompts: list[str], tokens: int) -> tuple[list[str], float, dict[str, float]]:
    """Texts of ``prompts`` sent at once, aggregate tok/s (first send to last finish) and the
    run's two phases (bench/phases.py)."""
    out: list[tuple[str, int]] = [("", 0)] * len(prompts)
    arrivals: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = stream(server, prompts[i], tokens, arrivals[i])
        except Exception as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    started = now()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = now() - started
    if errors:
        raise RuntimeError(f"{server.name}: {len(errors)} of {len(prompts)} streams failed: {errors[0]!r}")
    tokens_sent = sum(n for _, n in out)
    return [text for text, _ in out], tokens_sent / wall, {**phases(arrivals, started), "tokens": tokens_sent}


def measure(name: str, model_dir: str, args: argparse.Namespace, invariance: bool) -> dict[str, Any]:
    began = time.perf_counter()
    server = start(name, model_dir, args.threads)
    loaded = time.perf_counter() - began
    try:
        stream(server, PROMPTS[0], 4)  # warm-up
        started = time.perf_counter()
        _, n = stream(server, PROMPTS[0], args.tokens)
        single = n / (time.perf_counter() - started)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
        different, aggregate, short = at_once(server, prompts, args.tokens // 2)
        _, long_aggregate, phase = at_once(server, [LONG_PROMPTS[i % len(LONG_PROMPTS)] for i in range(args.streams)], args.tokens // 2)
        row: dict[str, Any] = {"single": single, "aggregate": aggregate, "load_s": loaded, "tokens": short["tokens"],
                               "long_aggregate": long_aggregate, "long_tokens": phase.pop("tokens"), **phase}  # fmt: skip
        if invariance:
            solo = {p: stream(server, p, args.tokens // 2)[0] for p in dict.fromkeys(prompts)}
            same, _, _ = at_once(server, [PROMPTS[0]] * args.streams, args.tokens // 2)
            row["invariance"] = {
                "identical_equal_solo": sum(t == solo[PROMPTS[0]] for t in same),
                "identical_distinct_texts": len(set(same)),
                "different_equal_solo": sum(t == solo[p] for t, p in zip(different, prompts, strict=True)),
                "of": args.streams,
            }
    finally:
        server.stop()
    print(f"{name:18s} 1 stream {single:6.1f} tok/s, {args.streams} streams {aggregate:6.1f} tok/s aggregate"
          + (f", invariance {row['invariance']}" if invariance else "") + f"  (load {loaded:.0f}s, round {time.perf_counter() - began:.0f}s)", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for both (millm --threads, OMP_NUM_THREADS); default: torch's own")
    args = parser.parse_args()
    model_dir = smollm2_dir()
    rows: dict[str, list[dict[str, Any]]] = {MILLM: [], PEER: []}
    peer_error: str | None = None
    for round_ in range(args.rounds):
        for name in (MILLM, PEER) if round_ % 2 == 0 else (PEER, MILLM):
            if name == PEER and peer_error:
                continue
            try:
                rows[name].append(measure(name, model_dir, args, invariance=round_ == 0 or not any("invariance" in r for r in rows[name])))
            except Exception as exc:
                if name == MILLM:
                    raise
                peer_error = f"{type(exc).__name__}: {exc}"
                print(f"{PEER}: unavailable ({peer_error})", flush=True)
    med = {name: {k: median(float(r[k]) for r in rs) for k in ("single", "aggregate", "tokens", "long_aggregate", "long_tokens", "all_first_s", "steady_tok_s", "steady_window_s", "steady_chunks")} for name, rs in rows.items() if rs}
    inv = {name: next((r["invariance"] for r in rs if "invariance" in r), None) for name, rs in rows.items() if rs}
    summary: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bfloat16, CPU)",
        "tokens": args.tokens,
        "streams": args.streams,
        "stream_tokens": args.tokens // 2,
        "rounds": args.rounds,
        "threads": args.threads,
        "peer": "transformers serve --continuous-batching --dtype bfloat16 --device cpu --cb-block-size 32 --cb-num-blocks 128 --cb-max-batch-tokens 512",
        "peer_available": peer_error is None and bool(rows[PEER]),
        "peer_error": peer_error,
        "medians": med,
        "invariance": inv,
        "samples": rows,
    }
    print(f"\n{'':20s}{'1 stream tok/s':>16s}{f'{args.streams} streams tok/s':>18s}   invariance (identical equal solo / distinct texts / different equal solo)")
    for name in med:
        i = inv.get(name) or {}
        print(f"{name:20s}{med[name]['single']:16.1f}{med[name]['aggregate']:18.1f}   "
              f"{i.get('identical_equal_solo')}/{i.get('of')} / {i.get('identical_distinct_texts')} / {i.get('different_equal_solo')}/{i.get('of')}")  # fmt: skip
    if MILLM in med and PEER in med:
        summary["single_ratio"] = med[MILLM]["single"] / med[PEER]["single"]
        summary["aggregate_ratio"] = med[MILLM]["aggregate"] / med[PEER]["aggregate"]
        summary["steady_ratio"] = med[MILLM]["steady_tok_s"] / med[PEER]["steady_tok_s"]
        print(f"millm / peer: 1 stream {summary['single_ratio']:.2f}x, {args.streams} streams {summary['aggregate_ratio']:.2f}x")
        m, p = med[MILLM], med[PEER]
        summary["long_aggregate_ratio"] = med[MILLM]["long_aggregate"] / med[PEER]["long_aggregate"]
        print(f"{args.streams} streams of long replies: {med[MILLM]['long_aggregate']:.1f} against {med[PEER]['long_aggregate']:.1f} tok/s "
              f"({summary['long_aggregate_ratio']:.2f}x; {med[MILLM]['long_tokens']:.0f} and {med[PEER]['long_tokens']:.0f} tokens)")
        print(f"their phases (medians): every first token after {shown(m['all_first_s'], '.2f')} s (millm) and "
              f"{shown(p['all_first_s'], '.2f')} s (peer); then, while all decode, {shown(m['steady_tok_s'])} against "
              f"{shown(p['steady_tok_s'])} content chunks/s ({shown(summary['steady_ratio'], '.2f')}x), over windows of "
              f"{shown(m['steady_window_s'], '.2f')} and {shown(p['steady_window_s'], '.2f')} s ({shown(m['steady_chunks'], '.0f')} and "
              f"{shown(p['steady_chunks'], '.0f')} chunks); completion tokens of the short-prompt run {m['tokens']:.0f} and "
              f"{p['tokens']:.0f} of {args.streams * (args.tokens // 2)}")
    else:
        print(f"{PEER} unavailable: {peer_error}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "peers.json"), "w") as fh:
        json.dump(jsonable(summary), fh, indent=2, allow_nan=False)


if __name__ == "__main__":
    main()
