"""A bounded load test: 120 concurrent clients against ``--max-queue 64``. Every answer is
a 200 or a ``503 queue_full`` with ``Retry-After``; nothing else, no 5xx, and the
scheduler's counters are back to zero afterwards."""

from __future__ import annotations

import threading
import time

import httpx

from millm_core.config import load_settings
from millm_core.server.app import build_host

from .helpers import GatePlugin, scheduler_stats

CLIENTS = 120
MAX_QUEUE = 64


_stats = scheduler_stats


def test_120_clients_against_a_queue_of_64(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    gate = GatePlugin()  # holds the first batch until every client has been answered or queued
    host.register(gate, "gate")
    with make_server(host=host, max_queue=MAX_QUEUE) as srv:
        answers: list[httpx.Response] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 3, "temperature": 0}
            resp = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
            with lock:
                answers.append(resp)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        # Everyone is either waiting in the queue, running, or already refused.
        while time.monotonic() < deadline:
            stats = _stats(srv.base_url)
            with lock:
                refused = len(answers)
            if stats["queued"] + stats["running_jobs"] + refused >= CLIENTS:
                break
            time.sleep(0.05)
        gate.gate.set()
        for t in threads:
            t.join(120)
        assert len(answers) == CLIENTS
        statuses = sorted({r.status_code for r in answers})
        assert set(statuses) <= {200, 503}, statuses
        refusals = [r for r in answers if r.status_code == 503]
        assert refusals, "the queue never filled"
        for r in refusals:
            assert r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
        served = [r for r in answers if r.status_code == 200]
        assert len(served) >= MAX_QUEUE  # the whole queue was served, nothing dropped
        assert all(r.json()["choices"][0]["finish_reason"] in ("stop", "length") for r in served)
        stats = _stats(srv.base_url)
        assert (stats["queued"], stats["running_jobs"], stats["active_rows"]) == (0, 0, 0)
