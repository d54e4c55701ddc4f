"""Honest request handling against the running server: reporting, strict mode, ranges,
and the error table through the openai SDK's exception classes."""

from __future__ import annotations

import http_sfv
import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]


def ignored(resp: httpx.Response) -> list[str] | None:
    value = resp.headers.get("x-millm-ignored-fields")
    if value is None:
        return None
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    return [item.value for item in parsed]


def post(server, path: str, body: dict, **headers: str) -> httpx.Response:  # type: ignore[no-untyped-def, type-arg]
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


def test_unused_fields_are_reported_streaming_too(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "x"}], "max_tokens": 2, "user": "u", "foo": {"bar": 1}}
    plain = post(server, "/v1/chat/completions", body)
    assert plain.status_code == 200
    assert ignored(plain) == ["user", "foo", "messages[0].name"]  # body order, then message fields
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert set(ignored(resp) or []) == {"user", "foo", "messages[0].name"}
        resp.read()
    clean = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert ignored(clean) is None


def test_unknown_keys_in_nested_lists_and_tagged_unions_are_reported(server) -> None:  # type: ignore[no-untyped-def]
    """Keys nobody declared inside ``extra_messages`` conversations and inside a
    ``response_format`` object are named too, not dropped."""
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "extra_messages": [[{"role": "user", "content": "hello", "weight": 2}]],
        "response_format": {"type": "json_object", "foo": 1},
        "max_tokens": 2,
    }
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert ignored(resp) == ["extra_messages[0][0].weight", "response_format.foo"]


def test_header_is_capped_and_nonprintable_names_are_encoded(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, **{f"field_{i:03d}_padding_padding": i for i in range(80)}, "clé": 1}
    resp = post(server, "/v1/completions", body)
    value = resp.headers["x-millm-ignored-fields"]
    assert len(value.encode()) <= 1024
    entries = ignored(resp) or []
    assert entries[-1].startswith("+") and entries[-1].endswith(" more")
    assert len(entries) - 1 + int(entries[-1][1:-5]) == 81
    small = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "clé": 1})
    assert ignored(small) == ["cl%C3%A9"]


@pytest.mark.parametrize("value", ["true", "1", "TRUE"])
def test_strict_mode_refuses_every_unused_location(server, value: str) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "x"}], "user": "u", "max_tokens": 2}
    resp = post(server, "/v1/chat/completions", body, **{"X-miLLM-Strict": value})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "unused_fields_refused"
    assert "user" in error["message"] and "messages[0].name" in error["message"]
    streamed = post(server, "/v1/chat/completions", {**body, "stream": True}, **{"X-miLLM-Strict": value})
    assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "unused_fields_refused"
    clean = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, **{"X-miLLM-Strict": value})
    assert clean.status_code == 200


@pytest.mark.parametrize("value", ["false", "0"])
def test_strict_off_reports(server, value: str) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "user": "u"}, **{"X-miLLM-Strict": value})
    assert resp.status_code == 200 and ignored(resp) == ["user"]


def test_strict_header_with_another_value_is_refused(server) -> None:  # type: ignore[no-untyped-def]
    resp = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}, **{"X-miLLM-Strict": "yes"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-miLLM-Strict"


OUT_OF_RANGE = [
    ("temperature", 2.0001), ("temperature", -0.1), ("top_p", 1.5), ("top_p", -0.01), ("top_k", 21), ("top_k", -1),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("seed", 2**32), ("seed", -1), ("seed", True),
    ("n", 0), ("max_tokens", 0), ("max_completion_tokens", 0), ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""),
    ("temperature", "hot"), ("max_tokens", 3.5),
]


@pytest.mark.parametrize(("path", "base"), [
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}),
    ("/v1/completions", {"model": "tiny", "prompt": "x"}),
])
@pytest.mark.parametrize(("field", "value"), OUT_OF_RANGE)
def test_out_of_range_values_are_refused_never_clamped(server, path: str, base: dict, field: str, value: object) -> None:  # type: ignore[no-untyped-def, type-arg]
    resp = post(server, path, {**base, field: value})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == field and error["code"] == "invalid_parameter"


def test_boundary_values_are_served(server) -> None:  # type: ignore[no-untyped-def]
    for field, value in (("temperature", 2.0), ("top_p", 1.0), ("top_k", 20), ("frequency_penalty", -2.0), ("seed", 2**32 - 1), ("top_k", 0)):
        resp = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, field: value})
        assert resp.status_code == 200, (field, resp.text)


ERRORS = [
    # (body or raw bytes, headers, status, code, SDK exception)
    (b"{not json", 400, "invalid_json"),
    ({"model": "tiny", "messages": "hello"}, 400, "invalid_parameter"),
    ({"model": "nope", "messages": MESSAGES}, 404, "model_not_found"),
    ({"model": "tiny", "messages": MESSAGES, "logit_bias": {"5": 1}}, 400, "field_not_honoured"),
    ({"model": "tiny", "messages": MESSAGES, "max_tokens": 100000}, 400, "context_length_exceeded"),
]


@pytest.mark.parametrize(("body", "status", "code"), ERRORS)
def test_error_table_shapes(server, body: object, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(server.base_url + "/v1/chat/completions", **kwargs)  # type: ignore[arg-type]
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]


def test_sdk_raises_the_matching_exception_classes(client) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (dict(model="nope", messages=MESSAGES), openai.NotFoundError, 404),
        (dict(model="tiny", messages=MESSAGES, temperature=9), openai.BadRequestError, 400),
        (dict(model="tiny", messages=MESSAGES, logit_bias={"1": 1}), openai.BadRequestError, 400),
        (dict(model="tiny", messages=MESSAGES, max_tokens=10**6), openai.BadRequestError, 400),
    ]
    for kwargs, exc_type, status in cases:
        with pytest.raises(exc_type) as info:
            client.chat.completions.create(**kwargs)
        assert info.value.status_code == status


def test_one_log_event_with_locations_never_values(server) -> None:  # type: ignore[no-untyped-def]
    from structlog.testing import capture_logs

    secret = "s3cr3t-value-9471"
    with capture_logs() as logs:
        resp = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1, "user": secret, "note": {"k": secret}})
    assert resp.status_code == 200
    events = [e for e in logs if e["event"] == "request_fields_unused"]
    assert len(events) == 1
    assert events[0]["locations"] == ["user", "note"]
    assert events[0]["log_level"] == "warning"
    assert secret not in repr(logs)


def test_an_undeclared_unknown_field_is_only_reported(server) -> None:  # type: ignore[no-untyped-def]
    """A field no enabled plugin declares, and that is not known to change the output, is
    reported, never refused or silently dropped."""
    resp = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, "my_plugin_option": ["x"]})
    assert resp.status_code == 200
    assert resp.headers["x-millm-ignored-fields"] == '"my_plugin_option"'


def test_known_fields_of_disabled_plugins_are_refused_by_name(make_server) -> None:  # type: ignore[no-untyped-def]
    """With only the sampling plugin, the steering and scoring plugins' fields are not
    declared; sent with a value that would change the output they are refused by name,
    and their neutral values are accepted without a report."""
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"plugins": ("sampling",)}, environ={}))
    with make_server(host=host) as srv:
        url = srv.base_url + "/v1/chat/completions"
        base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for field, value in (("steering", {"features": []}), ("profile", "p"), ("logprobs", True), ("response_format", {"type": "json_object"}), ("thinking_budget", 5)):
            resp = httpx.post(url, json={**base, field: value})
            assert resp.status_code == 400, (field, resp.text)
            assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == ("field_not_honoured", field)
        neutral = httpx.post(url, json={**base, "logprobs": False, "tools": [], "scoring_precision": "native", "steering": None})
        assert neutral.status_code == 200, neutral.text
        assert "x-millm-ignored-fields" not in neutral.headers
        schema = httpx.get(srv.base_url + "/v1/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
        assert "steering" not in schema["properties"] and "top_k" in schema["properties"]
