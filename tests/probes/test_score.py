"""``POST /api/probes/score``: the armed (or named) probes on given chats or token ids,
equal to the offline scores; unsteered while steering is live; nothing persisted, no
steering header; its limits are 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .helpers import HELD_CODE, HELD_SEA, JSON, LAYER, Fitted, arm, chat, chat_ids, content_span, import_probe, ok, user, write_sae


@pytest.fixture(scope="module")
def scorer(make_server: Any, fitted: Fitted, tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two probes, one armed; an SAE attached below the probes' layer with live manual
    values, so that every chat completion here reads a steered residual stream."""
    sae = write_sae(tmp_path_factory.mktemp("score-sae") / "sae", tiny_engine.info.d_model, seed=9)
    with make_server(probes_score_max_inputs=3, probes_score_max_tokens=200) as srv:
        import_probe(srv, fitted.document("sea", probe_id="sea"))
        import_probe(srv, fitted.document("other", probe_id="other", aggregation="max"))
        ok(arm(srv, "sea", windows=["all", "last_user"]))
        ok(httpx.post(srv.base_url + "/api/saes", json={"path": sae, "id": "s"}), 201)
        ok(httpx.post(srv.base_url + "/api/saes/s/attach", json={"layer": LAYER - 1}))
        ok(httpx.put(srv.base_url + "/api/steering", json={"features": [{"index": 1, "strength": 30.0}]}))
        yield srv


def score(srv: Any, **body: Any) -> httpx.Response:
    return httpx.post(srv.base_url + "/api/probes/score", json=body, timeout=60)


def test_scores_equal_the_offline_ones_unsteered(scorer: Any, fitted: Fitted, tiny_engine: Any) -> None:
    sea, code = chat_ids(tiny_engine, user(HELD_SEA[0])), chat_ids(tiny_engine, user(HELD_CODE[0]))
    resp = score(scorer, inputs=[{"messages": user(HELD_SEA[0])}, {"token_ids": code}])
    assert resp.status_code == 200, resp.text
    assert "x-millm-steering" not in resp.headers and "x-millm-probe-verdicts" not in resp.headers
    got = {(r["served"]["input"], r["window"]): r for r in resp.json()["data"]}
    assert set(got) == {(0, "all"), (0, "last_user"), (1, "all"), (1, "last_user")}  # the armed probe, its windows
    assert got[0, "all"]["score"] == pytest.approx(fitted.score(sea), abs=1e-6) and got[0, "all"]["verdict"] == "flagged"
    start, end = content_span(tiny_engine, sea, HELD_SEA[0])
    assert got[0, "last_user"]["score"] == pytest.approx(fitted.score(sea, start, end), abs=1e-6)
    assert got[1, "all"]["score"] == pytest.approx(fitted.score(code), abs=1e-6) and got[1, "all"]["verdict"] == "clear"
    assert (got[1, "last_user"]["outcome"], got[1, "last_user"]["reason"]) == ("skipped", "not_a_chat")
    assert {r["served"]["read_point"] for r in resp.json()["data"]} == {"unsteered"}
    assert {r["served"]["request_id"] for r in resp.json()["data"]} == {resp.headers["x-request-id"]}
    # The same chat generated here is steered (below the probe's layer) and reads otherwise.
    resp = chat(scorer, user(HELD_SEA[0]))
    assert resp.headers["x-millm-steering"].startswith("manual")
    live = {r["window"]: r for r in resp.json()["millm_probe_verdicts"]}
    assert live["last_user"]["served"]["positions"] == got[0, "last_user"]["served"]["positions"]
    assert abs(live["last_user"]["score"] - got[0, "last_user"]["score"]) > 1e-4


def test_named_probes_and_windows(scorer: Any, fitted: Fitted, tiny_engine: Any) -> None:
    ids = chat_ids(tiny_engine, user(HELD_CODE[1]))
    resp = score(scorer, probe_ids=["other", "sea"], windows=["prompt", "response"], inputs=[{"token_ids": ids}])
    got = {(r["probe"]["id"], r["window"]): r for r in resp.json()["data"]}
    assert set(got) == {(p, w) for p in ("other", "sea") for w in ("prompt", "response")}
    assert got["other", "prompt"]["score"] == pytest.approx(fitted.score(ids, how="max"), abs=1e-6)
    assert (got["sea", "response"]["outcome"], got["sea", "response"]["reason"]) == ("skipped", "no_response")


def test_scoring_persists_nothing(scorer: Any, tiny_engine: Any) -> None:
    before = ok(httpx.get(scorer.base_url + "/api/probes/events"))["total"]
    probes = ok(httpx.get(scorer.base_url + "/api/probes"))
    ok(score(scorer, inputs=[{"token_ids": chat_ids(tiny_engine, user(HELD_SEA[1]))}]))
    assert ok(httpx.get(scorer.base_url + "/api/probes/events"))["total"] == before
    assert ok(httpx.get(scorer.base_url + "/api/probes")) == probes


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"inputs": [{"token_ids": [1, 2]}] * 4}, 400, "inputs"),  # probes_score_max_inputs = 3
        ({"inputs": [{"token_ids": [1] * 150}, {"token_ids": [1] * 60}]}, 400, "inputs"),  # probes_score_max_tokens = 200
        ({"inputs": []}, 400, "inputs"),
        ({"inputs": [{"token_ids": [1, 2], "messages": user("hi")}]}, 400, "inputs[0]"),
        ({"inputs": [{}]}, 400, "inputs[0]"),
        ({"inputs": [{"token_ids": [1, 99999]}]}, 400, "inputs[0].token_ids[1]"),
        ({"probe_ids": ["nope"], "inputs": [{"token_ids": [1, 2]}]}, 404, "id"),
        ({"probe_ids": [], "inputs": [{"token_ids": [1, 2]}]}, 400, "probe_ids"),
        ({"windows": ["nowhere"], "inputs": [{"token_ids": [1, 2]}]}, 400, "windows[0]"),
    ],
)
def test_limits_and_bad_inputs(scorer: Any, body: dict[str, Any], status: int, param: str) -> None:
    resp = score(scorer, **body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_without_an_armed_probe_name_one(make_server: Any, fitted: Fitted) -> None:
    with make_server() as srv:
        import_probe(srv, fitted.document(probe_id="sea"))
        resp = score(srv, inputs=[{"token_ids": [1, 2, 3]}])
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "probe_ids"
        named = ok(score(srv, probe_ids=["sea"], inputs=[{"token_ids": [1, 2, 3]}]))
        assert [r["window"] for r in named["data"]] == ["all"]
        httpx.delete(srv.base_url + "/api/probes/sea", headers=JSON)


def test_a_request_scores_at_most_probes_max_armed_probes(make_server: Any, fitted: Fitted) -> None:
    """One request scores at most ``probes_max_armed`` probes, armed or not: naming more is a
    400 on ``probe_ids``; a name given twice counts once."""
    with make_server(probes_max_armed=1) as srv:
        import_probe(srv, fitted.document("sea", probe_id="sea"))
        import_probe(srv, fitted.document("other", probe_id="other"))
        both = score(srv, probe_ids=["sea", "other"], inputs=[{"token_ids": [1, 2, 3]}])
        assert both.status_code == 400, both.text
        assert both.json()["error"]["param"] == "probe_ids"
        assert "probes_max_armed" in both.json()["error"]["message"]
        one = ok(score(srv, probe_ids=["other"], inputs=[{"token_ids": [1, 2, 3]}]))  # at the limit
        assert [r["probe"]["id"] for r in one["data"]] == ["other"]
        twice = ok(score(srv, probe_ids=["sea", "sea"], inputs=[{"token_ids": [1, 2, 3]}]))
        assert [r["probe"]["id"] for r in twice["data"]] == ["sea"]
