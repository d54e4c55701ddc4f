"""Two real servers on one SQLite file share their probes.

- A probe imported and armed through one server produces verdicts on requests the other
  serves, within a refresh interval (``REFRESH_S``); disarming, re-arming on other windows
  and deleting reach the other server the same way.
- Writes are worked out from the database, never from a server's stale copy: a disarm or a
  delete through the other server works at once, and the armed-probe limit
  (``probes_max_armed``) holds over both servers, even when they arm at the same time.
- Both servers write the events log, and each reads every result.
- Requests read the server's snapshot: no SQL statement runs on the event loop while
  monitored requests are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from millm_core.store import Store
from millm_plugins.probes.book import REFRESH_S, Arming, ParityReport, ProbeBook, Stored
from millm_plugins.probes.events import EventLog
from millm_plugins.probes.gates import GateRefused, check_limit

from .helpers import HELD_CODE, HELD_SEA, JSON, Fitted, arm, chat, import_probe, ok, user
from .test_gates import refused
from .test_parts import document, results_of

SEEN_WITHIN_S = 5.0  # generous next to REFRESH_S: two shared cores run the servers and the model

Pair = Callable[..., contextlib.AbstractContextManager[tuple[Any, Any]]]


@pytest.fixture
def pair(make_server: Any, tmp_path: pathlib.Path) -> Pair:
    """``with pair(**settings) as (a, b):`` two servers on one database file."""

    @contextlib.contextmanager
    def servers(**settings: Any) -> Iterator[tuple[Any, Any]]:
        db = str(tmp_path / "shared.db")
        with make_server(db=db, **settings) as a, make_server(db=db, **settings) as b:
            yield a, b

    return servers


def verdicts(resp: httpx.Response) -> list[tuple[str, str, float, str]]:
    assert resp.status_code == 200, resp.text
    return [(r["probe"]["id"], r["window"], round(r["score"], 9), r["verdict"]) for r in resp.json().get("millm_probe_verdicts", [])]


def eventually(check: Callable[[], Any]) -> Any:
    """``check()``'s first truthy value, polled every ``REFRESH_S`` for at most SEEN_WITHIN_S."""
    deadline = time.monotonic() + SEEN_WITHIN_S
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"never seen within {SEEN_WITHIN_S} s"
        time.sleep(REFRESH_S)


def armed_ids(srv: Any) -> list[str]:
    return [p["id"] for p in ok(httpx.get(srv.base_url + "/api/probes", params={"armed": "true"}))["data"]]


def test_a_probe_armed_on_one_server_reports_on_the_other(pair: Pair, fitted: Fitted) -> None:
    prompt = user(HELD_SEA[0])
    with pair() as (a, b):
        assert "millm_probe_verdicts" not in chat(b, prompt).json()
        import_probe(a, fitted.document("sea", probe_id="sea"))
        ok(arm(a, "sea", windows=["prompt", "last_user"]))
        on_a = verdicts(chat(a, prompt))
        assert sorted((p, w) for p, w, _, _ in on_a) == [("sea", "last_user"), ("sea", "prompt")]
        # The other server's requests carry the same verdicts once it has looked.
        on_b = eventually(lambda: verdicts(chat(b, prompt)))
        assert on_b == on_a
        assert armed_ids(b) == ["sea"]
        assert ok(httpx.get(b.base_url + "/api/probes/sea"))["armed"]["windows"] == ["prompt", "last_user"]

        # Re-armed on other windows through the second server: the first follows.
        ok(arm(b, "sea", windows=["all"]))
        again = eventually(lambda: [v for v in verdicts(chat(a, prompt)) if v[1] == "all"])
        assert [(p, w) for p, w, _, _ in verdicts(chat(a, prompt))] == [("sea", "all")] == [(p, w) for p, w, _, _ in again]

        # Disarmed through the second server: the first stops reporting.
        ok(httpx.post(b.base_url + "/api/probes/sea/disarm", json={}))
        eventually(lambda: "millm_probe_verdicts" not in chat(a, prompt).json())
        assert armed_ids(a) == [] and ok(httpx.get(a.base_url + "/api/probes/sea"))["armed"] is None

        # Armed again and deleted through the first server at once: the second has it gone.
        ok(arm(a, "sea"))
        eventually(lambda: verdicts(chat(b, prompt)))
        ok(httpx.delete(a.base_url + "/api/probes/sea", headers=JSON))
        eventually(lambda: httpx.get(b.base_url + "/api/probes/sea").status_code == 404)
        assert ok(httpx.get(b.base_url + "/api/probes"))["data"] == []
        assert "millm_probe_verdicts" not in chat(b, prompt).json()


def test_writes_through_either_server_work_from_the_database(pair: Pair, fitted: Fitted) -> None:
    """At once after the other server's write, before any refresh could have run."""
    with pair() as (a, b):
        for round_ in range(3):
            probe_id = f"p{round_}"
            import_probe(a, fitted.document(probe_id, probe_id=probe_id))
            if round_ == 0:
                ok(arm(b, probe_id))  # arming reads the database first: the other server's import counts at once
            clash = httpx.post(b.base_url + "/api/probes/import", json=fitted.document(probe_id, probe_id=probe_id))
            assert (clash.status_code, clash.json()["error"]["code"]) == (409, "probe_exists")
            if round_ != 0:
                ok(arm(a, probe_id))
            assert ok(httpx.post(f"{b.base_url}/api/probes/{probe_id}/disarm", json={}))["armed"] is None
            ok(httpx.delete(f"{b.base_url}/api/probes/{probe_id}", headers=JSON))
            gone = httpx.delete(f"{a.base_url}/api/probes/{probe_id}", headers=JSON)
            assert (gone.status_code, gone.json()["error"]["code"]) == (404, "probe_not_found")
        for srv in (a, b):
            assert eventually(lambda srv=srv: ok(httpx.get(srv.base_url + "/api/probes"))["data"] == [])


def test_the_armed_limit_holds_over_both_servers(pair: Pair, fitted: Fitted) -> None:
    with pair(probes_max_armed=1) as (a, b):
        import_probe(a, fitted.document("first", probe_id="first"))
        import_probe(b, fitted.document("second", probe_id="second"))
        ok(arm(a, "first"))
        refused(arm(b, "second"), "limit")
        assert armed_ids(a) == armed_ids(b) == ["first"]
        ok(arm(b, "first", windows=["response"]))  # re-arming counts once, whichever server does it
        ok(httpx.post(a.base_url + "/api/probes/first/disarm", json={}))
        ok(arm(b, "second"))
        refused(arm(a, "first"), "limit")

        ok(httpx.post(b.base_url + "/api/probes/second/disarm", json={}))
        ok(arm(b, "first"))
        refused(arm(a, "second"), "limit")


def test_the_limit_is_checked_in_the_arming_transaction(tmp_path: pathlib.Path) -> None:
    """Two books on one file: while one runs the gates, the other arms a probe; the arming
    then refuses at the limit gate, however its gates went."""
    db = str(tmp_path / "book.db")

    def gate(ids: set[str], probe_id: str) -> None:
        check_limit(ids, probe_id, 1)

    first, second = ProbeBook(store=Store(db), limit_gate=gate), ProbeBook(store=Store(db), limit_gate=gate)

    def arming() -> Arming:
        return Arming(windows=["all"], acknowledged_below_rung2=False, model="m", armed_at=0.0,
                      parity=ParityReport(tolerance=1e-3, max_abs_error=None, vectors=[]))  # fmt: skip

    async def meanwhile(stored: Stored) -> Arming:
        assert set(second.arms) == set()  # its own snapshot: the limit gate lets it through
        await first.arm("p", lambda stored: asyncio.sleep(0, arming()))
        return arming()

    async def run() -> None:
        await first.add(document("p", seed=1))
        await first.add(document("q", seed=2))
        await second.refresh()
        with pytest.raises(GateRefused) as refusal:
            await second.arm("q", meanwhile)
        assert refusal.value.gate == "limit"
        await second.refresh()
        assert (set(second.arms), [a.detector.probe_id for a in second.armed]) == ({"p"}, ["p"])

    asyncio.run(run())
    assert Store(db).query("SELECT probe_id FROM probe_arms") == [("p",)]


def test_both_servers_write_the_events_log(pair: Pair, fitted: Fitted) -> None:
    with pair() as (a, b):
        import_probe(a, fitted.document("sea", probe_id="sea"))
        ok(arm(a, "sea", windows=["prompt", "response"]))
        eventually(lambda: armed_ids(b) == ["sea"] and verdicts(chat(b, user(HELD_CODE[0]))))
        before = ok(httpx.get(b.base_url + "/api/probes/events"))["total"]
        # One after the other (the two servers share one engine object in this process),
        # alternating: each server's writes run in its own thread while the other serves.
        sent = [chat(srv, user(text)) for text in HELD_SEA[:3] + HELD_CODE[:3] for srv in (a, b)]
        ids = {r["result_id"] for resp in sent for r in resp.json()["millm_probe_verdicts"]}
        assert len(ids) == 2 * len(sent)
        for srv in (a, b):  # each server's read waits for its own queued writes
            ok(httpx.get(srv.base_url + "/api/probes/events"))
        for srv in (a, b):
            logged = ok(httpx.get(srv.base_url + "/api/probes/events", params={"limit": 1000}))
            assert logged["total"] == before + len(ids)
            assert ids <= {r["result_id"] for r in logged["data"]}


def test_monitored_requests_never_run_sql_on_the_event_loop(make_server: Any, fitted: Fitted, tmp_path: pathlib.Path) -> None:
    """Every statement the server's connections run is recorded with its thread: none runs
    on the event loop's thread while armed probes monitor requests and the watcher looks
    for other servers' writes."""
    with make_server(db=str(tmp_path / "millm.db")) as srv:
        import_probe(srv, fitted.document("sea", probe_id="sea"))
        ok(arm(srv, "sea", windows=["prompt", "last_user"]))
        store = srv.app.state.millm.app.store
        connections = {store._conn, store._reader}
        seen: list[tuple[str, str]] = []
        for conn in connections:
            conn.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
        try:
            for text in HELD_SEA[:2] + HELD_CODE[:2]:
                assert len(verdicts(chat(srv, user(text)))) == 2
            time.sleep(3 * REFRESH_S)  # the watcher looks for other servers' writes meanwhile
        finally:
            for conn in connections:
                conn.set_trace_callback(None)
        assert any("probe_state" in sql for _, sql in seen), "the watcher never looked"
        on_loop = [sql for thread, sql in seen if thread == "millm-test-server"]
        assert on_loop == []


def test_two_event_logs_on_one_file_write_at_the_same_time(tmp_path: pathlib.Path) -> None:
    """The events log's writes from two servers: every result is kept once, the newest
    ``keep`` of them, whichever server wrote it."""
    db = str(tmp_path / "events.db")
    logs = [EventLog(store=ProbeBook(store=Store(db)).store, keep=150) for _ in range(2)]
    batches = [results_of(10) for _ in range(20)]
    assert len({r.result_id for batch in batches for r in batch}) == 200

    def write(side: int) -> None:
        for batch in batches[side::2]:
            logs[side].record(batch)  # no loop runs: written at once, in this thread

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write, (0, 1)))
    total, page = logs[0].read(probe_id=None, request_id=None, trace_id=None, limit=1000, offset=0)
    assert total == 150 == len({r.result_id for r in page})
    assert logs[1].read(probe_id=None, request_id=None, trace_id=None, limit=1000, offset=0)[0] == 150
    assert Store(db).query("SELECT COUNT(DISTINCT id), MAX(seq) FROM probe_events") == [(150, 200)]
