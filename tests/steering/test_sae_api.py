"""The SAE management API on a real server; registrations and attachments survive a restart."""

from __future__ import annotations

import json
import pathlib

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from millm_core.config import load_settings
from millm_core.server.app import build_host

D_SAE = 48
JSON = {"Content-Type": "application/json"}  # every write to /api says it sends JSON, a bodyless one too


def write_sae(folder: pathlib.Path, d_in: int, seed: int = 0, hook_name: str | None = None) -> str:
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
    cfg: dict[str, object] = {"d_in": d_in, "d_sae": D_SAE, "architecture": "standard"}
    if hook_name is not None:
        cfg["metadata"] = {"hook_name": hook_name}  # where SAELens v6 keeps it
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return str(folder)


def test_lifecycle_and_refusals(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    d_model = tiny_engine.info.d_model
    good = write_sae(tmp_path / "layer_1", d_model)
    wrong = write_sae(tmp_path / "wrong", d_model + 1)
    with make_server() as srv:
        api = srv.base_url + "/api/saes"
        created = httpx.post(api, json={"path": good, "id": "tiny-l1"})
        assert created.status_code == 201
        assert created.json() == {
            "id": "tiny-l1", "path": good, "status": "ok", "reason": None, "architecture": "standard", "d_in": d_model, "d_sae": D_SAE, "attached_layers": [],
            "hook_name": None, "hook_layer": None,
        }  # fmt: skip
        derived = httpx.post(api, json={"path": good})
        assert derived.status_code == 201 and derived.json()["id"].endswith("--layer_1")
        assert httpx.post(api, json={"path": good, "id": "tiny-l1"}).status_code == 409
        bad = httpx.post(api, json={"path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_sae"
        assert httpx.post(api, json={"path": good, "extra": 1}).status_code == 400
        empty = httpx.post(api, json={"path": good, "id": ""})  # an id sent is checked as sent, never replaced by a derived one
        assert (empty.status_code, empty.json()["error"]["code"], empty.json()["error"]["param"]) == (400, "invalid_parameter", "id")
        attached = httpx.post(api + "/tiny-l1/attach", json={"layer": 1})
        assert attached.status_code == 200 and attached.json()["attached_layers"] == [1]
        httpx.post(api + "/tiny-l1/attach", json={"layer": 0})
        assert httpx.get(api + "/tiny-l1").json()["attached_layers"] == [0, 1]
        assert httpx.post(api + "/tiny-l1/attach", json={"layer": 7}).json()["error"]["param"] == "layer"
        httpx.post(api, json={"path": wrong, "id": "wrong"})
        mismatch = httpx.post(api + "/wrong/attach", json={"layer": 0})
        assert mismatch.status_code == 400 and "width" in mismatch.json()["error"]["message"]
        assert httpx.post(api + "/tiny-l1/detach", json={"layer": 0}).json()["detached"] == 1
        assert [s["id"] for s in httpx.get(api).json()["data"]] == sorted([derived.json()["id"], "tiny-l1", "wrong"])
        assert httpx.delete(api + "/tiny-l1", headers=JSON).status_code == 200
        missing = httpx.get(api + "/tiny-l1")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "sae_not_found"


def test_detaching_says_what_it_took_with_it(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """Detaching (or deleting) an SAE deactivates the active profile bound there and erases
    the manual values there, and the answer names both."""
    d_model = tiny_engine.info.d_model
    with make_server() as srv:
        for name in ("one", "two"):
            assert httpx.post(srv.base_url + "/api/saes", json={"path": write_sae(tmp_path / name, d_model, seed=len(name)), "id": name}).status_code == 201
        api = srv.base_url
        httpx.post(api + "/api/saes/one/attach", json={"layer": 0})
        httpx.post(api + "/api/saes/one/attach", json={"layer": 1})
        httpx.post(api + "/api/saes/two/attach", json={"layer": 1})
        httpx.post(api + "/api/profiles", json={"name": "p", "sae_id": "one", "layer": 1, "features": [{"index": 4, "strength": 2.0}]})
        assert httpx.post(api + "/api/profiles/p/activate", json={}).status_code == 200
        values = [{"index": 1, "strength": 1.0}, {"index": 2, "strength": -1.0}]
        assert httpx.put(api + "/api/steering", json={"sae_id": "one", "layer": 0, "features": values}).status_code == 200
        assert httpx.put(api + "/api/steering", json={"sae_id": "two", "features": values[:1]}).status_code == 200
        at_zero = httpx.post(api + "/api/saes/one/detach", json={"layer": 0}).json()
        assert (at_zero["detached"], at_zero["deactivated_profile"], at_zero["manual_values_removed"]) == (1, None, 2)
        at_one = httpx.post(api + "/api/saes/one/detach", json={"layer": 1}).json()
        assert (at_one["detached"], at_one["deactivated_profile"], at_one["manual_values_removed"]) == (1, "p", 0)
        assert httpx.get(api + "/api/steering").json()["active_profile"] is None
        nothing = httpx.post(api + "/api/saes/one/detach", json={}).json()
        assert (nothing["detached"], nothing["deactivated_profile"], nothing["manual_values_removed"]) == (0, None, 0)
        deleted = httpx.delete(api + "/api/saes/two", headers=JSON).json()
        assert deleted == {"id": "two", "deleted": True, "deactivated_profile": None, "manual_values_removed": 1}
        assert httpx.get(api + "/api/steering").json()["manual"] == []


def test_an_sae_with_non_finite_weights_is_refused(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """NaN or infinite weights would poison every encoding and delta: refused by name at
    registration, not registered and then read as nulls."""
    from safetensors.numpy import load_file

    d_model = tiny_engine.info.d_model
    with make_server() as srv:
        for name, value in (("W_enc", np.nan), ("b_enc", np.inf), ("W_dec", -np.inf)):
            folder = pathlib.Path(write_sae(tmp_path / name, d_model))
            arrays = load_file(str(folder / "sae_weights.safetensors"))
            arrays[name].flat[3] = value
            save_file(arrays, str(folder / "sae_weights.safetensors"))
            refused = httpx.post(srv.base_url + "/api/saes", json={"path": str(folder), "id": name})
            error = refused.json()["error"]
            assert (refused.status_code, error["code"], error["param"]) == (400, "invalid_sae", "path") and name in error["message"]
        assert httpx.get(srv.base_url + "/api/saes").json()["data"] == []


def test_features_refuse_an_sae_millm_cannot_encode_faithfully(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """An SAE whose cfg.json asks for an input normalisation millm does not apply is not
    read by /features (as return_sae_activations and the probes refuse it), never answered
    with values SAELens would not give."""
    folder = pathlib.Path(write_sae(tmp_path / "normalised", tiny_engine.info.d_model))
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "expected_average_only_in"}))
    with make_server() as srv:
        assert httpx.post(srv.base_url + "/api/saes", json={"path": str(folder), "id": "n"}).status_code == 201
        assert httpx.post(srv.base_url + "/api/saes/n/attach", json={"layer": 1}).status_code == 200
        refused = httpx.post(srv.base_url + "/api/saes/n/features", json={"text": "the sea", "top_k": 3})
        error = refused.json()["error"]
        assert (refused.status_code, error["code"]) == (400, "sae_encoding_unsupported") and "normalize_activations" in error["message"]


def test_sae_roots_confine_where_saes_load_from(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """With --sae-roots, a path outside every root is refused before anything is opened,
    a symlink out of a root included; a path under one (or a root itself) loads."""
    import os

    d_model = tiny_engine.info.d_model
    inside = write_sae(tmp_path / "roots" / "lab" / "layer_1", d_model)
    outside = write_sae(tmp_path / "elsewhere" / "layer_1", d_model)
    os.symlink(outside, tmp_path / "roots" / "lab" / "sneaky")
    with make_server(sae_roots=(str(tmp_path / "roots"), str(tmp_path / "other"))) as srv:
        api = srv.base_url + "/api/saes"
        assert httpx.post(api, json={"path": inside, "id": "in"}).status_code == 201
        for path in (outside, str(tmp_path / "roots" / "lab" / "sneaky"), str(tmp_path / "roots" / ".." / "elsewhere" / "layer_1"), "/etc/passwd", inside + "\x00"):
            refused = httpx.post(api, json={"path": path})
            error = refused.json()["error"]
            assert (refused.status_code, error["code"], error["param"]) == (400, "sae_path_not_allowed", "path"), path
        assert [s["id"] for s in httpx.get(api).json()["data"]] == ["in"]
    with make_server() as srv:  # no roots: any readable path, as before
        assert httpx.post(srv.base_url + "/api/saes", json={"path": outside, "id": "out"}).status_code == 201


def test_registrations_survive_a_restart(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    db = str(tmp_path / "millm.db")
    path = write_sae(tmp_path / "sae", tiny_engine.info.d_model)
    with make_server(db=db) as first:
        assert httpx.post(first.base_url + "/api/saes", json={"path": path, "id": "kept"}).status_code == 201
        httpx.post(first.base_url + "/api/saes/kept/attach", json={"layer": 1})
    with make_server(db=db) as second:
        listed = httpx.get(second.base_url + "/api/saes").json()["data"]
        assert [(s["id"], s["path"], s["status"], s["attached_layers"]) for s in listed] == [("kept", path, "ok", [1])]  # attachments persist too


@pytest.mark.parametrize("field", [("steering", {"features": []}), ("profile", "p"), ("steering_intensity", 0.5)])
def test_steering_fields_are_refused_without_the_plugin(make_server, field) -> None:  # type: ignore[no-untyped-def]
    name, value = field
    host = build_host(load_settings({"plugins": ("sampling",)}, environ={}))
    with make_server(host=host) as srv:
        resp = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], name: value})
        assert httpx.get(srv.base_url + "/api/saes").status_code == 404  # no management API either
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "field_not_honoured" and resp.json()["error"]["param"] == name


def test_the_hook_point_decides_the_layer(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """A resid_pre SAE of block 1 reads block 0's output: it attaches at layer 0, and
    steers exactly as the same weights attached at layer 0 without a recorded hook do."""
    d = tiny_engine.info.d_model
    pre = write_sae(tmp_path / "pre", d, seed=4, hook_name="blocks.1.hook_resid_pre")
    plain = write_sae(tmp_path / "plain", d, seed=4)
    first = write_sae(tmp_path / "first", d, seed=4, hook_name="blocks.0.hook_resid_pre")
    attn = write_sae(tmp_path / "attn", d, seed=4, hook_name="blocks.1.attn.hook_z")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    with make_server() as srv:
        url = srv.base_url + "/api/saes"
        for path, name in ((pre, "pre"), (plain, "plain"), (first, "first"), (attn, "attn")):
            assert httpx.post(url, json={"path": path, "id": name}).status_code == 201
        for body in ({"layer": 1}, {}):  # trained on another hook point than the residual stream: never attached
            refused = httpx.post(url + "/attn/attach", json=body)
            assert refused.status_code == 400 and "blocks.1.attn.hook_z" in refused.json()["error"]["message"], refused.text
        listed = httpx.get(url + "/pre").json()
        assert (listed["hook_name"], listed["hook_layer"]) == ("blocks.1.hook_resid_pre", 0)
        wrong = httpx.post(url + "/pre/attach", json={"layer": 1})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "layer" and "layer 0" in wrong.json()["error"]["message"]
        assert httpx.post(url + "/first/attach", json={}).status_code == 400  # the embeddings: no block output there
        assert httpx.post(url + "/plain/attach", json={}).status_code == 400  # no hook recorded: a layer is needed
        attached = httpx.post(url + "/pre/attach", json={})
        assert attached.status_code == 200 and attached.json()["attached_layers"] == [0]
        features = [{"index": 3, "strength": 6.0}]
        via_hook = httpx.post(srv.base_url + "/v1/chat/completions", json={**chat, "steering": {"sae_id": "pre", "features": features}}).json()
        assert httpx.post(url + "/pre/detach", json={}).status_code == 200
        assert httpx.post(url + "/plain/attach", json={"layer": 0}).status_code == 200
        via_layer = httpx.post(srv.base_url + "/v1/chat/completions", json={**chat, "steering": {"sae_id": "plain", "features": features}}).json()
        unsteered = httpx.post(srv.base_url + "/v1/chat/completions", json={**chat, "steering": {"features": []}}).json()
    text = [r["choices"][0]["message"]["content"] for r in (via_hook, via_layer, unsteered)]
    assert text[0] == text[1] != text[2]


def test_a_features_query_whose_client_leaves_never_runs(make_server, tiny_engine, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """Queued behind a held generation, the query's model call leaves the queue as soon
    as its client disconnects."""
    import json as _json
    import socket
    import threading

    from ..http.helpers import GatePlugin, scheduler_stats, wait_until

    host = build_host(load_settings(environ={}))
    gate = GatePlugin()
    host.register(gate, "gate")
    with make_server(host=host) as srv:
        api = srv.base_url + "/api/saes"
        assert httpx.post(api, json={"path": write_sae(tmp_path / "s", tiny_engine.info.d_model), "id": "s"}).status_code == 201
        assert httpx.post(api + "/s/attach", json={"layer": 0}).status_code == 200
        held = threading.Thread(target=lambda: httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60))
        held.start()
        assert wait_until(lambda: scheduler_stats(srv.base_url)["running_jobs"] == 1)
        body = _json.dumps({"text": "some words to read", "top_k": 3}).encode()
        port = int(srv.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /api/saes/s/features HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
            assert wait_until(lambda: scheduler_stats(srv.base_url)["queued"] == 1)
        assert wait_until(lambda: scheduler_stats(srv.base_url)["queued"] == 0)  # gone with its client
        gate.gate.set()
        held.join(30)
