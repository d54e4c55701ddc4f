"""``millm sae train`` on the tiny model, and the README walkthrough's steps: attach the
trained SAE, find the features that fire on a text, steer with one."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from millm_plugins.steering.sae import load_sae

from .test_inline import chat, parse

TEXT = "The ocean is deep and blue. Waves roll over the sand while sailors watch the tide.\n" * 80 + "def main():\n    return compute(x, y) + 1\n" * 80


def millm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "millm_core.cli", *args, "--log-level", "warning"], capture_output=True, text=True, timeout=300)


def hf_resid_post(engine: Any, ids: list[int], layer: int) -> np.ndarray:
    """Block ``layer``'s output from transformers' own hidden_states (index 0 is the
    embeddings), as an independent reference. Not for the last block: HF applies the final
    norm to the last entry."""
    assert layer + 1 < len(engine.model.model.layers)
    with torch.no_grad():
        out = engine.model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[layer + 1][0].float().numpy()


@pytest.fixture(scope="module")
def trained(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("train")
    text = folder / "corpus.txt"
    text.write_text(TEXT)
    out = folder / "sae"
    done = millm("sae", "train", "--model", tiny_dir, "--layer", "0", "--features", "64", "--tokens", "3000", "--epochs", "4", "--text", str(text), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "training" in done.stderr  # the progress bars
    return str(out), json.loads(done.stdout)


def test_trained_files_are_saelens_and_reproduce_the_reported_fit(trained, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    path, summary = trained
    cfg = json.loads((pathlib.Path(path) / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_in"], cfg["d_sae"], cfg["hook_name"]) == ("standard", tiny_engine.info.d_model, 64, "blocks.0.hook_resid_post")
    assert summary["tokens"] == 3000 and summary["d_sae"] == 64
    sae = load_sae(path)
    ids = tiny_engine.encode(TEXT, add_special_tokens=False)[:128]
    x = hf_resid_post(tiny_engine, ids, 0)
    acts = sae.encode(x)
    x_hat = acts @ sae.W_dec + sae.b_dec
    explained = 1 - ((x_hat - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    # The saved files (scale folded in) reconstruct raw residuals about as well as training reported.
    assert explained > 0.2 and abs(explained - summary["explained_variance"]) < 0.25
    assert 0 < (acts > 0).sum(1).mean() < 64  # sparse, not dead


def test_train_refuses_a_layer_the_model_lacks(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    done = millm("sae", "train", "--model", tiny_dir, "--layer", "7", "--features", "8", "--tokens", "300", "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "--layer must be 0–1" in done.stderr
    assert not (tmp_path / "x").exists()
    # A text that is not there, an --out that is a file: one line each, before the model loads.
    (tmp_path / "a-file").write_text("x")
    for extra, says in ((["--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "y")], "is no file"),
                        (["--out", str(tmp_path / "a-file")], "is a file; name a directory")):  # fmt: skip
        done = millm("sae", "train", "--model", tiny_dir, "--layer", "0", "--features", "8", "--tokens", "300", *extra)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-1500:]


def test_walkthrough_find_a_feature_and_steer_with_it(trained, make_server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = trained
    with make_server() as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": path, "id": "tiny-l1"}).status_code == 201
        httpx.post(srv.base_url + "/api/saes/tiny-l1/attach", json={"layer": 0})
        text = "Waves roll over the sand."
        found = httpx.post(srv.base_url + "/api/saes/tiny-l1/features", json={"text": text, "top_k": 5})
        assert found.status_code == 200, found.text
        report = found.json()
        ids = tiny_engine.encode(text, add_special_tokens=False)
        reference = load_sae(path).encode(hf_resid_post(tiny_engine, ids, 0))
        expected = [int(i) for i in np.argsort(-reference.max(0), kind="stable")[:5]]
        assert report["tokens"] == len(ids) and [f["index"] for f in report["features"]] == expected
        assert [f["max"] for f in report["features"]] == pytest.approx([float(reference[:, i].max()) for i in expected], rel=1e-4, abs=1e-4)
        top = report["features"][0]
        steered = chat(srv, steering={"features": [{"index": top["index"], "strength": 10 * top["max"]}]})
        plain = chat(srv)
        assert steered.json()["choices"][0]["message"]["content"] != plain.json()["choices"][0]["message"]["content"]
        [(kind, params)] = parse(steered.headers["x-millm-steering"])
        assert (kind, params["sae"], params["features"]) == ("inline", "tiny-l1", 1)
        for body, code in [({"text": ""}, "invalid_parameter"), ({"text": "x", "top_k": 0}, "invalid_parameter"), ({"text": "x", "layer": 1}, "sae_not_attached")]:
            resp = httpx.post(srv.base_url + "/api/saes/tiny-l1/features", json=body)
            assert (resp.status_code, resp.json()["error"]["code"]) == (400, code), resp.text
