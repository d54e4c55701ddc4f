"""Scoring throughput against raw forward passes, in one run.

(a) the model's own forward on the 64 left-padded prompts, last-position logits only —
    the least work that can answer, but each prompt's numbers then depend on the others'
    lengths (padding);
(c) the model's own forward on each prompt alone, last-position logits only — the least
    work that answers each prompt as it is alone, as millm does (a and c run on the
    server's scheduler thread);
(b) the same 64 prompts as one /v1/completions scoring request (logprobs 5, max_tokens 1)
    through the HTTP server.
Prints prompts/s for each, b/c (millm against the same work done raw; target >= 0.9) and
c/a (what an answer of its own costs against a padded batch). Runs alternate; medians are
compared.

Usage: python bench/bench_scoring.py [--models bench,smollm2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from bench_decode import bench_model_dir, save_results, smollm2_dir  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.plugins import PluginHost  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

WORDS = "the river keeper map storm lantern island harbour north quiet ship bright winter signal rope tide".split()


def prompts(count: int = 64) -> list[str]:
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60 + (i % 9) * 5)]
        out.append(" ".join(words) + ". Answer:")
    return out


def run_model(name: str, path: str, dtype: str, repeats: int) -> dict[str, Any]:
    declared = PluginHost.declared_settings()
    settings = load_settings({"dtype": dtype, "log_level": "warning", "db": ":memory:"}, environ={}, plugin_settings=declared)
    loaded: dict[str, Any] = {}

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=path, served_name=name), settings)
        loaded["engine"] = engine
        return ServedModel(info=engine.info, engine=engine)

    texts = prompts()
    app = create_app(settings, host=build_host(settings), loader=loader)
    with RunningServer(app) as server:
        while not len(app.state.millm.models):
            if app.state.millm.load_error:
                raise RuntimeError(app.state.millm.load_error)
            time.sleep(0.1)
        engine, scheduler = loaded["engine"], app.state.millm.scheduler
        ids = [engine.encode(t, add_special_tokens=True) for t in texts]
        width = max(len(i) for i in ids)
        batch = torch.full((len(ids), width), engine._pad_id, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for row, seq in enumerate(ids):
            batch[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        def raw() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                engine.model(input_ids=batch, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1)
            return len(ids) / (time.perf_counter() - start)

        alone = [torch.tensor([seq]) for seq in ids]

        def raw_alone() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                for one in alone:
                    engine.model(input_ids=one, use_cache=False, logits_to_keep=1)
            return len(ids) / (time.perf_counter() - start)

        body = {"model": name, "prompt": texts, "max_tokens": 1, "logprobs": 5}

        def http() -> float:
            start = time.perf_counter()
            resp = CLIENT.post(server.base_url + "/v1/completions", json=body, timeout=600)
            assert resp.status_code == 200, resp.text
            return len(ids) / (time.perf_counter() - start)

        variants = {
            "a_raw_forward": lambda: scheduler.call(raw).result(),
            "c_raw_each_alone": lambda: scheduler.call(raw_alone).result(),
            "b_http_scoring": http,
        }
        for fn in variants.values():
            fn()
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(repeats):
            for key, fn in variants.items():
                samples[key].append(fn())
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "model": name,
        "dtype": dtype,
        "prompts": len(ids),
        "mean_prompt_tokens": round(sum(len(i) for i in ids) / len(ids), 1),
        "prompts_per_s": {k: round(v, 2) for k, v in med.items()},
        "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "ratio_b/a": round(med["b_http_scoring"] / med["a_raw_forward"], 3),
        "ratio_b/c": round(med["b_http_scoring"] / med["c_raw_each_alone"], 3),
        "ratio_c/a": round(med["c_raw_each_alone"] / med["a_raw_forward"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench,smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    configure_logging("console", "warning")
    plan = {"bench": (bench_model_dir, "float32"), "smollm2": (smollm2_dir, "bfloat16")}
    reports = []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        locate, dtype = plan[key]
        reports.append(run_model(key, locate(), dtype, args.repeats))
        print(json.dumps(reports[-1]), file=sys.stderr)
    print(f"\nscoring 64 prompts in one request (prompts/s)\n{'model':<10}{'dtype':>10}{'tokens':>8}{'a padded':>10}{'c alone':>9}{'b http':>8}{'b/c':>6}{'c/a':>6}")
    for r in reports:
        p = r["prompts_per_s"]
        print(
            f"{r['model']:<10}{r['dtype']:>10}{r['mean_prompt_tokens']:>8}{p['a_raw_forward']:>10.1f}{p['c_raw_each_alone']:>9.1f}"
            f"{p['b_http_scoring']:>8.1f}{r['ratio_b/c']:>6.2f}{r['ratio_c/a']:>6.2f}"
        )
    save_results("scoring.json", reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
