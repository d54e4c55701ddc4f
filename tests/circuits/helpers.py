"""What the circuits tests share: SAE files, documents, requests, header parsing and the
hand-written reference intervention (torch forward hooks on the HF model)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

import http_sfv
import httpx
import numpy as np
import torch

D_SAE = 48
JSON = {"Content-Type": "application/json"}  # every write to /api says it sends JSON, a bodyless one too
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
TOKENS = 12
LADDER = {
    0: "associated",
    1: "suggested (attribution-supported)",
    2: "causally validated (edge)",
    3: "faithfulness-tested (circuit)",
}  # the specification's table, copied from it


def write_sae(folder: pathlib.Path, d_in: int, seed: int) -> str:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "W_enc": rng.normal(size=(d_in, D_SAE)).astype(np.float32),
            "b_enc": np.zeros(D_SAE, np.float32),
            "W_dec": rng.normal(size=(D_SAE, d_in)).astype(np.float32),
            "b_dec": np.zeros(d_in, np.float32),
        },
        str(folder / "sae_weights.safetensors"),
    )
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_in, "d_sae": D_SAE, "architecture": "standard"}))
    return str(folder)


def document(
    name: str,
    slices: Mapping[int, tuple[str, list[tuple[int, float]]]],
    *,
    rungs: list[int] | None = None,
    intensity: float = 1.0,
    intensity_range: list[float] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A circuit-definition document: ``slices`` is layer → (sae_id, [(feature, strength)]);
    each rung makes one edge from a member of the first layer to a member of the last: the
    first rung from the first member to the first, the next ones through the other pairs in
    order (an edge is listed once), and a one-layer circuit has no edges: rung 0."""
    layers = sorted(slices)
    budget: dict[str, Any] = {"intensity": intensity}
    if intensity_range is not None:
        budget["intensity_range"] = intensity_range
    edges = []
    if len(layers) > 1:
        up, down = layers[0], layers[-1]
        pairs = [(u, d) for u, _ in slices[up][1] for d, _ in slices[down][1]]
        wanted = rungs if rungs is not None else [2]
        assert len(wanted) <= len(pairs), "more edges than member pairs: an edge is listed once"
        for (u, d), rung in zip(pairs, wanted, strict=False):
            edges.append({"up": {"layer": up, "feature_idx": u}, "down": {"layer": down, "feature_idx": d}, "rung": rung})
    return {
        "name": name,
        "saes": [{"sae_id": slices[layer][0], "layer": layer} for layer in layers],
        "members": [{"layer": layer, "feature_idx": i, "strength": s} for layer in layers for i, s in slices[layer][1]],
        "edges": edges,
        "budget": budget,
        **extra,
    }


def chat(base_url: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0, **extra}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)


def content(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def members(value: str) -> list[tuple[str, dict[str, Any]]]:
    """``X-miLLM-Steering`` parsed with http-sfv: (kind, parameters) per member."""
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    return [(str(item.value), dict(item.params)) for item in parsed]


def rung(value: str) -> tuple[int, dict[str, Any]]:
    """``X-miLLM-Circuit-Rung`` parsed with http-sfv: the Integer and its parameters."""
    item = http_sfv.Item()
    item.parse(value.encode())
    assert isinstance(item.value, int) and not isinstance(item.value, bool)
    return item.value, dict(item.params)


def spec_hash(sae_id: str, features: list[tuple[int, float]]) -> str:
    """The specification's reference function, as a client would write it."""
    applied = {i: max(-200.0, min(200.0, float(s))) for i, s in features}
    applied = {i: s for i, s in applied.items() if s != 0.0}
    lines = ["millm.steering-set/v1", f"sae={sae_id}"] + [f"{i}:{struct.pack('>d', applied[i]).hex()}" for i in sorted(applied)]
    return "sha256:" + hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


Group = tuple[str, list[tuple[int, float]]]  # (SAE directory, [(feature, applied strength)])


def _direction(group: Group) -> np.ndarray:
    from safetensors.numpy import load_file

    path, features = group
    w_dec = load_file(str(pathlib.Path(path) / "sae_weights.safetensors"))["W_dec"]
    total = np.zeros(w_dec.shape[1], dtype=np.float64)
    for index, strength in features:
        total += max(-200.0, min(200.0, strength)) * w_dec[index].astype(np.float64)
    return total.astype(np.float32)


def reference(engine: Any, interventions: Mapping[int, Group | list[Group]], max_new_tokens: int = TOKENS) -> str:
    """Greedy HF ``generate`` with a forward hook on each decoder block in
    ``interventions`` adding Σ clamp(strength, ±200) · W_dec[feature] to the block's output:
    layer → one (SAE directory, [(feature, applied strength)]) group, or a list of groups
    (circuits composed at that layer: each group's vector in float32, then their sum)."""
    handles = []
    try:
        for layer, given in interventions.items():
            groups = given if isinstance(given, list) else [given]
            vector = _direction(groups[0])
            for group in groups[1:]:
                vector = vector + _direction(group)
            add = torch.tensor(np.asarray(vector, dtype=np.float32))
            handles.append(engine.model.model.layers[layer].register_forward_hook(lambda m, a, out, add=add: out + add))
        prompt = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = engine.model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(engine.eos_token_ids),
                pad_token_id=0,
            )
    finally:
        for handle in handles:
            handle.remove()
    new = out[0, len(ids) :].tolist()
    new = new[:-1] if new and new[-1] in engine.eos_token_ids else new
    return str(engine.tokenizer.decode(new, skip_special_tokens=True))


def scaled(features: list[tuple[int, float]], lam: float) -> list[tuple[int, float]]:
    """Authored strengths × λ, as the server must apply them (the clamp is the reference's)."""
    return [(i, s * lam) for i, s in features]
