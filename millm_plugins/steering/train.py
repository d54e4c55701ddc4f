"""``millm sae train``: a small standard (ReLU, L1) SAE on a served model's own residual
stream, written in SAELens format — so a steering demo needs nothing from a hub.

Text comes from local files (``--text``), or by default from the Python documentation
topics that ship with the interpreter (``pydoc_data``, ~110k tokens of English prose about
programming). Activations are block ``layer``'s output (resid_post), read through the
engine's :class:`~millm_core.engine.ResidualReader`; later blocks are not run.

Training follows common SAELens practice: inputs scaled so that E‖x‖² = d_in, decoder
rows kept at unit norm, ``b_dec`` started at the mean, the L1 coefficient warmed up over
the first 5 % of steps, Adam. The scale is folded into the saved weights
(``apply_b_dec_to_input: true``), so the files encode raw residuals and a decoder row is a
steering direction in the model's own units.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from millm_core.api import Command, ConfigError, ResidualReader, Settings

WINDOW = 128  # tokens per forward pass when collecting activations
BATCH = 1024  # tokens per training step


@dataclass(frozen=True)
class TrainConfig:
    layer: int
    features: int
    tokens: int
    epochs: int = 8
    l1: float = 2.0
    lr: float = 1e-3
    seed: int = 0


def corpus(paths: Sequence[str]) -> Iterator[str]:
    """The training text: the given files, else the interpreter's documentation topics."""
    if paths:
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield fh.read()
        return
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def windows(engine: Any, texts: Iterator[str], budget: int) -> list[list[int]]:
    """Token windows of ``WINDOW`` ids (each starting at a text boundary or mid-text),
    ``budget`` tokens in all."""
    out: list[list[int]] = []
    total = 0
    for text in texts:
        ids = engine.encode(text, add_special_tokens=False)
        for start in range(0, len(ids), WINDOW):
            piece = ids[start : start + WINDOW][: budget - total]
            if len(piece) < 8:
                continue
            out.append(piece)
            total += len(piece)
            if total >= budget:
                return out
    return out


def collect(engine: ResidualReader, chunks: list[list[int]], layer: int, progress: Any) -> np.ndarray:
    """Residuals ``[tokens, d_model]`` float32 for every window."""
    parts: list[np.ndarray] = []
    for start in range(0, len(chunks), 8):
        batch = chunks[start : start + 8]
        parts.extend(engine.residuals(batch, layer))
        progress.update(sum(len(c) for c in batch))
    return np.concatenate(parts).astype(np.float32)


def train(acts: np.ndarray, cfg: TrainConfig, progress_factory: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Train on ``acts``; returns SAELens arrays (raw residual units) and final stats."""
    import torch

    torch.manual_seed(cfg.seed)
    x_all = torch.from_numpy(acts)
    d_in = x_all.shape[1]
    scale = float(torch.sqrt((x_all.pow(2).sum(1)).mean() / d_in))
    x_all = x_all / scale
    w_dec = torch.randn(cfg.features, d_in)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    params = {
        "W_dec": torch.nn.Parameter(w_dec.clone()),
        "W_enc": torch.nn.Parameter(w_dec.t().contiguous()),
        "b_enc": torch.nn.Parameter(torch.zeros(cfg.features)),
        "b_dec": torch.nn.Parameter(x_all.mean(0).clone()),
    }
    optimiser = torch.optim.Adam(params.values(), lr=cfg.lr)
    steps = max(1, cfg.epochs * len(x_all) // BATCH)
    warmup = max(1, steps // 20)
    generator = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(x_all), generator=generator)
    with progress_factory(total=steps, desc="training", unit="step") as progress:
        for step in range(steps):
            offset = (step * BATCH) % len(x_all)
            if offset + BATCH > len(x_all):
                order = torch.randperm(len(x_all), generator=generator)
                offset = 0
            x = x_all[order[offset : offset + BATCH]]
            f = torch.relu((x - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
            x_hat = f @ params["W_dec"] + params["b_dec"]
            mse = (x_hat - x).pow(2).sum(1).mean()
            l1 = f.sum(1).mean()
            loss = mse + cfg.l1 * min(1.0, (step + 1) / warmup) * l1
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            with torch.no_grad():
                params["W_dec"].div_(params["W_dec"].norm(dim=1, keepdim=True).clamp_min(1e-8))
            if step % 25 == 0 or step == steps - 1:
                progress.set_postfix(mse=f"{mse.item():.1f}", l0=f"{(f > 0).float().sum(1).mean().item():.1f}")
            progress.update(1)
    with torch.no_grad():
        residual, active, fired = 0.0, 0.0, torch.zeros(cfg.features, dtype=torch.bool)
        for start in range(0, len(x_all), 8192):  # in chunks: [tokens, d_sae] at once can be GBs
            x = x_all[start : start + 8192]
            f = torch.relu((x - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
            residual += float((f @ params["W_dec"] + params["b_dec"] - x).pow(2).sum())
            active += float((f > 0).sum())
            fired |= (f > 0).any(0)
        total = float((x_all - x_all.mean(0)).pow(2).sum())
        stats = {
            "explained_variance": 1 - residual / total,
            "l0": active / len(x_all),
            "dead_features": int((~fired).sum()),
            "scale": scale,
        }
        tensors = {"W_enc": params["W_enc"] / scale, "b_enc": params["b_enc"], "W_dec": params["W_dec"] * scale, "b_dec": params["b_dec"] * scale}
        # C order: safetensors writes the buffer as it lies, whatever the strides say.
        arrays = {name: np.ascontiguousarray(t.numpy(), dtype=np.float32) for name, t in tensors.items()}
    return arrays, stats


def write(out: str, arrays: dict[str, np.ndarray], cfg: TrainConfig, model: str, tokens: int, stats: dict[str, float]) -> None:
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    save_file(arrays, os.path.join(out, "sae_weights.safetensors"))
    d_in = int(arrays["W_enc"].shape[0])
    config = {
        "architecture": "standard",
        "d_in": d_in,
        "d_sae": cfg.features,
        "apply_b_dec_to_input": True,
        "dtype": "float32",
        "model_name": model,
        "hook_name": f"blocks.{cfg.layer}.hook_resid_post",
        "hook_layer": cfg.layer,
        "context_size": WINDOW,
        "normalize_activations": "none",
        "training_tokens": tokens,
        "l1_coefficient": cfg.l1,
        "trained_by": "millm sae train",
        **{f"final_{k}": v for k, v in stats.items()},
    }
    with open(os.path.join(out, "cfg.json"), "w") as fh:
        json.dump(config, fh, indent=2)


def _configure(parser: argparse.ArgumentParser, add_settings: Callable[[argparse.ArgumentParser], None]) -> None:
    sub = parser.add_subparsers(dest="sae_command", required=True)
    trainer = sub.add_parser("train", help="train a small SAE on the model's residual stream (SAELens format)")
    trainer.add_argument("--layer", type=int, required=True, help="decoder block whose output (resid_post) the SAE reads")
    trainer.add_argument("--features", type=int, default=2048, help="SAE width d_sae (default 2048)")
    trainer.add_argument("--tokens", type=int, default=100_000, help="training tokens to collect (default 100000)")
    trainer.add_argument("--epochs", type=int, default=8, help="passes over the collected tokens (default 8)")
    trainer.add_argument("--l1", type=float, default=2.0, help="L1 coefficient on feature activations (default 2)")
    trainer.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 0.001)")
    trainer.add_argument("--seed", type=int, default=0)
    trainer.add_argument("--text", action="append", default=[], help="a UTF-8 text file to train on (repeatable; default: the Python docs topics)")
    trainer.add_argument("--out", required=True, help="output directory (cfg.json + sae_weights.safetensors)")
    add_settings(trainer)


def _run(args: argparse.Namespace, settings: Settings) -> int:
    from tqdm import tqdm

    from millm_core.api import load_served_model, progress_disabled

    for name, value, low in (("--features", args.features, 1), ("--tokens", args.tokens, 256), ("--epochs", args.epochs, 1)):
        if value < low:
            raise ConfigError(f"{name} must be at least {low}")
    if not (math.isfinite(args.l1) and args.l1 >= 0 and math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError("--l1 must be ≥ 0 and --lr > 0")
    for text in args.text:  # checked before the model loads
        if not os.path.isfile(text):
            raise ConfigError(f"--text {text!r} is no file")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is a file; name a directory (it is created if missing)")
    cfg = TrainConfig(layer=args.layer, features=args.features, tokens=args.tokens, epochs=args.epochs, l1=args.l1, lr=args.lr, seed=args.seed)
    model = load_served_model(settings)
    engine = model.engine
    if not isinstance(engine, ResidualReader):
        raise ConfigError(f"the {engine.info.engine} engine cannot read residuals, so it cannot train an SAE")
    if not 0 <= cfg.layer < engine.info.n_layers:
        raise ConfigError(f"--layer must be 0–{engine.info.n_layers - 1} for {model.info.served_name}")
    started = time.monotonic()
    chunks = windows(engine, corpus(args.text), cfg.tokens)
    tokens = sum(len(c) for c in chunks)
    if tokens < cfg.tokens:
        sys.stderr.write(f"note: the text holds {tokens} tokens, fewer than --tokens {cfg.tokens}; training on all of it\n")
    quiet = progress_disabled()  # never into JSON logs
    with tqdm(total=tokens, desc="activations", unit="tok", file=sys.stderr, disable=quiet) as progress:
        acts = collect(engine, chunks, cfg.layer, progress)
    arrays, stats = train(acts, cfg, lambda **kw: tqdm(file=sys.stderr, disable=quiet, **kw))
    write(args.out, arrays, cfg, model.info.served_name, tokens, stats)
    summary = {"out": os.path.abspath(args.out), "model": model.info.served_name, "layer": cfg.layer, "d_sae": cfg.features, "tokens": tokens, **stats}
    summary["seconds"] = round(time.monotonic() - started, 1)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


COMMAND = Command(name="sae", help="work with sparse autoencoders (train)", configure=_configure, run=_run)
