"""What the probe tests share: the offline reference (the tiny model hooked in the test,
a logistic regression fitted here in numpy), probe documents built from it, and small
HTTP helpers."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any

import httpx
import numpy as np

from ..engine.test_taps import hooked_reference

LAYER = 1
JSON = {"Content-Type": "application/json"}

SEA = ["ocean", "waves", "ships", "harbour", "tides", "sailors", "whales", "storms", "islands", "coral"]
CODE = ["function", "import", "return", "class", "module", "string", "buffer", "parser", "thread", "socket"]


SEA_FORM, CODE_FORM = "Tell me about the {a} and the {b}.", "def {a}_{b}(self): return self.{a}"


def prompts(form: str, words: list[str], start: int, step: int) -> list[str]:
    pairs = list(itertools.permutations(words, 2))[start::step]
    return [form.format(a=a, b=b) for a, b in pairs]


# Two synthetic classes: prose about the sea (the probe's positive class) and Python code.
# Training takes every 6th word pair, the held-out prompts others (every word appears in both).
TRAIN_SEA, TRAIN_CODE = prompts(SEA_FORM, SEA, 0, 6), prompts(CODE_FORM, CODE, 0, 6)
HELD_SEA, HELD_CODE = prompts(SEA_FORM, SEA, 3, 31), prompts(CODE_FORM, CODE, 3, 31)


def chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of a chat, from the tokenizer's own API (the template writes the BOS)."""
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def content_span(engine: Any, ids: list[int], text: str) -> tuple[int, int]:
    """Where the message's own tokens (the tokenizer's ids of the text alone) sit in ``ids``."""
    own = list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    start = next(i for i in range(len(ids)) if ids[i : i + len(own)] == own)
    return start, start + len(own)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def hooked(engine: Any, ids: list[int], layer: int = LAYER) -> np.ndarray:
    """Block ``layer``'s output over ``ids``: one HF forward with a hook written in the tests."""
    return np.asarray(hooked_reference(engine, ids, layer, None)["pre_steering"], dtype=np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0, steps: int = 50) -> tuple[np.ndarray, float]:
    """L2-regularised logistic regression by Newton's method (numpy only)."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1))])
    theta = np.zeros(d + 1)
    reg = l2 * np.eye(d + 1)
    reg[-1, -1] = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-xb @ theta))
        grad = xb.T @ (p - y) + reg @ theta
        hess = (xb * (p * (1 - p))[:, None]).T @ xb + reg
        theta -= np.linalg.solve(hess, grad)
    return theta[:-1], float(theta[-1])


def sigmoid(value: float) -> float:
    return float(1.0 / (1.0 + np.exp(-value)))


class Fitted:
    """A probe fitted on the tiny model's residuals (layer 1, mean over a chat's prompt
    positions): sea prose is class 1, code class 0."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # Each prompt gives two samples: its whole prompt and its message's own tokens, so
        # that both the prompt and the last_user windows are read the way it was fitted.
        feats, labels = [], []
        for text, label in [(t, 1.0) for t in TRAIN_SEA] + [(t, 0.0) for t in TRAIN_CODE]:
            ids = chat_ids(engine, user(text))
            start, end = content_span(engine, ids, text)
            residual = hooked(engine, ids)
            feats += [residual.mean(0), residual[start:end].mean(0)]
            labels += [label, label]
        x = np.stack(feats)
        self.mean, self.std = x.mean(0), x.std(0) + 1e-6
        y = np.array(labels)
        self.w, self.b = fit_logistic((x - self.mean) / self.std, y)

    def logits(self, residual: np.ndarray) -> np.ndarray:
        """Per-position logits, written out here from the definition."""
        return ((residual - self.mean) / self.std) @ self.w + self.b

    def score(self, ids: list[int], start: int = 0, end: int | None = None, how: str = "mean") -> float:
        z = self.logits(hooked(self.engine, ids))[start:end]
        agg = {"mean": z.mean(), "max": z.max(), "last": z[-1]}[how]
        return sigmoid(float(agg))

    def document(self, name: str = "sea", *, probe_id: str | None = None, rung: int = 2, vectors: int = 3, aggregation: str = "mean",
                 tamper: float = 0.0, **extra: Any) -> dict[str, Any]:  # fmt: skip
        """An ``mi.probe/v1`` document; its test vectors' expected scores come from here."""
        tests = []
        for i, text in enumerate((TRAIN_SEA[:2] + TRAIN_CODE[:2])[:vectors]):
            ids = chat_ids(self.engine, user(text))
            tests.append({"token_ids": ids, "expected": self.score(ids, how=aggregation) + (tamper if i == vectors - 1 else 0.0)})
        doc: dict[str, Any] = {
            "schema": "mi.probe/v1",
            "name": name,
            "layer": LAYER,
            "read_point": "pre_steering",
            "head": {"weights": self.w.tolist(), "bias": self.b, "normalization": {"mean": self.mean.tolist(), "std": self.std.tolist()}},
            "aggregation": aggregation,
            "decision": {"threshold": 0.5},
            "model": identity(self.engine),
            "evidence": {"rung": rung, "summary": "fitted in the test"},
            "test_vectors": tests,
            **extra,
        }
        if probe_id is not None:
            doc["id"] = probe_id
        return doc


def identity(engine: Any) -> dict[str, Any]:
    """The model identity, computed here from the model's config and tokenizer."""
    template = engine.tokenizer.chat_template
    return {
        "d_model": engine.model.config.hidden_size,
        "n_layers": engine.model.config.num_hidden_layers,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
    }


def ok(resp: httpx.Response, status: int = 200) -> Any:
    assert resp.status_code == status, resp.text
    return resp.json()


def import_probe(srv: Any, doc: dict[str, Any]) -> dict[str, Any]:
    return dict(ok(httpx.post(srv.base_url + "/api/probes/import", json=doc), 201))


def arm(srv: Any, probe_id: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/api/probes/{probe_id}/arm", json=body, timeout=60)


def disarm_all(srv: Any) -> None:
    for probe in ok(httpx.get(srv.base_url + "/api/probes"))["data"]:
        ok(httpx.delete(f"{srv.base_url}/api/probes/{probe['id']}", headers=JSON))


def chat(srv: Any, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)


def stream_lines(srv: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[httpx.Headers, list[Any]]:
    """A streamed chat's headers and its ``data:`` payloads (JSON, and the final "[DONE]")."""
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        return resp.headers, [json.loads(x) if x != "[DONE]" else x for x in lines]


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def stable(body: bytes) -> bytes:
    """A response body with its ``id`` and ``created`` values blanked."""
    return _VOLATILE.sub(rb'"\1":_', body)


D_SAE = 32


def write_sae(folder: Any, d_in: int, seed: int = 0, d_sae: int = D_SAE) -> str:
    """A standard (ReLU) SAE in the SAELens layout that subtracts b_dec from its input."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "W_enc": rng.normal(size=(d_in, d_sae)) / np.sqrt(d_in),
        "b_enc": rng.normal(scale=0.1, size=d_sae),
        "W_dec": rng.normal(size=(d_sae, d_in)),
        "b_dec": rng.normal(scale=0.1, size=d_in),
    }
    save_file({k: v.astype(np.float32) for k, v in arrays.items()}, str(folder / "sae_weights.safetensors"))
    cfg = {"d_in": d_in, "d_sae": d_sae, "architecture": "standard", "apply_b_dec_to_input": True}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def sae_encode(path: str, x: np.ndarray) -> np.ndarray:
    """ReLU((x - b_dec) W_enc + b_enc), written from the SAELens definition."""
    from safetensors.numpy import load_file

    w = {k: v.astype(np.float64) for k, v in load_file(path + "/sae_weights.safetensors").items()}
    return np.maximum((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0.0)


def sae_document(engine: Any, sae_path: str, sae_id: str, probe_id: str, seed: int = 1, width: int = D_SAE) -> dict[str, Any]:
    """A probe over an SAE's features (random head), its test vectors scored here."""
    rng = np.random.default_rng(seed)
    w, b = rng.normal(size=width), -0.5
    tests = []
    for text in TRAIN_SEA[:1] + TRAIN_CODE[:1]:
        ids = chat_ids(engine, user(text))
        feats = sae_encode(sae_path, hooked(engine, ids))
        tests.append({"token_ids": ids, "expected": sigmoid(float((feats @ w[: feats.shape[1]] + b).mean())) if width == D_SAE else 0.5})
    return {
        "id": probe_id, "name": probe_id, "layer": LAYER, "basis": {"kind": "sae_features", "sae_id": sae_id},
        "head": {"weights": w.tolist(), "bias": b}, "decision": {"threshold": 0.5}, "model": identity(engine),
        "evidence": {"rung": 3}, "test_vectors": tests,
    }  # fmt: skip
