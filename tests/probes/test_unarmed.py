"""With no probe armed a response is unchanged byte for byte: the same greedy requests to a
server without the probes plugin and to one with it (a probe imported, armed and disarmed
again) give equal bodies (ids and timestamps aside), equal headers and equal streams."""

from __future__ import annotations

from typing import Any

import httpx

from millm_core.config import load_settings
from millm_core.server.app import build_host

from .helpers import HELD_SEA, Fitted, arm, import_probe, ok, stable, user

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "tiny", "messages": user(HELD_SEA[0]), "max_tokens": 8, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": user(HELD_SEA[1]), "max_tokens": 8, "temperature": 0, "stream": True}),
    ("/v1/completions", {"model": "tiny", "prompt": HELD_SEA[2], "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"model": "tiny", "prompt": HELD_SEA[2], "max_tokens": 1, "logprobs": 3}),
    ("/v1/embeddings", {"model": "tiny", "input": ["the sea", "the code"]}),
]
VOLATILE_HEADERS = {"date", "x-request-id"}


def headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k not in VOLATILE_HEADERS}


def test_an_unarmed_response_is_unchanged_byte_for_byte(make_server: Any, fitted: Fitted) -> None:
    without_probes = build_host(load_settings({"block_plugins": ("probes",)}, environ={}))
    with make_server(host=without_probes) as plain, make_server() as probed:
        assert httpx.get(plain.base_url + "/api/probes").status_code == 404  # the plugin is really absent there
        import_probe(probed, fitted.document(probe_id="idle"))
        ok(arm(probed, "idle", windows=["all", "last_user"]))
        ok(httpx.post(probed.base_url + "/api/probes/idle/disarm", json={}))
        for path, body in REQUESTS:
            a = httpx.post(plain.base_url + path, json=body, timeout=60)
            b = httpx.post(probed.base_url + path, json=body, timeout=60)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert stable(a.content) == stable(b.content), path
            assert headers(a) == headers(b), path
            assert b"millm_probe_verdicts" not in b.content and "x-millm-probe-verdicts" not in b.headers
        # Armed again, the same request does carry verdicts: the comparison above could fail.
        ok(arm(probed, "idle"))
        path, body = REQUESTS[0]
        assert stable(httpx.post(probed.base_url + path, json=body).content) != stable(httpx.post(plain.base_url + path, json=body).content)
