"""The plugin's parts on their own, without a server: the verdict header's size cap, the
events log's queue cap and shutdown flush, a row's online aggregation (prefill encoded a
slice at a time, scores equal to the offline ones), arming on the probe as stored under
the lock, and no second render for a scoring request."""

from __future__ import annotations

import asyncio
import pathlib
from types import SimpleNamespace
from typing import Any

import http_sfv
import msgspec
import numpy as np
import pytest

from millm_core.api import Readout, Stash, Tap
from millm_core.store import Store
from millm_plugins.probes import header, plugin
from millm_plugins.probes.book import Armed, Arming, ParityReport, ProbeBook, Stored
from millm_plugins.probes.detector import ROWS, Detector
from millm_plugins.probes.document import ProbeDocument
from millm_plugins.probes.events import EventLog
from millm_plugins.probes.monitor import Entry, Monitor, build_groups
from millm_plugins.probes.results import Finding, ProbeResult, Served, result
from millm_plugins.probes.state import STATE, ProbesState
from millm_plugins.probes.trace import Trace
from millm_plugins.probes.windows import Placement

WIDTH = 8


def document(probe_id: str, aggregation: str = "mean", seed: int = 0, width: int = WIDTH, **extra: Any) -> ProbeDocument:
    rng = np.random.default_rng(seed)
    body = {
        "id": probe_id, "name": probe_id, "layer": 1, "aggregation": aggregation,
        "head": {"weights": rng.normal(size=width).tolist(), "bias": 0.1}, "decision": {"threshold": 0.5},
        "model": {"d_model": width, "n_layers": 2, "chat_template_sha256": None}, "evidence": {"rung": 2}, **extra,
    }  # fmt: skip
    return msgspec.convert(body, ProbeDocument)


def results_of(count: int, name: str = "a-rather-long-probe-name-for-the-header") -> list[ProbeResult]:
    det = Detector.of(document(name))
    served = Served(request_id="req", endpoint="chat.completions", model="m", engine="hf", read_point="pre_steering")
    trace = Trace("1" * 32, None, "minted")
    out = []
    for index in range(count):
        row = msgspec.structs.replace(served, choice=index)
        out.append(result(det, "all", Finding("scored", "ok", 0.25 + index / 1000, (0, 4)), row, trace))
    return out


def parsed(value: str) -> list[Any]:
    members = http_sfv.List()
    members.parse(value.encode())
    return list(members)


def test_the_verdict_header_is_capped_with_a_count_of_what_was_left_out() -> None:
    few = results_of(3)
    assert "omitted" not in header.value(few) and len(parsed(header.value(few))) == 3
    many = results_of(60)
    value = header.value(many)
    assert len(value.encode()) <= header.MAX_BYTES == 4096
    members = parsed(value)
    tail = members[-1]
    assert isinstance(tail.value, http_sfv.Token) and str(tail.value) == "omitted"
    kept = members[:-1]
    assert kept and tail.params["count"] == len(many) - len(kept)
    assert [m.params["choice"] for m in kept] == list(range(len(kept)))  # the first ones, in order
    # As many as fit are kept: one more would not.
    one_more = ", ".join(header.member(r, True) for r in many[: len(kept) + 1]) + f", omitted;count={len(many) - len(kept) - 1}"
    assert len(one_more) > header.MAX_BYTES


def test_the_header_cap_at_its_edges() -> None:
    many = results_of(10)
    whole = header.value(many)
    assert header.value(many, limit=len(whole)) == whole
    squeezed = header.value(many, limit=len(whole) - 1)
    assert len(squeezed) <= len(whole) - 1 and squeezed.endswith("omitted;count=1")
    assert header.value(many, limit=20) == "omitted;count=10"


def event_log(tmp_path: pathlib.Path, **kw: Any) -> EventLog:
    store = Store(str(tmp_path / "events.db"))
    ProbeBook(store=store)  # its migrations create the events table
    return EventLog(store=store, keep=1000, **kw)


def test_the_events_queue_is_capped_dropping_the_oldest(tmp_path: pathlib.Path) -> None:
    events = event_log(tmp_path, pending_max=5)
    batch = results_of(8)

    async def run() -> None:
        events.record(batch)  # queued: the writer has not run yet
        assert len(events.pending) == 5 and events.dropped == 3
        await events.flushed()

    asyncio.run(run())
    total, kept = events.read(probe_id=None, request_id=None, trace_id=None, limit=100, offset=0)
    assert total == 5 and {r.result_id for r in kept} == {r.result_id for r in batch[3:]}


def test_shutdown_writes_what_is_still_queued(tmp_path: pathlib.Path) -> None:
    events = event_log(tmp_path)
    batch = results_of(4)
    app = SimpleNamespace(stash={STATE: ProbesState(book=ProbeBook(store=events.store), events=events)})

    async def queue_and_stop() -> None:
        events.record(batch)  # the writer task is created but never gets to run
        assert events.pending
        plugin.millm_shutdown(app)  # type: ignore[arg-type]

    asyncio.run(queue_and_stop())
    assert events.read(probe_id=None, request_id=None, trace_id=None, limit=100, offset=0)[0] == 4
    events.record(results_of(1))  # after shutdown nothing more is written
    assert events.read(probe_id=None, request_id=None, trace_id=None, limit=100, offset=0)[0] == 4


class CountingSAE:
    """A ReLU encoder that records how many positions each call encoded."""

    def __init__(self, d_in: int, d_sae: int) -> None:
        rng = np.random.default_rng(7)
        self.W, self.b = rng.normal(size=(d_in, d_sae)).astype(np.float32), rng.normal(size=d_sae).astype(np.float32)
        self.d_sae = d_sae
        self.calls: list[int] = []

    def encode(self, x: np.ndarray) -> np.ndarray:
        self.calls.append(len(x))
        return np.maximum(x @ self.W + self.b, 0.0).astype(np.float32)


@pytest.mark.parametrize("aggregation", ["mean", "max", "last"])
def test_a_row_aggregates_online_and_encodes_a_long_prefill_a_slice_at_a_time(aggregation: str) -> None:
    d_model, d_sae, prompt, steps = 6, WIDTH, 2 * ROWS + 37, 5
    sae = CountingSAE(d_model, d_sae)
    doc = document("feat", aggregation, basis={"kind": "sae_features", "sae_id": "s"})
    resid = document("resid", aggregation, seed=2, width=d_model)
    dets = [Detector.of(doc), Detector.of(resid)]
    armed = [Armed(dets[0], ("all", "prompt", "response", "last_user")), Armed(dets[1], ("all", "response"))]
    groups, where = build_groups([(armed[0], sae), (armed[1], None)])
    entries = [Entry(a, group=g, column=c) for a, (g, c) in zip(armed, where, strict=True)]
    served = Served(request_id="r", endpoint="chat.completions", model="m", engine="hf", read_point="pre_steering")
    monitor = Monitor(Trace("1" * 32, None, "minted"), served, entries, groups, (Placement((10, 50)),), frozenset())
    row = monitor.processor(SimpleNamespace(index=0, prompt_index=0, prompt_tokens=prompt))  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(prompt + steps, d_model)).astype(np.float32)
    tap = Tap(1, "pre_steering")
    row.on_residuals(Readout(start=0, vectors={tap: vectors[:prompt]}))
    for position in range(prompt, prompt + steps):
        row.on_residuals(Readout(start=position, vectors={tap: vectors[position : position + 1]}))
    assert max(sae.calls) <= ROWS and sum(sae.calls) == prompt + steps
    got = {(r.probe.id, r.window): r for r in monitor.results(interrupted=False)}
    spans = {"all": (0, prompt + steps), "prompt": (0, prompt), "response": (prompt, prompt + steps), "last_user": (10, 50)}
    feats = np.maximum(vectors.astype(np.float64) @ sae.W + sae.b, 0.0)
    for det, basis in ((dets[0], feats), (dets[1], vectors.astype(np.float64))):
        z = basis @ det.w + det.b  # the definition, offline
        for (probe_id, window), res in got.items():
            if probe_id != det.probe_id:
                continue
            start, end = spans[window]
            value = {"mean": z[start:end].mean(), "max": z[start:end].max(), "last": z[end - 1]}[aggregation]
            assert res.outcome == "scored" and res.score == pytest.approx(1 / (1 + np.exp(-value)), abs=1e-7), (probe_id, window)
            assert res.served.positions is not None and (res.served.positions.start, res.served.positions.end) == (start, end)


def test_arming_runs_the_gates_on_the_probe_as_stored_under_the_lock(tmp_path: pathlib.Path) -> None:
    book = ProbeBook(store=Store(str(tmp_path / "book.db")))
    seen: list[Stored] = []

    async def gates(stored: Stored) -> Arming:
        seen.append(stored)
        return Arming(windows=["all"], acknowledged_below_rung2=False, model="m", armed_at=0.0,
                      parity=ParityReport(tolerance=1e-3, max_abs_error=None, vectors=[]))  # fmt: skip

    async def run() -> None:
        await book.add(document("p", seed=1))
        async with book.writing:  # a delete and re-import hold the lock while the arming waits
            arming = asyncio.ensure_future(book.arm("p", gates))
            await asyncio.sleep(0)
            del book.probes["p"]
            replaced = document("p", seed=9)
            book.probes["p"] = Stored(replaced, Detector.of(replaced), 1.0)
        await arming

    asyncio.run(run())
    assert len(seen) == 1 and seen[0] is book.probes["p"]  # what the gates checked is what is armed
    assert book.armed[0].detector is book.probes["p"].detector


def test_no_second_render_for_a_scoring_request() -> None:
    book = ProbeBook(store=Store(":memory:"))
    book.armed = (Armed(Detector.of(document("p")), ("last_user",)),)
    app = SimpleNamespace(stash={STATE: ProbesState(book=book, events=EventLog(store=book.store, keep=10))})
    renders: list[Any] = []
    model = SimpleNamespace(engine=SimpleNamespace(render_chat=lambda messages, **kw: renders.append(messages) or [1, 2, 3]))
    chat = SimpleNamespace(messages=[{"role": "user", "content": "hi"}], opening=None, tools=None, template_kwargs={}, conversation=0)
    for request, rendered in ((SimpleNamespace(logprobs=True), 0), (SimpleNamespace(logprobs=None), 1)):
        ctx = SimpleNamespace(app=app, stash=Stash())
        plugin.millm_render_chat(ctx, request, model, chat)  # type: ignore[arg-type]
        assert len(renders) == rendered and (plugin.ALT in ctx.stash) == bool(rendered)
