"""Decode throughput of millm against HF ``generate`` on the same model, in one run.

For each model it measures greedy decode tokens/s at batch 1 for
  (a) HF ``model.generate`` (the baseline),
  (b) millm's engine driven directly (engine + RowDriver, no HTTP),
  (c) the HTTP server, non-streaming (openai SDK),
  (d) the HTTP server, streaming (openai SDK),
  (e) the engine directly with one inline steered feature (a per-row delta at one layer),
and prints b/a, c/a, d/a, e/b and time to first token. Each variant runs ``--repeats`` times,
alternating, and the medians are compared. EOS is disabled everywhere so that every run
generates exactly ``--tokens`` tokens. Results go to stdout and bench/results/latest.json.

Usage: python bench/bench_decode.py [--models bench,smollm2] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation, RowSpec, SamplingParams  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.rows import RowDriver  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_engines.transformers.testing import build_tiny_model  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a map."


def bench_model_dir() -> str:
    """A ~26M-parameter Llama (hidden 512, 8 layers) built offline and cached."""
    path = os.path.join(os.path.expanduser("~"), ".cache", "millm", "bench-models", "bench-llama-26m-v1")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny_model(path, hidden_size=512, layers=8, heads=8, kv_heads=8, context=2048)
    return path


def smollm2_dir() -> str:
    from millm_core.config import cache_root
    from millm_plugins.smollm2.convert import converted_dir

    return converted_dir(cache_root(load_settings(environ={})))[0]


def wait_loaded(app: Any, timeout: float = 600) -> None:
    """Wait until a created app's model is loaded (its loader runs in the background)."""
    deadline = time.monotonic() + timeout
    while not len(app.state.millm.models):
        if time.monotonic() > deadline or app.state.millm.load_error:
            raise RuntimeError(f"model did not load: {app.state.millm.load_error}")
        time.sleep(0.1)


def save_results(name: str, reports: list[dict[str, Any]]) -> None:
    """Write a run's reports under bench/results/ (ignored by git)."""
    folder = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as fh:
        json.dump(reports, fh, indent=2)


def aggregate_rate(call: Callable[[int], int], n: int) -> float:
    """Tokens per second of ``n`` calls made at once: ``call(i)`` sends request i and
    returns the tokens it generated."""
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        counts = list(pool.map(call, range(n)))
    return sum(counts) / (time.perf_counter() - started)


def median_rate(samples: list[float]) -> float:
    return statistics.median(samples)


def run_model(name: str, path: str, dtype: str, tokens: int, repeats: int) -> dict[str, Any]:
    settings = load_settings({"dtype": dtype, "log_level": "warning", "db": ":memory:", "default_max_tokens": tokens}, environ={})
    messages = [{"role": "user", "content": PROMPT}]
    loaded: dict[str, Any] = {}

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=path, served_name=name), settings)
        engine.eos_token_ids = frozenset()  # every variant generates exactly `tokens` tokens
        loaded["engine"] = engine
        return ServedModel(info=engine.info, engine=engine)

    # The server loads the model on its scheduler thread, as `millm serve` does; the
    # baseline and the direct-engine runs go to the same thread (Scheduler.call), so all
    # tensor work of the process happens on one thread, like in production.
    app = create_app(settings, host=build_host(settings), loader=loader)
    results: dict[str, list[float]] = {"a_hf_generate": [], "b_engine": [], "c_http": [], "d_http_stream": [], "e_engine_steered": []}
    ttft: dict[str, list[float]] = {"a_hf_generate": [], "b_engine": [], "d_http_stream": [], "e_engine_steered": []}
    decode: dict[str, list[float]] = {"a_hf_generate": [], "b_engine": [], "d_http_stream": [], "e_engine_steered": []}
    with RunningServer(app) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="bench", max_retries=0)
        deadline = time.monotonic() + 600
        while "engine" not in loaded or not len(app.state.millm.models):
            if time.monotonic() > deadline or app.state.millm.load_error:
                raise RuntimeError(f"model did not load: {app.state.millm.load_error}")
            time.sleep(0.1)
        scheduler = app.state.millm.scheduler
        engine = loaded["engine"]
        model, tok = engine.model, engine.tokenizer
        prompt_ids = engine.render_chat(messages)
        params = sum(p.numel() for p in model.parameters())
        gen_config = copy.deepcopy(model.generation_config)
        gen_config.eos_token_id = None
        gen_config.do_sample = False
        gen_config.max_new_tokens = tokens
        gen_config.min_new_tokens = None
        gen_config.pad_token_id = tok.pad_token_id or 0

        class FirstToken(BaseStreamer):
            """Notes when generate() emits its first new token (its first put() is the prompt)."""

            def __init__(self, start: float) -> None:
                self.start, self.puts, self.first = start, 0, None

            def put(self, value: Any) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.first = time.perf_counter() - self.start

            def end(self) -> None:
                pass

        def hf_generate() -> tuple[float, float | None]:
            ids = torch.tensor([prompt_ids])
            start = time.perf_counter()
            streamer = FirstToken(start)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config, streamer=streamer)
            elapsed = time.perf_counter() - start
            assert out.shape[1] - len(prompt_ids) == tokens
            return tokens / elapsed, streamer.first

        # One inline steered feature: strength × a unit-norm decoder row, at the middle layer.
        direction = torch.randn(engine.info.d_model, generator=torch.Generator().manual_seed(0))
        steer = {engine.info.n_layers // 2: tuple((4.0 * direction / direction.norm()).tolist())}

        def engine_direct(deltas: dict[int, tuple[float, ...]] | None = None) -> tuple[float, float | None]:
            driver = RowDriver(0, decode=engine.decode, processors=[], eos_token_ids=frozenset(), max_new_tokens=tokens)
            start = time.perf_counter()
            row = RowSpec(prompt_ids=tuple(prompt_ids), sampling=SamplingParams(temperature=0.0), deltas=deltas or {})
            batch = engine.open_batch([row])
            first = None
            done = False
            while not done:
                token = engine.step(batch, [driver.bias()])[0]
                first = first or time.perf_counter() - start
                done = driver.accept(token).finish_reason is not None
            engine.close(batch)
            return tokens / (time.perf_counter() - start), first

        def http_plain() -> tuple[float, float | None]:
            start = time.perf_counter()
            resp = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=tokens)
            assert resp.usage.completion_tokens == tokens
            return tokens / (time.perf_counter() - start), None

        def http_stream() -> tuple[float, float | None]:
            start = time.perf_counter()
            first = None
            stream = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=tokens, stream=True)
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            return tokens / (time.perf_counter() - start), first

        def on_worker(fn: Callable[[], tuple[float, float | None]]) -> Callable[[], tuple[float, float | None]]:
            return lambda: scheduler.call(fn).result()

        variants: list[tuple[str, Callable[[], tuple[float, float | None]]]] = [
            ("a_hf_generate", on_worker(hf_generate)),
            ("b_engine", on_worker(engine_direct)),
            ("e_engine_steered", on_worker(lambda: engine_direct(steer))),
            ("c_http", http_plain),
            ("d_http_stream", http_stream),
        ]
        for _, fn in variants:  # warm-up: first-call allocations and lazy inits
            fn()
        for _ in range(repeats):
            for key, fn in variants:
                rate, first = fn()
                results[key].append(rate)
                if first is not None and key in ttft:
                    ttft[key].append(first)
                    # Decode rate: the tokens after the first, over the time after it.
                    decode[key].append((tokens - 1) / (tokens / rate - first))
    med = {k: median_rate(v) for k, v in results.items()}
    dec = {k: median_rate(v) for k, v in decode.items()}
    base = med["a_hf_generate"]
    return {
        "model": name,
        "params": params,
        "dtype": dtype,
        "tokens": tokens,
        "prompt_tokens": len(prompt_ids),
        "threads": torch.get_num_threads(),
        "fast_decode": engine.fast is not None,
        "tok_per_s": {k: round(v, 2) for k, v in med.items()},
        "samples": {k: [round(x, 2) for x in v] for k, v in results.items()},
        "ratios": {"b/a": round(med["b_engine"] / base, 3), "c/a": round(med["c_http"] / base, 3), "d/a": round(med["d_http_stream"] / base, 3)},
        "decode_tok_per_s": {k: round(v, 2) for k, v in dec.items()},
        "decode_ratios": {
            "b/a": round(dec["b_engine"] / dec["a_hf_generate"], 3),
            "d/a": round(dec["d_http_stream"] / dec["a_hf_generate"], 3),
            "steered e/b": round(dec["e_engine_steered"] / dec["b_engine"], 3),
        },
        "ttft_ms": {k: round(1000 * statistics.median(v), 1) for k, v in ttft.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench,smollm2", help="comma list of: bench, smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="override the dtype (default: bench float32, smollm2 bfloat16)")
    args = parser.parse_args(argv)
    configure_logging("console", "warning")
    plan = {"bench": (bench_model_dir, "float32"), "smollm2": (smollm2_dir, "bfloat16")}
    reports = []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        locate, dtype = plan[key]
        report = run_model(key, locate(), args.dtype or dtype, args.tokens, args.repeats)
        reports.append(report)
        print(json.dumps(report), file=sys.stderr)
    print("\nend to end (prefill included), tokens/s")
    print(f"{'model':<10}{'params':>8}{'dtype':>10}{'HF gen':>9}{'engine':>9}{'http':>9}{'stream':>9}{'b/a':>7}{'c/a':>7}{'d/a':>7}{'TTFT ms':>9}")
    for r in reports:
        t = r["tok_per_s"]
        print(
            f"{r['model']:<10}{r['params'] / 1e6:>7.1f}M{r['dtype']:>10}{t['a_hf_generate']:>9.1f}{t['b_engine']:>9.1f}"
            f"{t['c_http']:>9.1f}{t['d_http_stream']:>9.1f}{r['ratios']['b/a']:>7.2f}{r['ratios']['c/a']:>7.2f}"
            f"{r['ratios']['d/a']:>7.2f}{r['ttft_ms'].get('d_http_stream', float('nan')):>9.1f}"
        )
    print("\ndecode only (after the first token), tokens/s; time to first token in ms")
    print(f"{'model':<10}{'HF gen':>9}{'engine':>9}{'stream':>9}{'b/a':>7}{'d/a':>7}{'TTFT a':>9}{'TTFT b':>9}{'TTFT d':>9}{'steered':>9}{'e/b':>7}")
    for r in reports:
        d, t = r["decode_tok_per_s"], r["ttft_ms"]
        print(
            f"{r['model']:<10}{d['a_hf_generate']:>9.1f}{d['b_engine']:>9.1f}{d['d_http_stream']:>9.1f}"
            f"{r['decode_ratios']['b/a']:>7.2f}{r['decode_ratios']['d/a']:>7.2f}"
            f"{t['a_hf_generate']:>9.1f}{t['b_engine']:>9.1f}{t['d_http_stream']:>9.1f}"
            f"{d['e_engine_steered']:>9.1f}{r['decode_ratios']['steered e/b']:>7.2f}"
        )
    save_results("latest.json", reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
