"""Sparse autoencoders from local files, read with numpy (no sae-lens dependency).

Formats:
- SAELens: a directory with ``cfg.json`` (``d_in``, ``d_sae``, ``architecture``:
  ``standard`` | ``jumprelu`` | ``topk``, ``apply_b_dec_to_input``, ``k`` for topk, …) and
  ``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``,
  ``W_dec [d_sae, d_in]``, ``b_dec [d_in]``; jumprelu adds ``threshold [d_sae]``);
- Gemma Scope: a ``params.npz`` with the same arrays (JumpReLU).

A feature's steering direction is its decoder row ``W_dec[i]``; a steering delta is
Σ strength_i · W_dec[i].
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from millm_core.api import InvalidRequest

ARCHITECTURES = ("standard", "jumprelu", "topk")


class SAEFormatError(InvalidRequest):
    code = "invalid_sae"


@dataclass(frozen=True)
class SAE:
    """An SAE's weights (float32) and how it encodes."""

    path: str
    architecture: str
    W_enc: np.ndarray
    b_enc: np.ndarray
    W_dec: np.ndarray
    b_dec: np.ndarray
    threshold: np.ndarray | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = False
    # SAELens' input normalisation; only "none" is encoded faithfully (SAE.encode_refusal).
    normalize_activations: str = "none"
    hook_name: str | None = None  # SAELens' hook point, e.g. blocks.10.hook_resid_pre

    @property
    def hook_layer(self) -> int | None:
        """The decoder block whose output (millm's attachment ``layer``) is the residual
        stream this SAE was trained on: ``blocks.N.hook_resid_post`` is block N's output,
        ``blocks.N.hook_resid_pre`` block N-1's. None when the hook is not recorded or not
        a residual-stream point."""
        point = hook_point(self.hook_name)
        return None if point is None else point[0]

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Feature activations for residual vectors ``x [..., d_in]``."""
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = _matmul(x, self.W_enc) + self.b_enc
        if self.architecture == "jumprelu":  # SAELens: ReLU(pre) where pre > threshold
            assert self.threshold is not None
            return np.where(pre > self.threshold, np.maximum(pre, 0.0), 0.0).astype(np.float32)
        acts = np.maximum(pre, 0.0)
        if self.architecture == "topk":
            assert self.k is not None
            cutoff = np.sort(acts, axis=-1)[..., -self.k][..., None]
            acts = np.where(acts >= cutoff, acts, 0.0)
        return acts.astype(np.float32)

    def restricted(self, features: Iterable[int]) -> SAE:
        """This SAE with only ``features`` (in that order): the same activations for them,
        computed from their encoder columns alone. Not for a topk SAE, whose activations
        depend on every feature."""
        if self.architecture == "topk":
            raise ValueError("a topk SAE's activations depend on every feature; encode it whole")
        index = np.asarray(list(features), dtype=np.int64)
        threshold = self.threshold[index] if self.threshold is not None else None
        return dataclasses.replace(
            self, W_enc=np.ascontiguousarray(self.W_enc[:, index]), b_enc=self.b_enc[index], W_dec=self.W_dec[index], threshold=threshold
        )

    @property
    def encode_refusal(self) -> str | None:
        """Why :meth:`encode` would not give SAELens' activations for this SAE (None: it
        does): an input normalisation millm does not apply."""
        if self.normalize_activations not in ("none", "", None):
            return f"its cfg.json asks for normalize_activations={self.normalize_activations!r}, which millm does not apply when encoding"
        return None

    def direction(self, features: Iterable[tuple[int, float]]) -> np.ndarray:
        """Σ strength · W_dec[index], float32 ``[d_in]``."""
        delta = np.zeros(self.d_in, dtype=np.float64)
        for index, strength in features:
            delta += float(strength) * self.W_dec[index].astype(np.float64)
        return delta.astype(np.float32)

    def check_model(self, d_model: int) -> None:
        if self.d_in != d_model:
            raise SAEFormatError(f"the SAE reads vectors of width {self.d_in}; the model's residual stream has width {d_model}", param="path")


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` on torch's thread pool when torch is there (it is on every engine that
    reads the residual stream): encoding runs on the model thread, and a second BLAS
    thread team there would fight torch's spinning threads for the cores."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of millm
        return np.asarray(x @ w)
    with torch.inference_mode():
        return (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) @ torch.from_numpy(w)).numpy()


_HOOK = re.compile(r"^blocks\.(?P<block>\d+)\.hook_resid_(?P<where>pre|post)$")


def hook_point(hook_name: str | None) -> tuple[int, str] | None:
    """``(attachment layer, hook name)`` for a residual-stream hook. ``resid_pre`` of block
    0 (the embeddings) has no block output to attach at: layer -1."""
    match = _HOOK.match(hook_name or "")
    if match is None:
        return None
    block = int(match["block"])
    return (block if match["where"] == "post" else block - 1), str(hook_name)


def _validate(path: str, arrays: dict[str, np.ndarray], architecture: str, k: int | None, apply_b_dec: bool) -> SAE:
    missing = [name for name in ("W_enc", "b_enc", "W_dec", "b_dec") if name not in arrays]
    if missing:
        raise SAEFormatError(f"{path}: missing arrays {missing}", param="path")
    if architecture not in ARCHITECTURES:
        raise SAEFormatError(f"{path}: architecture {architecture!r} is not one of {ARCHITECTURES}", param="path")
    W_enc, b_enc, W_dec, b_dec = (arrays[n].astype(np.float32) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    d_in, d_sae = W_enc.shape if W_enc.ndim == 2 else (-1, -1)
    expected = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    for name, array in (("W_enc", W_enc), ("b_enc", b_enc), ("W_dec", W_dec), ("b_dec", b_dec)):
        if array.shape != expected[name]:
            raise SAEFormatError(f"{path}: {name} has shape {array.shape}, expected {expected[name]}", param="path")
    threshold = arrays.get("threshold")
    if architecture == "jumprelu":
        if threshold is None or threshold.shape != (d_sae,):
            raise SAEFormatError(f"{path}: a jumprelu SAE needs threshold [{d_sae}]", param="path")
        threshold = threshold.astype(np.float32)
    if architecture == "topk" and not (k and 0 < k <= d_sae):
        raise SAEFormatError(f"{path}: a topk SAE needs k in 1..{d_sae} in cfg.json", param="path")
    named = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec, **({"threshold": threshold} if threshold is not None else {})}
    for name, array in named.items():
        if not np.isfinite(array).all():  # NaN or ±inf (or past float32's range): every encoding and delta would carry it
            raise SAEFormatError(f"{path}: {name} holds NaN or infinite values (as float32)", param="path")
    return SAE(path, architecture, W_enc, b_enc, W_dec, b_dec, threshold, k if architecture == "topk" else None, apply_b_dec)


def load_sae(path: str) -> SAE:
    """Load an SAE from a SAELens directory or a Gemma Scope ``params.npz``."""
    try:
        return _load(path)
    except SAEFormatError:
        raise
    except Exception as exc:  # a user's file: unreadable, a NUL in the path, malformed JSON or tensors
        raise SAEFormatError(f"{path!r}: cannot read an SAE there ({exc})", param="path") from exc


def _load(path: str) -> SAE:
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "cfg.json")
        weights = os.path.join(path, "sae_weights.safetensors")
        if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
            raise SAEFormatError(f"{path}: a SAELens directory needs cfg.json and sae_weights.safetensors", param="path")
        from safetensors.numpy import load_file

        with open(cfg_path) as fh:
            cfg = json.load(fh)
        arrays = load_file(weights)
        architecture = str(cfg.get("architecture", "standard"))
        k = cfg.get("k") or cfg.get("activation_fn_kwargs", {}).get("k")
        # SAELens' SAEConfig defaults apply_b_dec_to_input to true.
        sae = _validate(path, arrays, architecture, int(k) if k else None, bool(cfg.get("apply_b_dec_to_input", True)))
        sae = dataclasses.replace(sae, normalize_activations=str(cfg.get("normalize_activations") or "none"))
        # SAELens v6 keeps hook_name under metadata; older versions at the top level.
        hook = cfg.get("hook_name") or (cfg.get("metadata") or {}).get("hook_name")
        if isinstance(hook, str):
            sae = dataclasses.replace(sae, hook_name=hook)
        for key, value in (("d_in", sae.d_in), ("d_sae", sae.d_sae)):
            if key in cfg and int(cfg[key]) != value:
                raise SAEFormatError(f"{path}: cfg.json says {key}={cfg[key]} but the weights have {value}", param="path")
        return sae
    if path.endswith(".npz") and os.path.isfile(path):
        with np.load(path) as data:
            arrays = {name: data[name] for name in data.files}
        return _validate(path, arrays, "jumprelu", None, False)
    raise SAEFormatError(f"{path}: not a SAELens directory or a .npz file", param="path")
