"""Switching models by name on a real server: a request naming a loadable model that is
not loaded unloads the resident and loads it (``--auto-load``); every refusal that can be
known first leaves the resident alone (body, engine capabilities, plugins, quantization,
memory, a plugin keeping it); a switch waits for the resident's running requests; a load
failing after the unload says so; plugin state tied to the model follows the resident."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from millm_core.api import AppContext, MillmError, ServedModel, hookimpl
from millm_core.testing import RunningServer
from millm_engines.transformers.testing import build_tiny_model

from ..steering.test_inline import parse
from ..steering.test_sae_api import write_sae
from .lifecycle_kit import CHAT, Gate, entries, make_roots, post, roots_app, serve_roots, wait_for_state

GREEDY = {"prompt": "the cat sat on", "max_tokens": 8, "temperature": 0}


def _huge_checkpoint(folder: Path, tiny_dir: str) -> None:
    """A checkpoint whose one tensor declares 2^38 float32 elements (1 TiB): a sparse file,
    so it takes no disk, but its header says what loading it would need."""
    folder.mkdir()
    (folder / "config.json").write_text(Path(tiny_dir, "config.json").read_text())
    header = json.dumps({"weight": {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}).encode()
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + 2**40)


def _quantized_checkpoint(folder: Path, tiny_dir: str) -> None:
    """The tiny model's files under a config that says GPTQ (which this CPU build cannot load)."""
    folder.mkdir()
    for name in os.listdir(tiny_dir):
        if name != "config.json":
            os.symlink(os.path.join(tiny_dir, name), folder / name)
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 2, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, tiny_dir: str, tiny_dir_no_template: str, gguf_path: str) -> str:
    root = tmp_path_factory.mktemp("roots")
    make_roots(root, tiny_dir, tiny_dir_no_template)
    os.symlink(gguf_path, root / "tiny.gguf")
    _huge_checkpoint(root / "huge", tiny_dir)
    _quantized_checkpoint(root / "tiny-gptq", tiny_dir)
    garbled = root / "garbled"  # a checkpoint whose safetensors header is no header
    garbled.mkdir()
    (garbled / "config.json").write_text(Path(tiny_dir, "config.json").read_text())
    header = b'["not", "a", "header"]'
    (garbled / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    build_tiny_model(str(root / "narrow"), hidden_size=32, seed=3)  # another residual width
    return str(root)


class Keeper:
    """Keeps a resident loaded while ``keep`` is set, as a plugin holding unsaved weights would."""

    def __init__(self) -> None:
        self.keep = False

    @hookimpl
    def millm_model_unloading(self, app: AppContext, model: ServedModel) -> None:
        if self.keep:
            raise MillmError(
                f"'{model.info.served_name}' carries 2 weight edits no checkpoint records; save or discard them first",
                code="weights_unsaved",
                status=409,
            )


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def srv(roots: str, gate: Gate) -> Iterator[RunningServer]:
    with serve_roots(roots, gate) as server:
        assert post(server, "/api/models/tiny/load").status_code == 200
        yield server


def _loaded(srv: RunningServer) -> list[str]:
    return sorted(name for name, entry in entries(srv).items() if entry["state"] == "loaded")


def _complete(srv: RunningServer, model: str, **extra: Any) -> httpx.Response:
    return post(srv, "/v1/completions", {"model": model, **GREEDY, **extra})


def test_a_request_naming_another_model_loads_it_in_place_of_the_resident(srv: RunningServer, gate: Gate) -> None:
    before = _complete(srv, "tiny")
    assert before.status_code == 200, before.text
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-", max_retries=0, timeout=120)
    switched = client.completions.create(model="tiny-b", **GREEDY)  # type: ignore[call-overload]
    # tiny-b is the same checkpoint under another name: the switched-to model serves it.
    assert switched.model == "tiny-b" and switched.choices[0].text == before.json()["choices"][0]["text"]
    assert gate.events == ["loaded:tiny:0", "unloaded:tiny:0", "loaded:tiny-b:0"]  # one resident
    assert _loaded(srv) == ["tiny-b"]
    listed = client.models.list().data
    assert listed[0].id == "tiny-b" and listed[0].model_extra is not None and listed[0].model_extra["millm"]["state"] == "loaded"
    assert {m.model_extra["millm"]["state"] for m in listed[1:] if m.model_extra} == {"available"}
    # The lanes plugin reads model@agent as the model in the agent lane: that loads it too.
    lane = post(srv, "/v1/chat/completions", {"model": "tiny@agent", **CHAT, "max_tokens": 2})
    assert lane.status_code == 200, lane.text
    assert lane.headers["x-millm-lane"] == "agent" and _loaded(srv) == ["tiny"]


def test_a_refused_request_never_evicts_the_resident(srv: RunningServer, gate: Gate) -> None:
    steer = {"steering": {"features": [{"index": 1, "strength": 2.0}]}}
    cases: list[tuple[str, dict[str, Any], dict[str, str], int, str, str | None]] = [
        ("tiny-b", {"temperature": 5}, {}, 400, "invalid_parameter", "temperature"),  # the body's own ranges
        ("tiny-b", {"stream_options": {"include_usage": True}}, {}, 400, "invalid_parameter", "stream_options"),  # its own shape
        ("tiny-b", {"audio": {"voice": "x"}}, {}, 400, "field_not_honoured", "audio"),  # nothing enabled declares it
        ("tiny-b", {"colour": "blue"}, {"X-miLLM-Strict": "true"}, 400, "unused_fields_refused", None),
        ("tiny-b", steer, {}, 400, "sae_not_attached", "steering"),  # an SAE attaches to the resident only
        ("tiny.gguf", steer, {}, 400, "field_not_honoured", "steering"),  # the GGUF engine declares no steering
        ("tiny.gguf", {"return_sae_activations": {"top_k": 4}}, {}, 400, "field_not_honoured", "return_sae_activations"),  # nor taps
        ("tiny-gptq", {}, {}, 400, "unsupported_quantization", "model"),
        ("huge", {}, {}, 503, "insufficient_memory", "model"),
        ("garbled", {}, {}, 500, "model_load_failed", None),  # unreadable weights: refused before the unload
    ]
    for model, extra, headers, status, code, param in cases:
        resp = post(srv, "/v1/completions", {"model": model, **GREEDY, **extra}, headers=headers)
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), (model, extra, resp.text)
        if param is not None:
            assert resp.json()["error"]["param"] == param, resp.text
        assert _loaded(srv) == ["tiny"], (model, extra)
    embeddings: list[tuple[str, dict[str, Any], str, str]] = [
        ("tiny.gguf", {"input": "x", "pooling": "last"}, "field_not_honoured", "pooling"),  # GGUF pools by mean only
        ("tiny-b", {"input": ""}, "invalid_parameter", "input"),  # the plugin's input checks
        ("tiny-b", {"input": []}, "invalid_parameter", "input"),
    ]
    for model, body, code, param in embeddings:
        resp = post(srv, "/v1/embeddings", {"model": model, **body})
        assert (resp.status_code, resp.json()["error"]["code"], resp.json()["error"]["param"]) == (400, code, param), (model, resp.text)
        assert _loaded(srv) == ["tiny"], (model, body)
    assert gate.events == ["loaded:tiny:0"]
    huge = post(srv, "/v1/completions", {"model": "huge", **GREEDY}).json()["error"]["message"]
    assert "1048576 MiB needed on cpu" in huge and "free" in huge and "unloading 'tiny' gives back" in huge
    quantized = post(srv, "/v1/completions", {"model": "tiny-gptq", **GREEDY}).json()["error"]["message"]
    assert "gptq" in quantized and "optimum" in quantized  # transformers' own reason
    # An explicit load checks memory the same way (nothing is unloaded by a load).
    explicit = post(srv, "/api/models/huge/load")
    assert explicit.status_code == 503 and explicit.json()["error"]["code"] == "insufficient_memory"
    assert explicit.json()["error"]["type"] == "server_error"  # the model did not fit, not the request
    assert _complete(srv, "tiny").status_code == 200


def test_a_plugin_may_keep_the_resident(roots: str) -> None:
    keeper = Keeper()
    with serve_roots(roots, keeper) as srv:
        assert post(srv, "/api/models/tiny/load").status_code == 200
        keeper.keep = True
        kept = _complete(srv, "tiny-b")
        assert kept.status_code == 409 and kept.json()["error"]["code"] == "weights_unsaved", kept.text
        unload = post(srv, "/api/models/tiny/unload")
        assert unload.status_code == 409 and unload.json()["error"]["code"] == "weights_unsaved"
        assert _loaded(srv) == ["tiny"]
        keeper.keep = False
        assert _complete(srv, "tiny-b").status_code == 200
        assert _loaded(srv) == ["tiny-b"]


def test_a_switch_lets_the_residents_requests_finish_and_refuses_others_meanwhile(srv: RunningServer, gate: Gate) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 4}, headers={"X-Gate": "1"})
        assert gate.entered.wait(30)
        switching = pool.submit(_complete, srv, "tiny-b")
        # The switch waits for the model thread (which the held row keeps): one token
        # passes, the row is held again at its next one, still running, as the switch unloads.
        gate.step_for_model_thread_work(srv)
        wait_for_state(srv, "tiny", "unloading")
        states = entries(srv)
        assert (states["tiny"]["state"], states["tiny-b"]["state"]) == ("unloading", "loading")
        for model in ("tiny", "tiny-b", "tiny-no-template"):  # the resident, the one loading, a third
            busy = _complete(srv, model)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_busy", (model, busy.text)
            assert int(busy.headers["retry-after"]) >= 1
        assert not switching.done()
        gate.opened.set()
        done = running.result(60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4  # finished on the old resident
        assert switching.result(120).status_code == 200
    assert _loaded(srv) == ["tiny-b"]


def test_every_resident_is_unloading_from_the_start_of_a_switch(srv: RunningServer, gate: Gate) -> None:
    """Two residents: while the first drains, the second, waiting its turn, is refused
    (503 model_busy) as the first is; it is not served until its own unload begins."""
    assert post(srv, "/api/models/tiny-no-template/load").status_code == 200
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 4}, headers={"X-Gate": "1"})
        assert gate.entered.wait(30)
        switching = pool.submit(_complete, srv, "tiny-b")
        gate.step_for_model_thread_work(srv)
        wait_for_state(srv, "tiny", "unloading")
        states = entries(srv)
        assert (states["tiny"]["state"], states["tiny-no-template"]["state"], states["tiny-b"]["state"]) == ("unloading", "unloading", "loading")
        busy = _complete(srv, "tiny-no-template")
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_busy", busy.text
        gate.opened.set()
        assert running.result(60).status_code == 200
        assert switching.result(120).status_code == 200
    assert _loaded(srv) == ["tiny-b"]


def test_a_load_failing_after_the_unload_says_so(srv: RunningServer, roots: str) -> None:
    failed = _complete(srv, "broken")
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_load_failed", failed.text
    message = failed.json()["error"]["message"]
    assert "after 'tiny' was unloaded" in message and roots not in message
    assert _loaded(srv) == [] and httpx.get(srv.base_url + "/api/health/ready").status_code == 503
    assert _complete(srv, "tiny").status_code == 200  # a request naming a model loads it again
    assert httpx.get(srv.base_url + "/api/health/ready").status_code == 200
    # A load that just failed is answered from memory: no second attempt, no second eviction.
    again = _complete(srv, "broken")
    assert again.status_code == 500 and again.json()["error"]["code"] == "model_load_failed"
    assert _loaded(srv) == ["tiny"]


def test_a_load_refused_by_the_servers_settings_says_why(roots: str) -> None:
    """An engine's ConfigError (the server's settings do not fit the model) is said in the
    answer and written in the log (the answer names no path; the log names the setting)."""
    from structlog.testing import capture_logs

    with serve_roots(roots, max_model_len=99_999_999) as server, capture_logs() as logs:
        failed = post(server, "/api/models/tiny/load")
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_load_failed", failed.text
        assert "settings do not fit this model" in failed.json()["error"]["message"] and roots not in failed.text
    assert any(e["event"] == "model_load_failed" and "--max-model-len 99999999 exceeds" in e.get("error", "") for e in logs)


def test_without_auto_load_another_name_is_not_found(roots: str) -> None:
    with serve_roots(roots, auto_load=False) as srv:
        assert _complete(srv, "tiny").json()["error"]["code"] == "model_not_loaded"
        assert post(srv, "/api/models/tiny/load").status_code == 200
        other = _complete(srv, "tiny-b")
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]] == ["tiny"]


def test_steering_attachments_follow_the_resident(srv: RunningServer, tmp_path: Path) -> None:
    """An attachment the new resident cannot take (another width) is reported unusable and
    never applied; it is re-attached when a model that takes it is resident again."""
    sae = write_sae(tmp_path / "sae", 64)
    assert post(srv, "/api/saes", {"path": sae, "id": "alpha"}).status_code == 201
    assert post(srv, "/api/saes/alpha/attach", {"layer": 0}).status_code == 200
    steer = {"steering": {"features": [{"index": 1, "strength": 4.0}]}}
    assert parse(_complete(srv, "tiny", **steer).headers["x-millm-steering"])[0][0] != "none"

    assert _complete(srv, "narrow").status_code == 200
    state = httpx.get(srv.base_url + "/api/steering").json()
    assert [(u["sae_id"], u["layer"], u["reason"]) for u in state["unusable"]] == [("alpha", 0, "width_mismatch")]
    unsteered = _complete(srv, "narrow", **steer)  # never applied, and the report says why
    assert unsteered.status_code == 200, unsteered.text
    assert parse(unsteered.headers["x-millm-steering"]) == [("unknown", {"reason": "claims_unreadable"})]

    assert _complete(srv, "tiny").status_code == 200
    assert httpx.get(srv.base_url + "/api/steering").json()["unusable"] == []
    assert parse(_complete(srv, "tiny", **steer).headers["x-millm-steering"])[0][0] != "none"


def test_checkpoints_of_the_local_hf_cache_are_listed_and_load_by_name(
    roots: str, tiny_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = tmp_path / "models--acme--Tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in os.listdir(tiny_dir):
        if name != "millm_source.json":  # the revision is the snapshot's
            os.symlink(os.path.join(tiny_dir, name), snapshot / name)
    (tmp_path / "models--acme--Tiny" / "refs").mkdir()
    (tmp_path / "models--acme--Tiny" / "refs" / "main").write_text("0123abcd")
    (tmp_path / "models--acme--Empty" / "snapshots" / "feedbeef").mkdir(parents=True)  # no checkpoint: not offered
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with serve_roots(roots) as srv:
        listed = entries(srv)
        assert listed["acme/Tiny"]["source"] == "plugin" and listed["acme/Tiny"]["state"] == "available"
        assert "acme/Empty" not in listed
        resp = _complete(srv, "acme/Tiny")
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "acme/Tiny" and "acme/Tiny@0123abcd" in resp.json()["system_fingerprint"]


def test_armed_probes_follow_the_resident(srv: RunningServer, tiny_engine: Any) -> None:
    """An armed probe stays armed through switches: on a model other than the one it was
    fitted on each result is skipped with model_mismatch; back on its model it scores again."""
    from ..probes.helpers import HELD_SEA, Fitted, arm, chat_ids, import_probe, user

    fitted = Fitted(tiny_engine)
    import_probe(srv, fitted.document(probe_id="sea"))
    assert arm(srv, "sea", windows=["prompt"]).status_code == 200

    def prompt_result(model: str) -> dict[str, Any]:
        resp = post(srv, "/v1/chat/completions", {"model": model, "messages": user(HELD_SEA[0]), "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        [result] = resp.json()["millm_probe_verdicts"]  # the one window armed
        return dict(result)

    expected = fitted.score(chat_ids(tiny_engine, user(HELD_SEA[0])))
    assert prompt_result("tiny")["score"] == pytest.approx(expected, abs=1e-6)
    away = prompt_result("narrow")
    assert (away["outcome"], away["reason"], away["score"]) == ("skipped", "model_mismatch", None)
    assert [p["id"] for p in httpx.get(srv.base_url + "/api/probes?armed=true").json()["data"]] == ["sea"]
    back = prompt_result("tiny")
    assert back["outcome"] == "scored" and back["score"] == pytest.approx(expected, abs=1e-6)


def test_a_gguf_file_is_served_under_the_name_it_was_asked_by(srv: RunningServer, gate: Gate) -> None:
    switched = _complete(srv, "tiny.gguf")
    assert switched.status_code == 200 and switched.json()["model"] == "tiny.gguf", switched.text
    assert _loaded(srv) == ["tiny.gguf"] and _complete(srv, "tiny.gguf").status_code == 200
    assert gate.events == ["loaded:tiny:0", "unloaded:tiny:0", "loaded:tiny.gguf:0"]  # loaded once
    assert _complete(srv, "tiny").status_code == 200 and _loaded(srv) == ["tiny"]


def test_gguf_repositories_named_without_their_tag_load_nothing(
    roots: str, gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for repo, files in (("One-GGUF", ["one.F32.gguf"]), ("Two-GGUF", ["two.F32.gguf", "two.Q8_0.gguf"])):
        snapshot = tmp_path / f"models--acme--{repo}" / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True)
        for name in files:
            os.symlink(gguf_path, snapshot / name)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with serve_roots(roots) as srv:
        assert post(srv, "/api/models/tiny/load").status_code == 200
        one = _complete(srv, "acme/One-GGUF")
        assert one.status_code == 404 and one.json()["error"]["code"] == "model_not_found", one.text
        assert "'acme/One-GGUF:F32'" in one.json()["error"]["message"]
        two = _complete(srv, "acme/Two-GGUF")
        assert two.status_code == 400 and two.json()["error"]["code"] == "ambiguous_model_name", two.text
        assert _loaded(srv) == ["tiny"]
        tagged = _complete(srv, "acme/One-GGUF:F32")
        assert tagged.status_code == 200 and tagged.json()["model"] == "acme/One-GGUF:F32"


def test_the_model_served_at_start_stays_loadable_by_its_name(roots: str, tiny_dir: str) -> None:
    """A model served under a name no catalogue lists (--model with --served-name) can be
    named again after a switch took it away."""
    from millm_core.api import ModelLocation
    from millm_core.config import load_settings
    from millm_engines.transformers.loader import load_engine

    location = ModelLocation(path=tiny_dir, served_name="prod")
    engine = load_engine(location, load_settings({}, environ={}))
    with serve_roots(roots, models=[ServedModel(info=engine.info, engine=engine, location=location)]) as srv:
        before = _complete(srv, "prod")
        assert before.status_code == 200
        assert _complete(srv, "tiny-b").status_code == 200 and _loaded(srv) == ["tiny-b"]
        assert entries(srv)["prod"]["source"] == "loaded"
        back = _complete(srv, "prod")
        assert back.status_code == 200 and back.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert _loaded(srv) == ["prod"]


def test_a_lock_waits_out_a_switch(srv: RunningServer, gate: Gate) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, srv, "/v1/chat/completions", {"model": "tiny", **CHAT, "max_tokens": 2}, headers={"X-Gate": "1"})
        assert gate.entered.wait(30)
        switching = pool.submit(_complete, srv, "tiny-b")
        gate.step_for_model_thread_work(srv)  # the switch's model-thread work runs; the row is held at its 2nd token
        wait_for_state(srv, "tiny", "unloading")
        for path in ("/api/models/tiny/lock", "/api/models/tiny/unlock"):
            refused = post(srv, path)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_busy", (path, refused.text)
        gate.opened.set()
        assert running.result(60).status_code == 200 and switching.result(120).status_code == 200
    assert _loaded(srv) == ["tiny-b"] and post(srv, "/api/models/tiny-b/lock").status_code == 200


def test_a_switch_outlives_the_request_that_began_it(roots: str) -> None:
    """The request that began a switch goes away (its client left, its batch was
    cancelled): the switch still ends with the model it named loaded and served."""
    gate = Gate(pause=0.05)  # the held request runs about 3 s, a token at a time
    gate.opened.set()
    app = roots_app(roots, gate)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=60)
            assert (await client.post("/api/models/tiny/load", json={})).status_code == 200
            body = {"model": "tiny", **CHAT, "max_tokens": 60}
            held = asyncio.ensure_future(client.post("/v1/chat/completions", json=body, headers={"X-Gate": "1"}))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            with pytest.raises(TimeoutError):  # the switch waits for the held request: its client gives up
                await asyncio.wait_for(client.post("/v1/completions", json={"model": "tiny-b", **GREEDY}), 1.0)
            states = {e["id"]: e["state"] for e in (await client.get("/api/models")).json()["data"]}
            assert (states["tiny"], states["tiny-b"]) == ("unloading", "loading")
            assert (await held).status_code == 200
            for _ in range(600):
                states = {e["id"]: e["state"] for e in (await client.get("/api/models")).json()["data"]}
                if states["tiny-b"] == "loaded":
                    break
                await asyncio.sleep(0.05)
            assert (states["tiny"], states["tiny-b"]) == ("available", "loaded")
            assert (await client.get("/api/health/ready")).status_code == 200
            assert (await client.post("/v1/completions", json={"model": "tiny-b", **GREEDY})).status_code == 200

    asyncio.run(main())
