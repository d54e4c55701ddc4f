"""Armed probes on live traffic, against the offline reference (the tiny model hooked in
the test, the probe fitted here): the right class is flagged, scores equal the offline
ones, header, body and stream agree, and every row of a shared batch is monitored."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import http_sfv
import httpx
import pytest
import torch

from ..http.helpers import scheduler_stats
from .helpers import HELD_CODE, HELD_SEA, JSON, Fitted, arm, chat, chat_ids, content_span, import_probe, ok, stream_lines, user

WINDOWS = ["all", "prompt", "response", "last_user"]


@pytest.fixture(scope="module")
def armed(probe_server: Any, fitted: Fitted) -> Iterator[Any]:
    """The probe armed on every window."""
    import_probe(probe_server, fitted.document(probe_id="sea"))
    ok(arm(probe_server, "sea", windows=WINDOWS))
    yield probe_server
    ok(httpx.delete(probe_server.base_url + "/api/probes/sea", headers=JSON))


def by_window(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["window"]: r for r in results}


def test_a_fitted_probe_flags_the_right_class_on_live_traffic(armed: Any, fitted: Fitted, tiny_engine: Any) -> None:
    for text, verdict in [(t, "flagged") for t in HELD_SEA] + [(t, "clear") for t in HELD_CODE]:
        resp = chat(armed, user(text))
        assert resp.status_code == 200, resp.text
        results = by_window(resp.json()["millm_probe_verdicts"])
        ids = chat_ids(tiny_engine, user(text))
        prompt = results["prompt"]
        assert (prompt["outcome"], prompt["verdict"]) == ("scored", verdict), text
        assert prompt["served"]["positions"] == {"start": 0, "end": len(ids)}
        assert prompt["score"] == pytest.approx(fitted.score(ids), abs=1e-6)
        # last_user is the message's content in the served render: the content's own tokens here.
        last = results["last_user"]
        start, end = last["served"]["positions"]["start"], last["served"]["positions"]["end"]
        assert (start, end) == content_span(tiny_engine, ids, text)
        assert last["verdict"] == verdict
        assert last["score"] == pytest.approx(fitted.score(ids, start, end), abs=1e-6)


def greedy(engine: Any, ids: list[int], tokens: int) -> list[int]:
    """HF generate, greedy: the reference for what the server generates."""
    with torch.no_grad():
        out = engine.model.generate(
            torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(engine.eos_token_ids), pad_token_id=0
        )
    return list(out[0, len(ids) :].tolist())


def test_the_response_and_all_windows_read_the_fed_tokens(armed: Any, fitted: Fitted, tiny_engine: Any) -> None:
    body = chat(armed, user(HELD_SEA[0]), max_tokens=5).json()
    ids = chat_ids(tiny_engine, user(HELD_SEA[0]))
    generated = greedy(tiny_engine, ids, 5)
    assert body["choices"][0]["message"]["content"] == tiny_engine.decode(generated)
    fed = ids + generated[:-1]  # the last draw is never fed back, so it is never read
    results = by_window(body["millm_probe_verdicts"])
    assert results["all"]["served"]["positions"] == {"start": 0, "end": len(fed)}
    assert results["response"]["served"]["positions"] == {"start": len(ids), "end": len(fed)}
    assert results["all"]["score"] == pytest.approx(fitted.score(fed), abs=1e-5)
    assert results["response"]["score"] == pytest.approx(fitted.score(fed, len(ids)), abs=1e-5)
    one = by_window(chat(armed, user(HELD_SEA[0]), max_tokens=1).json()["millm_probe_verdicts"])
    assert (one["response"]["outcome"], one["response"]["reason"], one["response"]["score"]) == ("skipped", "empty_window", None)


def parsed_header(value: str) -> list[tuple[str, dict[str, Any]]]:
    members = http_sfv.List()
    members.parse(value.encode())
    return [(str(m.value), {k: (str(v) if not isinstance(v, int | Decimal) else v) for k, v in m.params.items()}) for m in members]


def as_header(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """What the header must say for ``result``, written from the documented grammar."""
    params: dict[str, Any] = {
        "id": result["probe"]["id"],
        "window": result["window"],
        "outcome": result["outcome"],
        "reason": result["reason"],
    }
    if result["verdict"] is not None:
        params["verdict"] = result["verdict"]
    if result["score"] is not None:
        params["score"] = Decimal(str(round(result["score"], 3)))
    params["threshold"] = Decimal(str(result["threshold"]))
    return result["name"], params


COMPARED = ("probe", "window", "outcome", "reason", "score", "threshold", "verdict", "detector_digest", "decision_digest", "name", "scored")


def test_header_body_and_stream_agree(armed: Any) -> None:
    resp = chat(armed, user(HELD_CODE[0]))
    body = resp.json()["millm_probe_verdicts"]
    assert [r["window"] for r in body] == sorted(WINDOWS)  # by name, then window
    assert parsed_header(resp.headers["x-millm-probe-verdicts"]) == [as_header(r) for r in body]
    assert all(r["trace_id"] == body[0]["trace_id"] and r["served"]["request_id"] == resp.headers["x-request-id"] for r in body)
    headers, lines = stream_lines(armed, {"model": "tiny", "messages": user(HELD_CODE[0]), "max_tokens": 6, "temperature": 0})
    assert "x-millm-probe-verdicts" not in headers  # a stream's headers go out before anything is read
    closing = [line for line in lines[:-1] if not line["choices"]]
    assert [next(k for k in c if k.startswith("millm")) for c in closing] == ["millm_probe_verdicts", "millm_steering"]
    assert lines[-1] == "[DONE]"
    streamed = closing[0]["millm_probe_verdicts"]
    assert [{k: r[k] for k in COMPARED} for r in streamed] == [{k: r[k] for k in COMPARED} for r in body]
    assert all(r["served"]["stream"] for r in streamed) and not any(r["served"]["stream"] for r in body)


def test_every_row_of_a_shared_batch_is_monitored(armed: Any) -> None:
    texts = HELD_SEA[:2] + HELD_CODE[:2]
    solo = {t: chat(armed, user(t)).json() for t in texts}
    before = scheduler_stats(armed.base_url)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, armed, user(t)) for t in texts * 2]
        futures.append(pool.submit(chat, armed, user(texts[0]), n=2, temperature=1.0, seed=3))
        results = [f.result() for f in futures]
    after = scheduler_stats(armed.base_url)
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in results)
    assert after["steps"] - before["steps"] < tokens  # the rows shared decode steps
    for text, resp in zip(texts * 2, results, strict=False):
        got = resp.json()
        assert got["choices"][0]["message"]["content"] == solo[text]["choices"][0]["message"]["content"]
        for mine, alone in zip(got["millm_probe_verdicts"], solo[text]["millm_probe_verdicts"], strict=True):
            assert mine["verdict"] == alone["verdict"] and mine["score"] == pytest.approx(alone["score"], abs=1e-5)
    two = results[-1].json()["millm_probe_verdicts"]
    assert sorted((r["window"], r["served"]["choice"]) for r in two) == sorted((w, c) for w in WINDOWS for c in (0, 1))
    header = parsed_header(results[-1].headers["x-millm-probe-verdicts"])
    assert [p["choice"] for _, p in header] == [r["served"]["choice"] for r in two]  # several rows: each entry names its choice
    prompts = {r["score"] for r in two if r["window"] == "prompt"}
    assert len(prompts) == 1  # both choices share the prompt


def test_text_completions_scoring_and_embeddings(armed: Any) -> None:
    resp = httpx.post(armed.base_url + "/v1/completions", json={"model": "tiny", "prompt": HELD_SEA[0], "max_tokens": 4, "temperature": 0})
    results = by_window(resp.json()["millm_probe_verdicts"])
    assert (results["last_user"]["outcome"], results["last_user"]["reason"]) == ("skipped", "not_a_chat")
    assert results["prompt"]["outcome"] == "scored" and results["prompt"]["served"]["endpoint"] == "completions"
    scoring = httpx.post(armed.base_url + "/v1/completions", json={"model": "tiny", "prompt": HELD_SEA[0], "max_tokens": 1, "logprobs": 2})
    assert scoring.status_code == 200, scoring.text
    for result in scoring.json()["millm_probe_verdicts"]:
        assert (result["outcome"], result["reason"], result["score"], result["verdict"]) == ("not_monitored", "scoring_request", None, None)
        assert result["served"]["read_point"] == "unsteered"
    assert "outcome=not_monitored;reason=scoring_request" in scoring.headers["x-millm-probe-verdicts"]
    embedded = httpx.post(armed.base_url + "/v1/embeddings", json={"model": "tiny", "input": "the sea"})
    assert {(r["outcome"], r["reason"]) for r in embedded.json()["millm_probe_verdicts"]} == {("not_monitored", "embeddings_request")}
    # Neither is user traffic: nothing of theirs is in the events log.
    for resp in (scoring, embedded):
        events = ok(httpx.get(armed.base_url + "/api/probes/events", params={"request_id": resp.headers["x-request-id"]}))
        assert events["total"] == 0


def test_a_model_the_probe_was_not_fitted_on_is_skipped(armed: Any) -> None:
    body = {"model": "tiny-no-template", "messages": user(HELD_SEA[0]), "max_tokens": 3, "temperature": 0}
    resp = httpx.post(armed.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert {(r["outcome"], r["reason"]) for r in resp.json()["millm_probe_verdicts"]} == {("skipped", "model_mismatch")}


def test_per_window_thresholds_and_the_last_aggregation(probe_server: Any, fitted: Fitted, tiny_engine: Any) -> None:
    text = HELD_CODE[1]
    ids = chat_ids(tiny_engine, user(text))
    fed = ids + greedy(tiny_engine, ids, 6)[:-1]
    prompt, response = fitted.score(ids), fitted.score(fed, len(ids))
    assert prompt < 0.5 and response > 0.01  # code: the prompt clears the document's threshold
    split = fitted.document("split", probe_id="split", decision={"threshold": 0.5, "windows": {"response": response - 0.01}})
    import_probe(probe_server, split)
    import_probe(probe_server, fitted.document("final", probe_id="final", aggregation="last"))
    try:
        ok(arm(probe_server, "split", windows=["prompt", "response"]))
        ok(arm(probe_server, "final", windows=WINDOWS))
        resp = chat(probe_server, user(text))
        got = {(r["probe"]["id"], r["window"]): r for r in resp.json()["millm_probe_verdicts"]}
        # One probe, two windows, two thresholds: the response flags at its own while the prompt clears.
        assert (got["split", "prompt"]["threshold"], got["split", "prompt"]["verdict"]) == (0.5, "clear")
        assert got["split", "response"]["threshold"] == pytest.approx(response - 0.01)
        assert got["split", "response"]["verdict"] == "flagged"
        assert got["split", "response"]["score"] == pytest.approx(response, abs=1e-5)
        # ``last``: the logit at each window's last read position, as computed offline.
        start, end = content_span(tiny_engine, ids, text)
        want = {"all": fitted.score(fed, how="last"), "prompt": fitted.score(ids, how="last"),
                "response": fitted.score(fed, len(ids), how="last"), "last_user": fitted.score(ids, start, end, how="last")}  # fmt: skip
        for window, score in want.items():
            assert got["final", window]["outcome"] == "scored" and got["final", window]["score"] == pytest.approx(score, abs=1e-5), window
        assert got["final", "all"]["score"] == got["final", "response"]["score"]  # both end at the last fed token
    finally:
        for probe_id in ("split", "final"):
            httpx.delete(f"{probe_server.base_url}/api/probes/{probe_id}", headers=JSON)


def test_a_long_verdict_header_is_capped_and_the_body_complete(armed: Any) -> None:
    resp = chat(armed, user(HELD_SEA[2]), n=12, temperature=1.0, seed=5, max_tokens=3)
    body = resp.json()["millm_probe_verdicts"]
    assert len(body) == 12 * len(WINDOWS)
    value = resp.headers["x-millm-probe-verdicts"]
    assert len(value.encode()) <= 4096
    members = http_sfv.List()
    members.parse(value.encode())
    *kept, tail = list(members)
    assert isinstance(tail.value, http_sfv.Token) and str(tail.value) == "omitted"
    assert tail.params["count"] == len(body) - len(kept) > 0
    assert [(m.params["choice"], str(m.params["window"])) for m in kept] == [
        (r["served"]["choice"], r["window"]) for r in body[: len(kept)]
    ]
