"""The GGUF engine through millm's HTTP server against llama-cpp-python's own server
(``python -m llama_cpp.server``), same file, same threads, in one run.

Both servers run as subprocesses on 127.0.0.1 and are driven by the same client code:
  - 1 stream: a greedy chat completion of up to ``--tokens`` tokens; tok/s from the
    completion tokens each server reports and the wall time.
  - 8 concurrent streams: eight streaming requests (different prompts) at once; aggregate
    tok/s = content chunks received / wall time, and how many streams were cut short
    (ended without a finish reason, or with no content); and the run's two phases
    (bench/phases.py): when every stream had its first token, and the aggregate rate
    while all of them decode, which is what the decode ceiling below measures.
Runs alternate between the servers, ``--repeats`` times, and medians are compared. The
peer runs with ``--interrupt_requests False``: by default it cuts concurrent streams short
(a 200 with no tokens), which would flatter any comparison; one extra 8-stream run with its
defaults records how many it cuts.

In the same run, after the servers stop, llama.cpp's C API is driven directly (no millm, no
HTTP) on the same file and threads: prefill ``--streams`` sequences in one ``llama_decode``
call, then ``--ceiling-steps`` (the streams' 64 by default) greedy decode steps, each decoding every sequence in ONE
call; also 1 sequence. Two settings alternate, ``--repeats`` times (medians):
  - "default": llama.cpp's own choices (a unified KV cache as llama-server uses, flash
    attention auto, default model params, so repacked weight layouts): the batched ceiling;
  - "invariant": millm's (a KV stream per sequence, flash attention on, no repacked
    layouts; see millm_engines/gguf/llama.py): invariant / default is the cost of invariance.
Decode tok/s = tokens of the decode steps / their time; "with prefill" adds the prefill
call (and its first token). millm's 8-stream HTTP aggregate / the 8-sequence decode ceiling
(issue target >= 0.9) and millm / llama_cpp.server at 8 streams (target >= 3) are printed.

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
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from client import CLIENT  # noqa: E402
from phases import content_chunk, jsonable, median, now, phases, shown  # noqa: E402

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


def loaded_model(url: str) -> str | None:
    """The id of the model a server has loaded (millm also lists models it could load, with
    their "millm" state; a peer lists the model once it is loaded)."""
    listed = httpx.get(url + "/v1/models", timeout=2)
    data = listed.json().get("data") if listed.status_code == 200 else None
    return next((m["id"] for m in data or [] if (m.get("millm") or {}).get("state", "loaded") == "loaded"), None)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if loaded_model(url):
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
        self.model = str(loaded_model(self.url))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_stream(server: Server, tokens: int) -> float:
    body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    resp = CLIENT.post(server.url + "/v1/chat/completions", json=body, timeout=600).json()
    return float(resp["usage"]["completion_tokens"]) / (time.perf_counter() - started)


def concurrent_streams(server: Server, tokens: int, streams: int) -> tuple[float, int, dict[str, float]]:
    """Aggregate tok/s of ``streams`` streams sent at once (content chunks / wall time), how
    many were cut short, and the run's two phases (:func:`phases.phases`)."""
    counts = [0] * streams
    finished = [False] * streams
    arrivals: list[list[float]] = [[] for _ in range(streams)]

    def run(i: int) -> None:
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": tokens, "temperature": 0, "stream": True}
        try:
            with CLIENT.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if content_chunk(chunk):
                        counts[i] += 1
                        arrivals[i].append(now())
                    if any(choice.get("finish_reason") for choice in chunk.get("choices") or []):
                        finished[i] = True
        except httpx.HTTPError:  # the server dropped the stream: it counts as cut short
            return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    started = now()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = now() - started
    cut = sum(1 for i in range(streams) if not finished[i] or counts[i] == 0)
    return sum(counts) / wall, cut, phases(arrivals, started)


# SmolLM2's chat turn as both servers render a lone user message with the file's template
# (which adds its default system turn): the ceiling decodes the sequences the servers do.
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def ceiling_run(model: Any, threads: int, seqs: int, steps: int, invariant: bool) -> tuple[float, float, float]:
    """(decode tok/s, tok/s with the prefill, seconds of the prefill call with its first
    tokens) of ``seqs`` greedy sequences in one fresh context."""
    import llama_cpp as L

    params = L.llama_context_default_params()
    params.n_ctx = seqs * 256
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = seqs
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = not invariant
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if invariant else L.LLAMA_FLASH_ATTN_TYPE_AUTO
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab = L.llama_model_get_vocab(model)
    n_vocab = int(L.llama_vocab_n_tokens(vocab))
    batch = L.llama_batch_init(512, 0, 1)
    try:
        prompts = []
        for i in range(seqs):
            data = CHAT.format(PROMPTS[i % len(PROMPTS)]).encode()
            buf = (L.llama_token * (len(data) + 8))()
            n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
            prompts.append(list(buf[:n]))

        def run(rows: list[tuple[int, int, int, bool]]) -> list[int]:  # (token, seq, pos, output) -> greedy next tokens
            batch.n_tokens = len(rows)
            for j, (token, seq, pos, output) in enumerate(rows):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, pos, 1, int(output)
                batch.seq_id[j][0] = seq
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(n_vocab,))))
                    for j, row in enumerate(rows) if row[3]]  # fmt: skip

        started = time.perf_counter()
        nxt = run([(t, s, p, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
        decoding = time.perf_counter()
        for step in range(steps):
            nxt = run([(nxt[s], s, len(prompts[s]) + step, True) for s in range(seqs)])
        done = time.perf_counter()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return seqs * steps / (done - decoding), seqs * (steps + 1) / (done - started), decoding - started


# Run as ``python -c``: whether llama.cpp with its default model parameters (repacked weight
# layouts) survives a prompt of several tokens. On CPUs with AMX it can crash there
# (ggml-org/llama.cpp#20824: a segfault in ggml_backend_amx_mul_mat, seen here on the
# packaged Q4_1 file); one decode call in a child process tells without taking the bench down.
_REPACK_PROBE = """
import sys, llama_cpp as L
import millm_engines.gguf.llama
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx, params.n_threads, params.n_threads_batch = 256, int(sys.argv[2]), int(sys.argv[2])
ctx = L.llama_init_from_model(model, params)
tokens = (L.llama_token * 16)(*range(100, 116))  # kept alive: the batch points into it
batch = L.llama_batch_get_one(tokens, 16)
sys.exit(L.llama_decode(ctx, batch))
"""

# Run as ``python -c`` with llama_cpp.server's arguments: the server with repacked weight
# layouts off (what millm's engine runs with), where its defaults crash.
_PEER_WITHOUT_REPACK = """
import runpy, sys
import llama_cpp.llama_cpp as C
defaults = C.llama_model_default_params
def without_repack():
    params = defaults()
    params.use_extra_bufts = False
    return params
C.llama_model_default_params = without_repack
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def repack_survives(gguf: str, threads: int) -> bool:
    probe = subprocess.run([sys.executable, "-c", _REPACK_PROBE, gguf, str(threads)], capture_output=True, timeout=300)
    return probe.returncode == 0


def ceiling(gguf: str, threads: int, streams: int, steps: int, repeats: int, repack: bool = True) -> dict[str, dict[str, float]]:
    """Medians of {setting: {f"decode_{n}", f"prefill_{n}", f"prefill_s_{n}"}} for n = 1 and ``streams`` sequences
    (without ``repack``, the "default" setting keeps the file's weight layouts too)."""
    import llama_cpp as L

    import millm_engines.gguf.llama  # noqa: F401  # silences llama.cpp's log

    models = {}
    for setting in ("default", "invariant"):
        mparams = L.llama_model_default_params()
        if setting == "invariant" or not repack:
            mparams.use_extra_bufts = False
        models[setting] = L.llama_model_load_from_file(gguf.encode(), mparams)
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in models}
    try:
        for setting, model in models.items():  # warm-up
            ceiling_run(model, threads, streams, 4, setting == "invariant")
        for repeat in range(repeats):
            for setting in ("default", "invariant") if repeat % 2 == 0 else ("invariant", "default"):
                for seqs in (1, streams):
                    decode, with_prefill, prefill_s = ceiling_run(models[setting], threads, seqs, steps, setting == "invariant")
                    samples[setting].setdefault(f"decode_{seqs}", []).append(decode)
                    samples[setting].setdefault(f"prefill_{seqs}", []).append(with_prefill)
                    samples[setting].setdefault(f"prefill_s_{seqs}", []).append(prefill_s)
            print(f"ceiling repeat {repeat}: " + ", ".join(f"{s} {n}x {v[-1]:.1f}" for s in samples for n, v in samples[s].items() if n.startswith("decode")), flush=True)
    finally:
        for model in models.values():
            L.llama_model_free(model)
    return {s: {k: statistics.median(v) for k, v in r.items()} for s, r in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ceiling-steps", type=int, default=None, help="default: the streams' length, --tokens // 2")
    args = parser.parse_args()
    if args.ceiling_steps is None:
        args.ceiling_steps = args.tokens // 2
    from millm_plugins.smollm2.convert import packaged_gguf

    gguf = packaged_gguf()
    env_threads = str(args.threads)
    repack = repack_survives(gguf, args.threads)
    if not repack:
        print("llama.cpp's repacked weight layouts crash on a prompt on this CPU (ggml-org/llama.cpp#20824): "
              "llama_cpp.server and the C-API 'default' setting run without them", flush=True)  # fmt: skip
    launch = ["-m", "llama_cpp.server"] if repack else ["-c", _PEER_WITHOUT_REPACK]
    peer_args = [sys.executable, *launch, "--model", gguf, "--host", "127.0.0.1", "--n_threads", env_threads, "--n_ctx", "8192"]
    port = free_port()
    default_peer = Server("llama_cpp.server (defaults)", [*peer_args, "--port", str(port)], port)
    try:
        one_stream(default_peer, 8)
        _, default_cut, _ = concurrent_streams(default_peer, args.tokens // 2, args.streams)
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
    results: dict[str, dict[str, list[float]]] = {s.name: {"single": [], "aggregate": [], "cut": [], "all_first_s": [], "steady_tok_s": [], "steady_window_s": [], "steady_chunks": []} for s in (peer, ours)}
    try:
        for server in (peer, ours):  # warm-up
            one_stream(server, 8)
        for repeat in range(args.repeats):
            for server in (peer, ours) if repeat % 2 == 0 else (ours, peer):
                results[server.name]["single"].append(one_stream(server, args.tokens))
                rate, cut, phase = concurrent_streams(server, args.tokens // 2, args.streams)
                results[server.name]["aggregate"].append(rate)
                results[server.name]["cut"].append(cut)
                for key, value in phase.items():
                    results[server.name][key].append(value)
                print(f"{server.name:18s} repeat {repeat}: 1 stream {results[server.name]['single'][-1]:.1f} tok/s, "
                      f"{args.streams} streams {rate:.1f} tok/s aggregate (every first token at {shown(phase['all_first_s'], '.2f')} s, "
                      f"then {shown(phase['steady_tok_s'])} chunks/s over {shown(phase['steady_window_s'], '.2f')} s), cut short {cut}/{args.streams}", flush=True)
    finally:
        peer.stop()
        ours.stop()
    med = {name: {k: median(v) for k, v in r.items()} for name, r in results.items()}
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
    summary["repacked_layouts_crash"] = not repack
    ceil = ceiling(gguf, args.threads, args.streams, args.ceiling_steps, args.repeats, repack)
    n = args.streams
    summary["ceiling"] = {
        "steps": args.ceiling_steps,
        "tok_per_s": ceil,
        "invariance_cost": {f"decode_{k}": ceil["invariant"][f"decode_{k}"] / ceil["default"][f"decode_{k}"] for k in (1, n)},
        "millm_over_ceiling": med["millm"]["aggregate"] / ceil["default"][f"decode_{n}"],
        "millm_over_ceiling_with_prefill": med["millm"]["aggregate"] / ceil["default"][f"prefill_{n}"],
        "millm_over_invariant_ceiling": med["millm"]["aggregate"] / ceil["invariant"][f"decode_{n}"],
        "millm_steady_over_ceiling": med["millm"]["steady_tok_s"] / ceil["default"][f"decode_{n}"],
    }
    print(f"\n1 stream: millm {med['millm']['single']:.1f} vs llama_cpp.server {med['llama_cpp.server']['single']:.1f} tok/s -> {summary['single_ratio']:.2f}x")
    print(f"{args.streams} streams: millm {med['millm']['aggregate']:.1f} vs llama_cpp.server {med['llama_cpp.server']['aggregate']:.1f} tok/s -> {summary['aggregate_ratio']:.2f}x")
    print(f"streams cut short (median): millm {med['millm']['cut']:.0f}, llama_cpp.server {med['llama_cpp.server']['cut']:.0f} "
          f"(with its default settings: {default_cut}/{args.streams})")
    c = summary["ceiling"]
    print(f"\nllama.cpp C API, {args.ceiling_steps} decode steps, one llama_decode per step (tok/s, decode / with prefill):")
    print(f"{'':12s}{'1 sequence':>22s}{f'{n} sequences':>22s}")
    for setting in ("default", "invariant"):
        t = ceil[setting]
        print(f"{setting:12s}{t['decode_1']:12.1f} / {t['prefill_1']:6.1f}{t[f'decode_{n}']:12.1f} / {t[f'prefill_{n}']:6.1f}")
    print(f"cost of invariance (invariant / default, decode): 1 sequence {c['invariance_cost']['decode_1']:.2f}, "
          f"{n} sequences {c['invariance_cost'][f'decode_{n}']:.2f}")  # fmt: skip
    print(f"millm {n} streams (HTTP) / {n}-sequence ceiling: {c['millm_over_ceiling']:.2f} (target >= 0.9; "
          f"{c['millm_over_ceiling_with_prefill']:.2f} against the ceiling with its prefill, {c['millm_over_invariant_ceiling']:.2f} against the invariant one)")  # fmt: skip
    print(f"millm {n} streams / llama_cpp.server: {summary['aggregate_ratio']:.2f}x (target >= 3)")
    m, p = med["millm"], med["llama_cpp.server"]
    print(f"phases of the {n} streams (medians): every stream's first token after {shown(m['all_first_s'], '.2f')} s on millm, "
          f"{shown(p['all_first_s'], '.2f')} s on llama_cpp.server (the ceiling's one prefill call: {ceil['default'][f'prefill_s_{n}']:.2f} s); "
          f"then, while all {n} decode, millm {shown(m['steady_tok_s'])} content chunks/s over {shown(m['steady_window_s'], '.2f')} s "
          f"({shown(m['steady_chunks'], '.0f')} chunks), llama_cpp.server {shown(p['steady_tok_s'])} (n/a: one request at a time); "
          f"millm's steady decode / the {n}-sequence ceiling {shown(c['millm_steady_over_ceiling'], '.2f')}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "gguf.json"), "w") as fh:
        json.dump(jsonable(summary), fh, indent=2, allow_nan=False)


if __name__ == "__main__":
    main()
