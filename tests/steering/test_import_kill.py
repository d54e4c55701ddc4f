"""Profile import is one transaction: a real ``millm serve`` killed with SIGKILL in the middle
of a large import leaves the old profile set or the old set plus every imported profile,
never a part of the import.

The kill must land inside the write, so the test slows the ``profiles`` table from its own
connection (a trigger that does a fixed amount of work per inserted row; nothing is added
to the server) and kills the server while the server holds the database's write lock.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from .test_sae_api import write_sae

IMPORTED = 2000
PAD_ROWS = 300  # the trigger joins the pad with itself: PAD_ROWS² steps per inserted row


class Served:
    """``millm serve`` as a subprocess on a free port, its output in a log file."""

    def __init__(self, model_dir: str, db: str, log: pathlib.Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [sys.executable, "-m", "millm_core.cli", "serve", "--model", model_dir, "--port", str(port), "--db", db, "--log-level", "warning"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"millm serve exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/api/health/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("millm serve did not become ready in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def served(model_dir: str, db: str, log: pathlib.Path) -> Iterator[Served]:
    server = Served(model_dir, db, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def write_locked(probe: sqlite3.Connection) -> bool:
    """Whether another connection holds the database's write lock now."""
    try:
        probe.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if (exc.sqlite_errorcode & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return True
        raise
    probe.execute("ROLLBACK")
    return False


def profile_names(base_url: str) -> list[str]:
    resp = httpx.get(base_url + "/api/profiles", timeout=30)
    assert resp.status_code == 200, resp.text
    return [p["name"] for p in resp.json()["data"]]


def test_a_kill_9_in_the_middle_of_an_import_leaves_all_or_nothing(tiny_dir: str, tmp_path: pathlib.Path) -> None:
    db = str(tmp_path / "millm.db")
    old = ["old-0", "old-1", "old-2"]
    document: dict[str, Any] = {
        "format": "millm.profile/v1",
        "profiles": [{"name": f"imported-{i:05d}", "sae_id": "alpha", "layer": 1, "features": [{"index": i % 48, "strength": 1.5}]} for i in range(IMPORTED)],
    }
    everything = sorted(old + [p["name"] for p in document["profiles"]])

    first = Served(tiny_dir, db, tmp_path / "first.log")
    try:
        first.wait_ready()
        d_model = httpx.get(first.base_url + "/v1/models").json()["data"][0]["millm"]["d_model"]
        sae = write_sae(tmp_path / "alpha", d_model)
        assert httpx.post(first.base_url + "/api/saes", json={"path": sae, "id": "alpha"}).status_code == 201
        for name in old:
            body = {"name": name, "sae_id": "alpha", "layer": 1, "features": [{"index": 1, "strength": 2.0}]}
            assert httpx.post(first.base_url + "/api/profiles", json=body).status_code == 201
        probe = sqlite3.connect(db, timeout=0, isolation_level=None)
        probe.execute("CREATE TABLE pad (x INTEGER)")
        probe.executemany("INSERT INTO pad VALUES (?)", [(i,) for i in range(PAD_ROWS)])
        probe.execute("CREATE TRIGGER slow_profiles AFTER INSERT ON profiles BEGIN SELECT sum(a.x * b.x) FROM pad a, pad b; END")

        outcome: dict[str, Any] = {}

        def run_import() -> None:
            try:
                outcome["response"] = httpx.post(first.base_url + "/api/profiles/import", json=document, timeout=300)
            except httpx.HTTPError as exc:
                outcome["error"] = exc

        worker = threading.Thread(target=run_import)
        worker.start()
        deadline = time.monotonic() + 60
        while not write_locked(probe):
            assert time.monotonic() < deadline, "the import never took the write lock"
            time.sleep(0.002)
        time.sleep(1.0)  # well inside the write: a few hundred rows of thousands
        locked_at_kill = write_locked(probe)
        first.proc.kill()  # SIGKILL: no handler, no cleanup, no commit
        first.proc.wait(10)
        worker.join(30)
        probe.close()
    finally:
        first.stop()
    assert locked_at_kill, "the kill did not land inside the import's write"
    assert "response" not in outcome, outcome  # the import never answered

    with served(tiny_dir, db, tmp_path / "second.log") as second:
        after = profile_names(second.base_url)
        assert after in (old, everything), f"a partial import survived: {len(after) - len(old)} of {IMPORTED} profiles"
        assert after == old  # killed before the commit: nothing of it
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("DROP TRIGGER slow_profiles")
        conn.close()
        done = httpx.post(second.base_url + "/api/profiles/import", json=document, timeout=120)
        assert done.status_code == 201, done.text
        assert profile_names(second.base_url) == everything
