"""Time to first token with prefix reuse against without it, in one run: streamed chats
whose system prompt is the same ~``--prefix-tokens`` tokens every time (after one request
that caches it), against chats whose system prompt has the same length and text but a new
first line each time (nothing to resume). Samples alternate; medians are compared (target
from the prefix-reuse issue: >= 5x faster with reuse at 1,000 tokens). Each sample also
reports ``usage.prompt_tokens_details.cached_tokens``; the fastest sample of each kind is
compared too (a shared machine's bursts can slow single samples several times over).

Usage: python bench/bench_prefix.py [--model smollm2|bench] [--prefix-tokens 1000] [--samples 5] [--dtype auto] [--generic]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
import uuid
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import bench_model_dir, save_results, smollm2_dir, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_engines.transformers.settings import FAST_DECODE, PREFIX_CACHE_MB  # noqa: E402


def long_text(engine: Any, tokens: int) -> str:
    """About ``tokens`` tokens of standard-library source, cut on a token boundary."""
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), encoding="utf-8") as fh:
        source = fh.read() * 4
    ids = engine.encode(source, add_special_tokens=False)[:tokens]
    return str(engine.decode(ids))


def ttft(base_url: str, system: str, question: str) -> tuple[float, int]:
    """Seconds from sending a streamed chat to its first content chunk, and the request's
    cached prompt tokens (from the usage chunk)."""
    body = {
        "model": "bench",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    cached = -1
    with CLIENT.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=900) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if first is None:
        raise RuntimeError("no content chunk")
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["smollm2", "bench"], default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--generic", action="store_true", help="the generic HF forward (--fast-decode false)")
    args = parser.parse_args()
    configure_logging("console", "warning")
    settings = load_settings(
        {"log_level": "warning", "db": ":memory:", "dtype": args.dtype, "fast_decode": not args.generic},
        environ={},
        plugin_settings=[FAST_DECODE, PREFIX_CACHE_MB],
    )
    path = smollm2_dir() if args.model == "smollm2" else bench_model_dir()
    loaded: dict[str, Any] = {}

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=path, served_name="bench"), settings)
        engine.eos_token_ids = frozenset()  # every answer has a first content token
        loaded["engine"] = engine
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    with RunningServer(app) as server:
        wait_loaded(app)
        engine = loaded["engine"]
        assert engine.prefix is not None, "the prefix cache is off (--prefix-cache-mb 0, or a model whose rows do not join batches)"
        text = long_text(engine, args.prefix_tokens)
        ttft(server.base_url, "Warm-up.", "Hello.")
        ttft(server.base_url, text, "Cache this prefix.")
        fresh: list[float] = []
        reused: list[float] = []
        cached: dict[str, list[int]] = {"fresh": [], "reused": []}
        for i in range(args.samples):
            seconds, count = ttft(server.base_url, f"Session {uuid.uuid4().hex}.\n{text}", f"Question {i}?")
            fresh.append(seconds)
            cached["fresh"].append(count)
            seconds, count = ttft(server.base_url, text, f"Question {i}?")
            reused.append(seconds)
            cached["reused"].append(count)
    report: dict[str, Any] = {
        "model": f"{args.model} ({engine.info.dtype}{', generic forward' if args.generic else ''})",
        "prefix_tokens": args.prefix_tokens,
        "p50_ttft_s": {"fresh_prefix": statistics.median(fresh), "reused_prefix": statistics.median(reused)},
        "speedup": statistics.median(fresh) / statistics.median(reused),
        # On a shared machine a neighbour's burst can slow one sample several times over:
        # the fastest of each shows the work itself.
        "best_ttft_s": {"fresh_prefix": min(fresh), "reused_prefix": min(reused)},
        "speedup_best": min(fresh) / min(reused),
        "cached_tokens": cached,
        "samples": {"fresh_prefix": fresh, "reused_prefix": reused},
    }
    print(json.dumps(report))
    print(
        f"\nTTFT p50 with a ~{args.prefix_tokens}-token system prompt: fresh {report['p50_ttft_s']['fresh_prefix'] * 1000:.0f} ms, "
        f"reused {report['p50_ttft_s']['reused_prefix'] * 1000:.0f} ms -> {report['speedup']:.1f}x faster with reuse (target >= 5x; "
        f"fastest samples {report['speedup_best']:.1f}x); "
        f"cached tokens {statistics.median(cached['reused']):.0f} of ~{args.prefix_tokens}"
    )
    save_results("prefix.json", [report])


if __name__ == "__main__":
    main()
