"""The cost of armed probes on decode, in one run: greedy decode tokens/s over HTTP with 4
probes armed (each on several windows, at four layers, residual heads) against the same
requests with none armed, at one stream and at ``--concurrent`` streams sharing decode
steps. Target: armed ≥ 0.95× unarmed.

The probes are real: their test vectors' expected scores are computed here from the
engine's residuals with numpy, and they pass every arming gate. Runs alternate (none,
armed, none, …) and medians are compared; EOS is disabled so that every request generates
exactly ``--tokens`` tokens.

Usage: python bench/bench_probes.py [--model bench|smollm2] [--tokens 128] [--concurrent 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from bench_decode import bench_model_dir, save_results, smollm2_dir  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

PROMPTS = ["Write a story about a lighthouse keeper.", "Describe a busy harbour.", "Explain how bread rises.", "A letter home from sea."]
JSON = {"Content-Type": "application/json"}


def probe(engine: Any, index: int, layer: int, aggregation: str, read_point: str) -> dict[str, Any]:
    """A random residual head at ``layer``; its test vectors scored here with numpy."""
    rng = np.random.default_rng(index)
    d = engine.info.d_model
    w, b = rng.normal(size=d) / np.sqrt(d), float(rng.normal())
    tests = []
    rendered = [engine.render_chat([{"role": "user", "content": text}]) for text in PROMPTS[:2]]
    reads = [x.astype(np.float64) for x in engine.residuals(rendered, layer)]
    pooled = np.concatenate(reads)
    mean, std = pooled.mean(0), pooled.std(0) + 1e-3  # normalised, so that logits are of order 1
    for ids, x in zip(rendered, reads, strict=True):
        z = ((x - mean) / std) @ w + b
        agg = {"mean": z.mean(), "max": z.max(), "last": z[-1]}[aggregation]
        tests.append({"token_ids": ids, "expected": float(1 / (1 + np.exp(-agg)))})
    template = engine.chat_template
    return {
        "id": f"bench-{index}", "name": f"bench-{index}", "layer": layer, "read_point": read_point, "aggregation": aggregation,
        "head": {"weights": w.tolist(), "bias": b, "normalization": {"mean": mean.tolist(), "std": std.tolist()}}, "decision": {"threshold": 0.5}, "evidence": {"rung": 2},
        "model": {"d_model": d, "n_layers": engine.info.n_layers,
                  "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None},
        "test_vectors": tests,
    }  # fmt: skip


def chat(base_url: str, prompt: str, tokens: int) -> tuple[int, float, bool]:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    started = time.perf_counter()
    reply = CLIENT.post(base_url + "/v1/chat/completions", json=body, timeout=600).json()
    return int(reply["usage"]["completion_tokens"]), time.perf_counter() - started, "millm_probe_verdicts" in reply


def rate(base_url: str, tokens: int, streams: int, armed: bool) -> float:
    """Aggregate generated tokens/s of ``streams`` concurrent requests."""
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(lambda i: chat(base_url, PROMPTS[i % len(PROMPTS)], tokens), range(streams)))
    elapsed = time.perf_counter() - started
    assert all(count == tokens for count, _, _ in done)
    assert all(verdicts == armed for _, _, verdicts in done), "the armed runs must carry verdicts, the others none"
    return sum(count for count, _, _ in done) / elapsed


def run(name: str, path: str, dtype: str, tokens: int, concurrent: int, repeats: int) -> dict[str, Any]:
    settings = load_settings({"dtype": dtype, "log_level": "warning", "db": ":memory:"}, environ={})
    loaded: dict[str, Any] = {}

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=path, served_name="bench"), settings)
        engine.eos_token_ids = frozenset()  # every request generates exactly `tokens` tokens
        loaded["engine"] = engine
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    with RunningServer(app) as server:
        deadline = time.monotonic() + 600
        while "engine" not in loaded or not len(app.state.millm.models):
            if time.monotonic() > deadline or app.state.millm.load_error:
                raise RuntimeError(f"model did not load: {app.state.millm.load_error}")
            time.sleep(0.1)
        engine, api = loaded["engine"], server.base_url
        n = engine.info.n_layers
        specs = [
            (max(0, n // 4 - 1), "mean", "pre_steering"),
            (n // 2, "max", "post_steering"),
            (3 * n // 4, "last", "pre_steering"),
            (n - 1, "mean", "pre_steering"),
        ]
        documents = [app.state.millm.scheduler.call(lambda i=i, s=s: probe(engine, i, *s)).result() for i, s in enumerate(specs)]
        for doc in documents:
            assert CLIENT.post(api + "/api/probes/import", json=doc).status_code == 201
        windows = [["all", "response"], ["response", "last_user"], ["prompt", "response"], ["all", "last_user"]]

        def set_armed(on: bool) -> None:
            for doc, wins in zip(documents, windows, strict=True):
                if on:
                    resp = CLIENT.post(f"{api}/api/probes/{doc['id']}/arm", json={"windows": wins}, timeout=120)
                    assert resp.status_code == 200, resp.text
                else:
                    CLIENT.post(f"{api}/api/probes/{doc['id']}/disarm", json={})

        samples: dict[str, list[float]] = {"none_1": [], "armed_1": [], f"none_{concurrent}": [], f"armed_{concurrent}": []}
        for armed in (False, True):  # warm-up
            set_armed(armed)
            rate(api, tokens, 1, armed)
        for _ in range(repeats):
            for armed in (False, True):
                set_armed(armed)
                key = "armed" if armed else "none"
                samples[f"{key}_1"].append(rate(api, tokens, 1, armed))
                samples[f"{key}_{concurrent}"].append(rate(api, tokens, concurrent, armed))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "model": name, "dtype": dtype, "tokens": tokens, "probes": len(documents), "d_model": engine.info.d_model, "layers": n,
        "tok_per_s": {k: round(v, 2) for k, v in med.items()},
        "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "ratios": {"armed/none at 1": round(med["armed_1"] / med["none_1"], 3),
                   f"armed/none at {concurrent}": round(med[f"armed_{concurrent}"] / med[f"none_{concurrent}"], 3)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench", choices=["bench", "smollm2"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: bench float32, smollm2 bfloat16")
    args = parser.parse_args(argv)
    configure_logging("console", "warning")
    locate, dtype = {"bench": (bench_model_dir, "float32"), "smollm2": (smollm2_dir, "bfloat16")}[args.model]
    report = run(args.model, locate(), args.dtype or dtype, args.tokens, args.concurrent, args.repeats)
    print(json.dumps(report), file=sys.stderr)
    t, r = report["tok_per_s"], report["ratios"]
    c = args.concurrent
    print(
        f"\n4 armed probes vs none, {report['model']} ({report['dtype']}), {args.tokens} greedy tokens, tokens/s (medians of {args.repeats})"
    )
    print(f"{'streams':<10}{'none':>10}{'armed':>10}{'ratio':>8}")
    print(f"{1:<10}{t['none_1']:>10.1f}{t['armed_1']:>10.1f}{r['armed/none at 1']:>8.3f}")
    print(f"{c:<10}{t[f'none_{c}']:>10.1f}{t[f'armed_{c}']:>10.1f}{r[f'armed/none at {c}']:>8.3f}")
    save_results("probes.json", [report])
    return 0


if __name__ == "__main__":
    sys.exit(main())
