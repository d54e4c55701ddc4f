"""Loading SAEs from SAELens directories and Gemma Scope npz files."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from millm_plugins.steering.sae import SAEFormatError, load_sae

D_IN, D_SAE = 8, 32


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W_enc": rng.normal(size=(D_IN, D_SAE)).astype(np.float32),
        "b_enc": rng.normal(size=D_SAE).astype(np.float32),
        "W_dec": rng.normal(size=(D_SAE, D_IN)).astype(np.float32),
        "b_dec": rng.normal(size=D_IN).astype(np.float32),
        "threshold": np.abs(rng.normal(size=D_SAE)).astype(np.float32),
    }


def saelens(tmp: pathlib.Path, architecture: str, **cfg: object) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    data = arrays()
    if architecture != "jumprelu":
        data.pop("threshold")
    save_file(data, str(tmp / "sae_weights.safetensors"))
    (tmp / "cfg.json").write_text(json.dumps({"d_in": D_IN, "d_sae": D_SAE, "architecture": architecture, **cfg}))
    return str(tmp)


def test_standard_encode_and_direction(tmp_path: pathlib.Path) -> None:
    sae = load_sae(saelens(tmp_path / "s", "standard", apply_b_dec_to_input=True))
    w = arrays()
    x = np.random.default_rng(1).normal(size=(3, D_IN)).astype(np.float32)
    expected = np.maximum((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0)
    assert np.allclose(sae.encode(x), expected, atol=1e-5)
    assert np.allclose(sae.direction([(2, 1.5), (7, -2.0)]), 1.5 * w["W_dec"][2] - 2.0 * w["W_dec"][7], atol=1e-6)
    sae.check_model(D_IN)
    with pytest.raises(SAEFormatError):
        sae.check_model(D_IN + 1)


def test_jumprelu_and_topk(tmp_path: pathlib.Path) -> None:
    w = arrays()
    x = np.random.default_rng(2).normal(size=(4, D_IN)).astype(np.float32)
    pre = x @ w["W_enc"] + w["b_enc"]
    jump = load_sae(saelens(tmp_path / "j", "jumprelu", apply_b_dec_to_input=False))
    assert np.allclose(jump.encode(x), np.where(pre > w["threshold"], pre, 0), atol=1e-5)
    topk = load_sae(saelens(tmp_path / "t", "topk", k=3, apply_b_dec_to_input=False))
    acts = topk.encode(x)
    assert ((acts > 0).sum(axis=-1) <= 3).all()
    for row in range(4):
        best = np.argsort(-np.maximum(pre[row], 0))[:3]
        assert np.allclose(acts[row][best], np.maximum(pre[row][best], 0), atol=1e-5)


def test_saelens_defaults_and_a_negative_jumprelu_threshold(tmp_path: pathlib.Path) -> None:
    """SAELens' SAEConfig subtracts b_dec by default, and its JumpReLU is
    ReLU(pre) · (pre > threshold): a negative threshold never lets a negative value out."""
    w = arrays()
    folder = tmp_path / "neg"
    folder.mkdir()
    w["threshold"] = np.full(D_SAE, -0.5, np.float32)
    save_file(w, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": D_IN, "d_sae": D_SAE, "architecture": "jumprelu"}))
    sae = load_sae(str(folder))
    assert sae.apply_b_dec_to_input
    x = np.random.default_rng(3).normal(size=(5, D_IN)).astype(np.float32)
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    assert (pre < 0).any() and (pre > -0.5).any()  # the case that matters is present
    expected = np.maximum(pre, 0) * (pre > -0.5)
    assert np.allclose(sae.encode(x), expected, atol=1e-5)
    assert sae.encode_refusal is None
    normalised = load_sae(saelens(tmp_path / "n", "standard", normalize_activations="expected_average_only_in"))
    assert normalised.encode_refusal is not None and "normalize_activations" in normalised.encode_refusal


def test_gemma_scope_npz(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "params.npz"
    np.savez(path, **arrays())
    sae = load_sae(str(path))
    assert (sae.architecture, sae.d_in, sae.d_sae) == ("jumprelu", D_IN, D_SAE)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d, c: d.update(W_dec=d["W_dec"][:, :-1]), "W_dec has shape"),
        (lambda d, c: d.pop("b_enc"), "missing arrays"),
        (lambda d, c: c.update(architecture="gated"), "architecture"),
        (lambda d, c: c.update(d_sae=99), "cfg.json says d_sae=99"),
        (lambda d, c: (c.update(architecture="topk"), c.pop("k", None)), "needs k"),
    ],
)
def test_bad_files_are_refused_clearly(tmp_path: pathlib.Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = arrays()
    data.pop("threshold")
    cfg: dict[str, object] = {"d_in": D_IN, "d_sae": D_SAE, "architecture": "standard"}
    mutate(data, cfg)
    save_file(data, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFormatError, match=message) as info:
        load_sae(str(tmp_path))
    assert info.value.status == 400 and info.value.code == "invalid_sae"


def test_not_an_sae(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SAEFormatError):
        load_sae(str(tmp_path / "nothing"))
