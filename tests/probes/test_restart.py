"""Probes, their arming and the events log live in the database: a server restarted on the
same file has the same probes armed on the same windows, and its responses carry the same
verdicts."""

from __future__ import annotations

import pathlib
from typing import Any

import httpx

from .helpers import HELD_SEA, JSON, Fitted, arm, chat, import_probe, ok, user


def listing(srv: Any, **params: Any) -> list[dict[str, Any]]:
    return list(ok(httpx.get(srv.base_url + "/api/probes", params=params))["data"])


def verdicts(resp: httpx.Response) -> list[tuple[str, str, float, str]]:
    return [(r["probe"]["id"], r["window"], round(r["score"], 9), r["verdict"]) for r in resp.json()["millm_probe_verdicts"]]


def test_armed_state_survives_a_restart(make_server: Any, fitted: Fitted, tmp_path: pathlib.Path) -> None:
    db = str(tmp_path / "millm.db")
    with make_server(db=db) as first:
        import_probe(first, fitted.document("sea", probe_id="sea"))
        import_probe(first, fitted.document("weak", probe_id="weak", rung=1))
        import_probe(first, fitted.document("idle", probe_id="idle"))
        ok(arm(first, "sea", windows=["prompt", "last_user"]))
        ok(arm(first, "weak", windows=["response"], acknowledge_below_rung2=True))
        ok(arm(first, "idle"))
        ok(httpx.post(first.base_url + "/api/probes/idle/disarm", json={}))
        before, armed_before = listing(first), listing(first, armed="true")
        served = chat(first, user(HELD_SEA[0]))
        logged = ok(httpx.get(first.base_url + "/api/probes/events"))["total"]
    assert [p["id"] for p in armed_before] == ["sea", "weak"]

    with make_server(db=db) as second:
        assert listing(second) == before
        assert listing(second, armed="true") == armed_before  # windows, acknowledgement, parity and all
        again = chat(second, user(HELD_SEA[0]))
        assert verdicts(again) == verdicts(served)
        assert ok(httpx.get(second.base_url + "/api/probes/events"))["total"] == logged + len(verdicts(again))
        ok(httpx.delete(second.base_url + "/api/probes/sea", headers=JSON))

    with make_server(db=db) as third:
        assert [p["id"] for p in listing(third, armed="true")] == ["weak"]
        assert [p["id"] for p in listing(third)] == ["idle", "weak"]
