"""Batches are durable: a real ``millm serve`` killed with SIGKILL in the middle of a
batch resumes it when started again on the same database. Lines that were done are not
run again (their output lines are the ones written before the kill), lines that were
running produced nothing durable and run again, and every ``custom_id`` appears exactly
once in the output and error files, with the right counts. A batch whose completion
window passed while the server was stopped expires, its unrun lines in the error file."""

from __future__ import annotations

import json
import pathlib
import sqlite3
import time
from typing import Any

import pytest

from ..steering.test_import_kill import Served, served
from .helpers import by_custom_id, jsonl, line, read_lines, sdk, submit, wait

LINES = 60
FAILING = {f"r{i:03d}" for i in range(LINES) if i % 10 == 0}  # name a model the server does not serve


def _lines(client: Any, count: int) -> list[dict[str, Any]]:
    model = client.models.list().data[0].id
    return [
        line(
            f"r{i:03d}",
            {"model": "nope" if f"r{i:03d}" in FAILING else model, "prompt": f"Item {i}:", "max_tokens": 16, "temperature": 0},
            "/v1/completions",
        )
        for i in range(count)
    ]


def _progress(client: Any, batch_id: str, at_least: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        counts = client.batches.retrieve(batch_id).request_counts
        if counts is not None and counts.completed + counts.failed >= at_least:
            return
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.01)


def _done_lines(db: str, batch_id: str) -> tuple[str, dict[str, dict[str, Any]]]:
    conn = sqlite3.connect(db)
    try:
        status = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
        rows = conn.execute("SELECT custom_id, result FROM batch_lines WHERE batch_id = ? AND state != 'pending'", (batch_id,)).fetchall()
    finally:
        conn.close()
    return status, {str(cid): json.loads(result) for cid, result in rows}


def test_a_kill_9_mid_batch_resumes_with_every_line_exactly_once(
    tiny_dir: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = str(tmp_path / "millm.db")
    monkeypatch.setenv("MILLM_BATCH_CONCURRENCY", "1")  # one line at a time: still mid-batch at the kill, however fast
    first = Served(tiny_dir, db, tmp_path / "first.log")
    monkeypatch.delenv("MILLM_BATCH_CONCURRENCY")
    try:
        first.wait_ready()
        client = sdk(first.base_url)
        lines = _lines(client, LINES)
        batch = submit(client, jsonl(lines), endpoint="/v1/completions")
        _progress(client, batch.id, at_least=8)
        first.proc.kill()  # SIGKILL: no handler, no cleanup
        first.proc.wait(10)
    finally:
        first.stop()
    status, before = _done_lines(db, batch.id)
    assert status == "in_progress" and 8 <= len(before) < LINES, f"the kill did not land mid-batch ({len(before)} done)"

    with served(tiny_dir, db, tmp_path / "second.log") as second:
        client = sdk(second.base_url)
        done = wait(client, batch.id, timeout=300)
        output = by_custom_id(read_lines(client, done.output_file_id))
        errors = by_custom_id(read_lines(client, done.error_file_id))
    assert done.status == "completed", done
    assert not set(output) & set(errors)
    assert sorted([*output, *errors]) == [item["custom_id"] for item in lines]  # every line exactly once
    assert set(errors) == FAILING and all(e["response"]["status_code"] == 404 for e in errors.values())
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        LINES,
        LINES - len(FAILING),
        len(FAILING),
    )
    for custom_id, result in before.items():  # done before the kill: kept, never run again
        assert (output.get(custom_id) or errors[custom_id]) == result


def test_a_batch_stopped_past_its_window_expires_with_its_unrun_lines(
    tiny_dir: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = str(tmp_path / "millm.db")
    monkeypatch.setenv("MILLM_BATCH_CONCURRENCY", "1")
    with served(tiny_dir, db, tmp_path / "first.log") as first:
        monkeypatch.delenv("MILLM_BATCH_CONCURRENCY")
        client = sdk(first.base_url)
        lines = _lines(client, 40)
        batch = submit(client, jsonl(lines), endpoint="/v1/completions")
        _progress(client, batch.id, at_least=5)
    # Stopped cleanly (SIGTERM) mid-batch; then a day passes.
    status, before = _done_lines(db, batch.id)
    assert status == "in_progress" and 5 <= len(before) < len(lines)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, batch.id))
    conn.commit()
    conn.close()
    with served(tiny_dir, db, tmp_path / "second.log") as second:
        client = sdk(second.base_url)
        done = wait(client, batch.id, timeout=120)
        output = by_custom_id(read_lines(client, done.output_file_id))
        errors = by_custom_id(read_lines(client, done.error_file_id))
    assert done.status == "expired" and done.expired_at is not None
    assert sorted([*output, *errors]) == [item["custom_id"] for item in lines]
    unrun = {cid for cid, e in errors.items() if e["response"] is None}
    assert unrun == {item["custom_id"] for item in lines} - set(before)
    assert all(errors[cid]["error"]["code"] == "batch_expired" for cid in unrun)
    assert done.request_counts is not None and done.request_counts.completed == len(output) and done.request_counts.failed == len(errors)
