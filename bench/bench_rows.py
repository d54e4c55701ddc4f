"""What batch invariance costs on the transformers engine's generic HF forward: greedy decode
steps with millm's row-wise attention (each row attends over its own cache columns, one
SDPA call per row; millm_engines.transformers.rows) against transformers' own SDPA over the
padded, masked cache (not invariant in bf16), on the same loaded model, in one run.

SmolLM2-135M-Instruct in bfloat16 with ``--fast-decode false`` (so the generic forward
serves it), rows of different prompt lengths, engine-level (no HTTP). Variants alternate;
medians of ``--repeats`` are compared (target from issue #15: invariance costs under 15 %).

Usage: python bench/bench_rows.py [--repeats 3] [--steps 12] [--rows 1 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode import save_results, smollm2_dir  # noqa: E402

from millm_core.api import RowSpec, SamplingParams  # noqa: E402
from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402
from millm_engines.transformers.rows import NAME  # noqa: E402
from millm_engines.transformers.settings import FAST_DECODE  # noqa: E402


def rate(engine: Any, rows: list[RowSpec], steps: int) -> float:
    """Decode tokens per second of ``rows`` over ``steps`` steps after their prefill."""
    batch = engine.open_batch(rows)
    try:
        engine.step(batch, [None] * len(rows))  # the prefill
        started = time.perf_counter()
        for _ in range(steps):
            engine.step(batch, [None] * len(rows))
        return len(rows) * steps / (time.perf_counter() - started)
    finally:
        engine.close(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    configure_logging("console", "warning")
    settings = load_settings({"dtype": "bfloat16", "fast_decode": False}, environ={}, plugin_settings=[FAST_DECODE])
    engine = load_engine(ModelLocation(path=smollm2_dir(), served_name="bench"), settings)
    assert engine.fast is None and engine.rows_refusal is None, "the generic forward with row-wise attention"
    texts = [f"Item {i}: " + "the sea and the sky " * (i + 1) for i in range(max(args.rows))]
    rows = [RowSpec(prompt_ids=tuple(engine.encode(t, add_special_tokens=True)), sampling=SamplingParams(temperature=0.0)) for t in texts]
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for impl in (NAME, "sdpa"):
            engine.model.set_attn_implementation(impl)
            for n in args.rows:
                samples.setdefault((impl, n), []).append(rate(engine, rows[:n], args.steps))
    engine.model.set_attn_implementation(NAME)
    reports = []
    print("rows | row-wise (invariant) tok/s | transformers SDPA tok/s | ratio")
    for n in args.rows:
        ours, theirs = statistics.median(samples[(NAME, n)]), statistics.median(samples[("sdpa", n)])
        print(f"{n} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.3f}")
        reports.append({"rows": n, "invariant_tok_s": ours, "sdpa_tok_s": theirs, "ratio": ours / theirs, "samples": {
            "invariant": samples[(NAME, n)], "sdpa": samples[("sdpa", n)]}})  # fmt: skip
    save_results("rows.json", reports)


if __name__ == "__main__":
    main()
