"""The cost of an active circuit on decode, in one run.

For each model it streams the same greedy chat request through the HTTP server (openai SDK)
with an active 2-layer, 20-member circuit (10 features on each of two SAEs, at a third and
two thirds of the depth) and with no circuit active, alternating the two ``--repeats``
times, and compares the median decode rates (tokens after the first, over the time after
it) and end-to-end rates. Target: the circuit costs at most 5 % of decode speed. EOS is
disabled, so every run generates exactly ``--tokens`` tokens. Results go to stdout and
bench/results/circuits.json.

Usage: python bench/bench_circuits.py [--models bench,smollm2] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import openai  # noqa: E402
from bench_decode import PROMPT, bench_model_dir, save_results, smollm2_dir, wait_loaded  # noqa: E402
from client import CLIENT  # noqa: E402

from millm_core.config import load_settings  # noqa: E402
from millm_core.engine import ModelLocation  # noqa: E402
from millm_core.logs import configure_logging  # noqa: E402
from millm_core.registry import ServedModel  # noqa: E402
from millm_core.server.app import build_host, create_app  # noqa: E402
from millm_core.testing import RunningServer  # noqa: E402
from millm_engines.transformers.loader import load_engine  # noqa: E402

D_SAE = 1024
MEMBERS_PER_LAYER = 10
JSON = {"Content-Type": "application/json"}


def write_sae(folder: Path, d_model: int, seed: int) -> str:
    """A random SAE with unit-norm decoder rows (the speed does not depend on the weights)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    w_dec = rng.normal(size=(D_SAE, d_model))
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    folder.mkdir(parents=True)
    arrays = {"W_enc": w_dec.T.copy(), "b_enc": np.zeros(D_SAE), "W_dec": w_dec, "b_dec": np.zeros(d_model)}
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_model, "d_sae": D_SAE, "architecture": "standard"}))
    return str(folder)


def circuit_document(layers: list[int]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    members = [
        {"layer": layer, "feature_idx": int(i), "strength": float(rng.uniform(0.2, 1.0))}
        for layer in layers
        for i in rng.choice(D_SAE, MEMBERS_PER_LAYER, replace=False)
    ]
    first = {layer: next(m["feature_idx"] for m in members if m["layer"] == layer) for layer in layers}
    edge = {
        "up": {"layer": layers[0], "feature_idx": first[layers[0]]},
        "down": {"layer": layers[1], "feature_idx": first[layers[1]]},
        "rung": 2,
    }
    return {
        "name": "bench",
        "saes": [{"sae_id": f"bench-l{layer}", "layer": layer} for layer in layers],
        "members": members,
        "edges": [edge],
    }


def run_model(name: str, path: str, dtype: str, tokens: int, repeats: int) -> dict[str, Any]:
    settings = load_settings({"dtype": dtype, "log_level": "warning", "db": ":memory:"}, environ={})
    loaded: dict[str, Any] = {}

    def loader() -> ServedModel:
        engine = load_engine(ModelLocation(path=path, served_name=name), settings)
        engine.eos_token_ids = frozenset()  # every run generates exactly `tokens` tokens
        loaded["engine"] = engine
        return ServedModel(info=engine.info, engine=engine)

    app = create_app(settings, host=build_host(settings), loader=loader)
    rates: dict[str, list[float]] = {"unsteered": [], "circuit": []}
    decode: dict[str, list[float]] = {"unsteered": [], "circuit": []}
    with RunningServer(app) as server, tempfile.TemporaryDirectory() as folder:
        wait_loaded(app)
        info = loaded["engine"].info
        layers = [info.n_layers // 3, 2 * info.n_layers // 3]
        api = server.base_url + "/api"
        for layer in layers:
            sae = write_sae(Path(folder) / f"l{layer}", info.d_model, seed=layer)
            CLIENT.post(api + "/saes", json={"path": sae, "id": f"bench-l{layer}"}).raise_for_status()
            CLIENT.post(api + f"/saes/bench-l{layer}/attach", json={"layer": layer}).raise_for_status()
        imported = CLIENT.post(api + "/circuits/import", json=circuit_document(layers))
        imported.raise_for_status()
        circuit_id = imported.json()["id"]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="bench", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]

        def stream(steered: bool) -> tuple[float, float]:
            action = "activate" if steered else "deactivate"
            CLIENT.post(api + f"/circuits/{circuit_id}/{action}", json={}).raise_for_status()
            start = time.perf_counter()
            first: float | None = None
            raw = client.chat.completions.with_raw_response.create(
                model=name, messages=messages, temperature=0, max_tokens=tokens, stream=True
            )  # type: ignore[arg-type]
            assert ("x-millm-circuit-rung" in raw.headers) == steered
            for chunk in raw.parse():
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            total = time.perf_counter() - start
            assert first is not None
            return tokens / total, (tokens - 1) / (total - first)

        for steered in (True, False):  # warm-up
            stream(steered)
        for repeat in range(repeats):
            for steered in (True, False) if repeat % 2 else (False, True):
                key = "circuit" if steered else "unsteered"
                rate, decoding = stream(steered)
                rates[key].append(rate)
                decode[key].append(decoding)
    med = {k: statistics.median(v) for k, v in rates.items()}
    dec = {k: statistics.median(v) for k, v in decode.items()}
    return {
        "model": name,
        "dtype": dtype,
        "tokens": tokens,
        "circuit": {"layers": layers, "members": MEMBERS_PER_LAYER * len(layers), "d_sae": D_SAE},
        "tok_per_s": {k: round(v, 2) for k, v in med.items()},
        "decode_tok_per_s": {k: round(v, 2) for k, v in dec.items()},
        "ratio": round(med["circuit"] / med["unsteered"], 3),
        "decode_ratio": round(dec["circuit"] / dec["unsteered"], 3),
        "samples": {"end_to_end": rates, "decode": decode},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench,smollm2", help="comma list of: bench, smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    configure_logging("console", "warning")
    plan = {"bench": (bench_model_dir, "float32"), "smollm2": (smollm2_dir, "bfloat16")}
    reports = []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        locate, dtype = plan[key]
        report = run_model(key, locate(), dtype, args.tokens, args.repeats)
        reports.append(report)
        print(json.dumps(report), file=sys.stderr)
    print("\nstreamed greedy decode, tokens/s: an active 2-layer, 20-member circuit against no circuit (target: ratio >= 0.95)")
    print(f"{'model':<10}{'dtype':>10}{'unsteered':>11}{'circuit':>9}{'ratio':>7}{'decode':>9}{'circuit':>9}{'ratio':>7}")
    for r in reports:
        t, d = r["tok_per_s"], r["decode_tok_per_s"]
        print(
            f"{r['model']:<10}{r['dtype']:>10}{t['unsteered']:>11.1f}{t['circuit']:>9.1f}{r['ratio']:>7.2f}"
            f"{d['unsteered']:>9.1f}{d['circuit']:>9.1f}{r['decode_ratio']:>7.2f}"
        )
    save_results("circuits.json", reports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
