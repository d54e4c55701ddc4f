"""Prometheus metrics and the access log, read from a real server after real requests."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MESSAGES = [{"role": "user", "content": "count"}]


def scrape(base_url: str, **kwargs: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = httpx.get(base_url + "/metrics", **kwargs)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(resp.text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_requests_tokens_and_latencies_are_counted(make_server, info_logs: None) -> None:  # type: ignore[no-untyped-def]
    from structlog.testing import capture_logs

    with make_server() as srv, capture_logs() as logs:
        before = scrape(srv.base_url)
        ok = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}, headers={"X-Request-Id": "m-1"})
        assert ok.status_code == 200
        missing = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        assert missing.status_code == 404
        after = scrape(srv.base_url)
    usage = ok.json()["usage"]
    chat = {"route": "/v1/chat/completions"}
    assert value(after, "millm_requests_total", **chat, status="200", code="") - value(before, "millm_requests_total", **chat, status="200", code="") == 1
    assert value(after, "millm_requests_total", **chat, status="404", code="model_not_found") == 1
    delta = {name: value(after, name, endpoint="chat.completions") - value(before, name, endpoint="chat.completions") for name in ("millm_prompt_tokens_total", "millm_completion_tokens_total")}
    assert delta == {"millm_prompt_tokens_total": usage["prompt_tokens"], "millm_completion_tokens_total": usage["completion_tokens"]}
    # One first token per request; one gap per later step of a single-row request.
    assert value(after, "millm_time_to_first_token_seconds_count") - value(before, "millm_time_to_first_token_seconds_count") == 1
    gaps = value(after, "millm_inter_token_latency_seconds_count") - value(before, "millm_inter_token_latency_seconds_count")
    assert gaps == usage["completion_tokens"] - 1
    assert value(after, "millm_queue_depth") == 0 and value(after, "millm_running_rows") == 0
    assert value(after, "millm_scheduler_steps_total") >= usage["completion_tokens"]
    steps = value(after, "millm_scheduler_step_seconds_count") - value(before, "millm_scheduler_step_seconds_count")
    assert steps == value(after, "millm_scheduler_steps_total") - value(before, "millm_scheduler_steps_total") >= usage["completion_tokens"]
    lines = [e for e in logs if e["event"] == "request" and e.get("request_id") == "m-1"]
    assert len(lines) == 1
    assert (lines[0]["method"], lines[0]["path"], lines[0]["status"]) == ("POST", "/v1/chat/completions", 200)
    assert (lines[0]["prompt_tokens"], lines[0]["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert lines[0]["duration_ms"] > 0


def test_metrics_need_the_api_key_when_one_is_set(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(api_key=("metrics-key",)) as srv:
        assert httpx.get(srv.base_url + "/metrics").status_code == 401
        samples = scrape(srv.base_url, headers={"Authorization": "Bearer metrics-key"})
        # The refusal above was counted by route, status and code.
        assert value(samples, "millm_requests_total", route="/metrics", status="401", code="invalid_api_key") == 1


def test_a_client_gone_mid_upload_is_a_400_not_a_500(make_server) -> None:  # type: ignore[no-untyped-def]
    """A body cut short by its client is counted as 400 incomplete_body, on a JSON route and
    on the multipart file upload alike (never an unhandled 500)."""
    import socket
    import time

    with make_server() as srv:
        for path, kind in (("/v1/chat/completions", "application/json"), ("/v1/files", "multipart/form-data; boundary=b")):
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {kind}\r\nContent-Length: 100000\r\n\r\n"
                sock.sendall(head.encode() + b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbat")
            deadline = time.monotonic() + 10
            while True:
                samples = scrape(srv.base_url)
                counted = value(samples, "millm_requests_total", route=path, status="400", code="incomplete_body")
                if counted == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert counted == 1, path
            assert value(samples, "millm_requests_total", route=path, status="500", code="internal_error") == 0, path
