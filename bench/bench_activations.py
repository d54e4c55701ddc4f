"""The cost of per-request SAE activations on SmolLM2-135M, in one run: decode tok/s of a
greedy request that asks for ``return_sae_activations`` (top_k 8, every completion
position, a 2048-feature SAE at layer 10) against the same request without it, alone and
8 at once (target: ≤ 5 % slower). Runs alternate and medians are compared.

Usage: python bench/bench_activations.py [--tokens 128] [--requests 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from bench_decode import aggregate_rate, save_results, smollm2_dir, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

LAYER, D_SAE = 10, 2048
ASK = {"top_k": 8, "positions": "completion"}
PROMPTS = ["Write about the sea.", "Describe a market.", "Explain bread.", "A letter home.", "A village history.", "How violins are made.", "A robot painter.", "Why sunsets are red."]


def write_sae(folder: Path, d_model: int) -> str:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"W_enc": rng.normal(size=(d_model, D_SAE)) / np.sqrt(d_model), "b_enc": np.zeros(D_SAE), "W_dec": rng.normal(size=(D_SAE, d_model)), "b_dec": np.zeros(d_model)}
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_model, "d_sae": D_SAE, "architecture": "standard"}))
    return str(folder)


def chat(base_url: str, prompt: str, tokens: int, read: bool) -> int:
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    if read:
        body["return_sae_activations"] = ASK
    reply = CLIENT.post(base_url + "/v1/chat/completions", json=body, timeout=600).json()
    assert ("millm" in reply) == read, reply
    return int(reply["usage"]["completion_tokens"])


def rate(base_url: str, n: int, tokens: int, read: bool) -> float:
    """Aggregate generated tokens per second of ``n`` requests sent at once."""
    return aggregate_rate(lambda i: chat(base_url, PROMPTS[i % len(PROMPTS)], tokens, read), n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = load_settings({"log_level": "warning", "db": ":memory:"}, environ={})
    engine = load_engine(ModelLocation(path=smollm2_dir(), served_name="bench"), settings)

    def loader() -> ServedModel:
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    single: dict[str, list[float]] = {"plain": [], "activations": []}
    batch: dict[str, list[float]] = {"plain": [], "activations": []}
    with tempfile.TemporaryDirectory() as folder, RunningServer(app) as server:
        wait_loaded(app)
        d_model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["millm"]["d_model"]
        path = write_sae(Path(folder) / "sae", d_model)
        assert CLIENT.post(server.base_url + "/api/saes", json={"path": path, "id": "bench"}).status_code == 201
        assert CLIENT.post(server.base_url + "/api/saes/bench/attach", json={"layer": LAYER}).status_code == 200
        chat(server.base_url, PROMPTS[0], 4, True)  # warm-up
        for repeat in range(args.repeats):
            for read in (False, True) if repeat % 2 == 0 else (True, False):
                key = "activations" if read else "plain"
                single[key].append(rate(server.base_url, 1, args.tokens, read))
                batch[key].append(rate(server.base_url, args.requests, args.tokens, read))
    one = {k: statistics.median(v) for k, v in single.items()}
    many = {k: statistics.median(v) for k, v in batch.items()}
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (auto dtype)",
        "sae": {"layer": LAYER, "d_sae": D_SAE},
        "ask": ASK,
        "tokens": args.tokens,
        "requests": args.requests,
        "single_tok_per_s": one,
        "single_ratio": one["activations"] / one["plain"],
        "aggregate_tok_per_s": many,
        "aggregate_ratio": many["activations"] / many["plain"],
        "samples": {"single": single, "batch": batch},
    }
    print(json.dumps(report))
    print(
        f"\none request: {one['plain']:.1f} tok/s plain, {one['activations']:.1f} tok/s with activations -> {report['single_ratio']:.3f}x\n"
        f"{args.requests} at once: {many['plain']:.1f} tok/s plain, {many['activations']:.1f} tok/s with activations "
        f"-> {report['aggregate_ratio']:.3f}x (target >= 0.95x)"
    )
    save_results("activations.json", [report])


if __name__ == "__main__":
    main()
