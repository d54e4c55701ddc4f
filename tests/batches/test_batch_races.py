"""The runner against what can happen while a batch runs: a cancel racing a line's write
or the batch's end, the model unloaded and loaded again, the input file gone, a line asking
for the interactive lane, repeated failures, a restart of a batch that was cancelling or
finalizing, and list parameters that are not ASCII digits."""

from __future__ import annotations

import os
import pathlib
import socket
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from millm_core.api import Store
from millm_plugins.batches import runner as runner_module
from millm_plugins.batches.lines import Line
from millm_plugins.batches.objects import FileObject
from millm_plugins.batches.storage import BatchStore, Usage

from .helpers import Hold, api, by_custom_id, jsonl, line, read_lines, roots_server, sdk, submit, wait

COMPLETIONS = "/v1/completions"


def _store(tmp_path: pathlib.Path, lines: int = 2) -> tuple[BatchStore, str]:
    store = BatchStore(Store(str(tmp_path / "millm.db")))
    store.add_file(FileObject(id="file-in", filename="in.jsonl", purpose="batch", bytes=1, created_at=0))
    batch = store.create_batch(COMPLETIONS, "file-in", None)
    assert batch is not None
    store.validated(batch.id, [Line(number=i, custom_id=f"c{i}", offset=0, length=1) for i in range(1, lines + 1)], None)
    return store, batch.id


def test_a_line_recorded_after_a_cancel_changes_nothing(tmp_path: pathlib.Path) -> None:
    store, batch_id = _store(tmp_path)
    store.record(batch_id, 1, True, b'{"a": 1}', Usage(input_tokens=3))
    assert store.cancel(batch_id) == "in_progress"
    store.record(batch_id, 2, True, b'{"a": 2}', Usage(input_tokens=5))  # a slow write, after the cancel
    assert [p.number for p in store.pending(batch_id)] == [2]
    batch = store.get_batch(batch_id)
    assert batch is not None and batch.request_counts.completed == 1 and batch.usage is not None and batch.usage.input_tokens == 3
    assert list(store.results(batch_id, "ok")) == [b'{"a": 1}']


def test_finishing_never_overwrites_a_cancel_and_recounts_from_the_lines(tmp_path: pathlib.Path) -> None:
    store, batch_id = _store(tmp_path)
    store.record(batch_id, 1, True, b"{}", Usage())
    store.record(batch_id, 2, False, b"{}", Usage())
    store.cancel(batch_id)
    assert not store.finalizing(batch_id)
    assert not store.finish(batch_id, "completed", None, None)
    assert not store.finish(batch_id, "expired", None, None)
    assert store.status(batch_id) == "cancelling"
    with store.store.transaction() as conn:  # counts that drifted from the lines
        conn.execute("UPDATE batches SET completed = 7, failed = 9 WHERE id = ?", (batch_id,))
    assert store.finish(batch_id, "cancelled", None, None)
    batch = store.get_batch(batch_id)
    assert batch is not None and batch.status == "cancelled"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    # The results are in the files now: the rows keep none.
    assert store.store.query("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND result IS NOT NULL", (batch_id,))[0][0] == 0


def test_a_batch_is_created_only_for_a_recorded_file(tmp_path: pathlib.Path) -> None:
    store = BatchStore(Store(str(tmp_path / "millm.db")))
    assert store.create_batch(COMPLETIONS, "file-gone", None) is None
    assert store.unfinished() == []


def test_limit_must_be_ascii_digits(server: Any) -> None:
    for path in ("/v1/batches", "/v1/files"):
        resp = httpx.get(server.base_url + path, params={"limit": "²"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "limit", resp.text


def test_a_line_cannot_ask_for_another_lane(server: Any) -> None:
    client = sdk(server.base_url)
    ask = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    lines = [
        line("interactive", {**ask, "class": "interactive"}, COMPLETIONS),
        line("suffixed", {**ask, "model": "tiny@interactive"}, COMPLETIONS),
        line("agent", {**ask, "class": "agent"}, COMPLETIONS),
        line("agent-suffix", {**ask, "model": "tiny@agent"}, COMPLETIONS),
    ]
    done = wait(client, submit(client, jsonl(lines), endpoint=COMPLETIONS).id)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.failed == 2
    errors = by_custom_id(read_lines(client, done.error_file_id))
    assert errors["interactive"]["response"]["status_code"] == 400
    assert errors["interactive"]["response"]["body"]["error"]["param"] == "class"
    assert errors["suffixed"]["response"]["body"]["error"]["param"] == "model"
    output = by_custom_id(read_lines(client, done.output_file_id))
    assert sorted(output) == ["agent", "agent-suffix"]
    assert all(item["response"]["millm"]["headers"]["x-millm-lane"] == "agent" for item in output.values())


def _state_of(srv: Any, model: str) -> str:
    entries = httpx.get(srv.base_url + "/api/models", timeout=60).json()["data"]
    return next(str(e["state"]) for e in entries if e["id"] == model)


def test_a_batch_waits_for_its_model_through_an_unload_and_load(
    tiny_dir: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "RETRIES_503", 0)  # a 503 that spent a retry would fail the line at once
    hold = Hold()
    # Without --auto-load (with it, the next line would load the model again itself: below).
    with roots_server(tiny_dir, tmp_path, hold, batch_concurrency=1, auto_load=False) as srv, ThreadPoolExecutor(1) as pool:
        assert api(srv, "/api/models/tiny/load").status_code == 200
        client = sdk(srv.base_url)
        hold.armed = True
        lines = [line(f"r{i}", {"model": "tiny", "prompt": f"Item {i}:", "max_tokens": 2, "temperature": 0}, COMPLETIONS) for i in range(5)]
        batch = submit(client, jsonl(lines), endpoint=COMPLETIONS)
        assert hold.entered.wait(60)  # the first line is running
        unloading = pool.submit(api, srv, "/api/models/tiny/unload")
        deadline = time.monotonic() + 60
        while _state_of(srv, "tiny") != "unloading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        hold.armed = False
        hold.opened.set()  # the running line finishes; the unload goes on
        assert unloading.result(60).status_code == 200
        time.sleep(2.5)  # the next lines meet 503 model_busy / model_not_loaded
        waiting = client.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None and waiting.request_counts.failed == 0
        assert api(srv, "/api/models/tiny/load").status_code == 200
        done = wait(client, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)


def test_a_batch_line_loads_the_model_it_names(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    with roots_server(tiny_dir, tmp_path) as srv:  # no model loaded; tiny is loadable
        client = sdk(srv.base_url)
        lines = [line(f"r{i}", {"model": "tiny", "prompt": f"Item {i}:", "max_tokens": 2, "temperature": 0}, COMPLETIONS) for i in range(3)]
        done = wait(client, submit(client, jsonl(lines), endpoint=COMPLETIONS).id, timeout=120)
        assert _state_of(srv, "tiny") == "loaded"
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)


def test_a_batch_never_evicts_the_model_live_traffic_uses(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    """Its lines wait for the model they name while another is loaded (503 model_busy,
    spending no retry), and run once it is loaded."""
    (tmp_path / "roots").mkdir()
    os.symlink(tiny_dir, tmp_path / "roots" / "tiny-b")
    with roots_server(tiny_dir, tmp_path) as srv:
        assert api(srv, "/api/models/tiny/load").status_code == 200
        client = sdk(srv.base_url)
        body = {"model": "tiny-b", "prompt": "Item:", "max_tokens": 2, "temperature": 0}
        batch = submit(client, jsonl([line("a", body, COMPLETIONS)]), endpoint=COMPLETIONS)
        wait(client, batch.id, until={"in_progress"})
        time.sleep(1.5)  # the line met 503 model_busy at least once
        waiting = client.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        assert (waiting.request_counts.completed, waiting.request_counts.failed) == (0, 0)
        assert (_state_of(srv, "tiny"), _state_of(srv, "tiny-b")) == ("loaded", "available")
        assert api(srv, "/api/models/tiny-b/load").status_code == 200
        done = wait(client, batch.id, timeout=60)
        assert _state_of(srv, "tiny") == "loaded"
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 1


@pytest.mark.parametrize("auto_load", [True, False])
def test_a_batch_waiting_for_another_model_leaves_the_slots_to_batches_for_the_loaded_one(tiny_dir: str, tmp_path: pathlib.Path, auto_load: bool) -> None:
    """With one slot: an older batch whose model is not loaded parks (it holds no slot), so
    a newer batch for the loaded model runs to its end meanwhile; the parked one runs once
    its model is loaded, every line once. With --auto-load false too (its lines wait for an
    explicit load; they are not refused as naming an unknown model)."""
    (tmp_path / "roots").mkdir()
    os.symlink(tiny_dir, tmp_path / "roots" / "tiny-b")
    with roots_server(tiny_dir, tmp_path, batch_concurrency=1, auto_load=auto_load) as srv:
        assert api(srv, "/api/models/tiny/load").status_code == 200
        client = sdk(srv.base_url)
        other = {"model": "tiny-b", "prompt": "Item:", "max_tokens": 2, "temperature": 0}
        parked = submit(client, jsonl([line(f"b{i}", other, COMPLETIONS) for i in range(3)]), endpoint=COMPLETIONS)
        wait(client, parked.id, until={"in_progress"})
        time.sleep(1.0)  # its first line met 503 model_busy
        loaded = {"model": "tiny", "prompt": "Item:", "max_tokens": 2, "temperature": 0}
        served = wait(client, submit(client, jsonl([line(f"a{i}", loaded, COMPLETIONS) for i in range(2)]), endpoint=COMPLETIONS).id, timeout=60)
        assert served.status == "completed" and served.request_counts is not None and served.request_counts.completed == 2
        waiting = client.batches.retrieve(parked.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        assert (waiting.request_counts.completed, waiting.request_counts.failed) == (0, 0)
        assert api(srv, "/api/models/tiny-b/load").status_code == 200
        done = wait(client, parked.id, timeout=60)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
        assert sorted(r["custom_id"] for r in read_lines(client, done.output_file_id)) == ["b0", "b1", "b2"]


def test_a_batch_whose_input_file_is_gone_fails(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "data"
    with roots_server(tiny_dir, tmp_path, batch_data_dir=str(folder), auto_load=False) as srv:
        client = sdk(srv.base_url)
        batch = submit(client, jsonl([line("a", {"model": "tiny", "prompt": "x", "max_tokens": 1}, COMPLETIONS)]), endpoint=COMPLETIONS)
        wait(client, batch.id, until={"in_progress"})  # no model loaded: it waits for one
        (folder / f"{batch.input_file_id}.jsonl").unlink()
        assert api(srv, "/api/models/tiny/load").status_code == 200
        done = wait(client, batch.id, timeout=30)
    assert done.status == "failed" and done.errors is not None and [e.code for e in done.errors.data or []] == ["file_not_found"]


def test_a_batch_that_keeps_failing_is_given_up(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: Any, batch_id: str) -> int:
        raise RuntimeError("a full disk, say")

    monkeypatch.setattr(runner_module, "RETRY_S", 0.01)
    monkeypatch.setattr(runner_module.Runner, "_run", broken)
    with make_server() as srv:
        client = sdk(srv.base_url)
        done = wait(client, submit(client, jsonl([line("a", {"model": "tiny", "prompt": "x"}, COMPLETIONS)]), endpoint=COMPLETIONS).id, 30)
    assert done.status == "failed" and done.errors is not None and [e.code for e in done.errors.data or []] == ["batch_failed"]


def test_cancel_while_validating(server: Any) -> None:
    client = sdk(server.base_url)
    lines = [line(f"r{i}", {"model": "tiny", "prompt": "x", "max_tokens": 1}, COMPLETIONS) for i in range(2000)]
    batch = submit(client, jsonl(lines), endpoint=COMPLETIONS)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.request_counts is not None
    assert len(read_lines(client, done.output_file_id)) == done.request_counts.completed
    assert done.request_counts.failed == 0


@pytest.mark.parametrize("status", ["cancelling", "finalizing"])
def test_a_restart_finishes_a_cancelling_or_finalizing_batch(make_server: Any, tmp_path: pathlib.Path, status: str) -> None:
    db = str(tmp_path / "millm.db")
    lines = [line(f"r{i}", {"model": "tiny", "prompt": "x", "max_tokens": 1}, COMPLETIONS) for i in range(3)]
    with make_server(db=db, models=[]) as first:  # no model: the batch waits, in progress
        client = sdk(first.base_url)
        batch = submit(client, jsonl(lines), endpoint=COMPLETIONS)
        wait(client, batch.id, until={"in_progress"})
    conn = sqlite3.connect(db)
    with conn:  # as if the server stopped with one line done, while cancelling or finalizing
        conn.execute("UPDATE batch_lines SET state = 'ok', result = ? WHERE batch_id = ? AND line = 1", (b'{"custom_id": "r0"}', batch.id))
        conn.execute("UPDATE batches SET status = ?, completed = 1 WHERE id = ?", (status, batch.id))
    conn.close()
    with make_server(db=db) as second:
        client = sdk(second.base_url)
        done = wait(client, batch.id, timeout=30)
        output = read_lines(client, done.output_file_id)
    assert done.status == ("cancelled" if status == "cancelling" else "completed")
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (1, 0)
    assert output == [{"custom_id": "r0"}]


def test_a_stalled_upload_is_refused_after_the_read_timeout(make_server: Any) -> None:
    with make_server(read_timeout=1) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        boundary = "stall"
        start = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n{{"a": 1}}\n'
        ).encode()
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(start) + 10_000}\r\n\r\n"
        ).encode()
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(head + start)  # then nothing more
            answer = ""
            while '"request_timeout"' not in answer and (chunk := sock.recv(65536)):
                answer += chunk.decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert '"request_timeout"' in answer and time.monotonic() - began < 15


class _Reply:
    def __init__(self, retry_after: str | None) -> None:
        self.headers = {} if retry_after is None else {"retry-after": retry_after}


@pytest.mark.parametrize(("header", "pause"), [(None, 1.0), ("soon", 1.0), ("0", 1.0), ("7", 7.0), ("999", 30.0)])
def test_a_bad_retry_after_still_pauses(header: str | None, pause: float) -> None:
    assert runner_module.Runner._pause(_Reply(header), 1.0, 30.0) == pause  # type: ignore[arg-type]


def test_batches_run_oldest_first(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    hold = Hold()
    with roots_server(tiny_dir, tmp_path, hold, batch_concurrency=1) as srv:
        assert api(srv, "/api/models/tiny/load").status_code == 200
        client = sdk(srv.base_url)
        hold.armed = True
        held = submit(client, jsonl([line("h", {"model": "tiny", "prompt": "held", "max_tokens": 1}, COMPLETIONS)]), endpoint=COMPLETIONS)
        assert hold.entered.wait(60)  # the one slot is taken
        batches = []
        for name in ("a", "b"):
            lines = [line(f"{name}{i}", {"model": "tiny", "prompt": f"{name}{i}", "max_tokens": 1}, COMPLETIONS) for i in range(3)]
            batches.append(submit(client, jsonl(lines), endpoint=COMPLETIONS).id)
            wait(client, batches[-1], until={"in_progress"})
        time.sleep(0.5)  # both wait for the slot
        hold.armed = False
        hold.opened.set()
        for batch_id in [held.id, *batches]:
            assert wait(client, batch_id, timeout=60).status == "completed"
    assert [p for p in hold.prompts if p != "held"] == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_batch_on_an_endpoint_the_server_does_not_serve_is_refused(make_server: Any) -> None:
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"block_plugins": ("embeddings",)}, environ={}))
    with make_server(host=host) as srv:
        assert httpx.post(srv.base_url + "/v1/embeddings", json={"model": "tiny", "input": "x"}).status_code == 404  # as live
        client = sdk(srv.base_url)
        uploaded = client.files.create(
            file=("in.jsonl", jsonl([line("e", {"model": "tiny", "input": "x"}, "/v1/embeddings")])), purpose="batch"
        )
        resp = httpx.post(
            srv.base_url + "/v1/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "endpoint", resp.text
