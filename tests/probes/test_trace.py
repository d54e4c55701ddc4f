"""W3C ``traceparent``: parsed as the OpenTelemetry propagator parses it (an independent
implementation, checked on generated headers), carried into every result; a malformed or
repeated header is ignored and a new trace id is minted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from opentelemetry import trace as otel
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from millm_plugins.probes.trace import parse, trace_of

from .helpers import HELD_SEA, JSON, Fitted, arm, chat_ids, import_probe, ok, user

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEX = "0123456789abcdef"


def reference(value: str) -> tuple[str, str] | None:
    """What the OpenTelemetry propagator extracts from one header value."""
    context = TraceContextTextMapPropagator().extract({"traceparent": value})
    span = otel.get_current_span(context).get_span_context()
    if not span.is_valid:
        return None
    return otel.format_trace_id(span.trace_id), otel.format_span_id(span.span_id)


def hexes(size: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(HEX, min_size=size, max_size=size),
        st.just("0" * size),
        st.text(HEX + "ABCDEFgx", min_size=size - 1, max_size=size + 1),
    )


headers = st.builds(
    lambda lead, version, trace_id, span_id, flags, tail: f"{lead}{version}-{trace_id}-{span_id}-{flags}{tail}",
    st.sampled_from(["", " ", "\t", "  "]),
    st.one_of(st.sampled_from(["00", "01", "fe", "ff", "0A", "0"]), st.text(HEX, min_size=2, max_size=2)),
    hexes(32),
    hexes(16),
    st.one_of(st.sampled_from(["00", "01", "ff", "1", "0x"]), st.text(HEX, min_size=2, max_size=2)),
    st.sampled_from(["", " ", "\t", "-", "-extra", "-00", "x", " -x", "--"]),
)
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


@given(st.one_of(headers, printable))
@example(VALID)
@example(VALID.upper())
@example(VALID + "-more")
@example("01" + VALID[2:] + "-more")
@example("ff" + VALID[2:])
@example(" " + VALID + "\t")
@example(VALID.replace("4bf92f35", "00000000").replace("77b34da6a3ce929d0e0e4736", "0" * 24))
@example("01" + VALID[2:] + "x" * 500)
@example("01" + VALID[2:] + "-x, " + VALID)
def test_parsing_agrees_with_the_opentelemetry_propagator(value: str) -> None:
    # Except on purpose: a value with a comma is a repeated header HTTP joined, never one traceparent.
    assert parse([value]) == (None if "," in value else reference(value))


def test_a_repeated_or_missing_header_is_ignored() -> None:
    assert parse([VALID, VALID]) is None and parse([]) is None
    assert trace_of({"traceparent": [VALID, VALID]}).source == "minted"
    assert trace_of({"traceparent": f"{VALID}, {VALID}"}).source == "minted"  # how HTTP joins a repeated field
    # A later version may carry more after a "-", but never a comma: joined repeats are ignored too.
    later = "01" + VALID[2:]
    assert parse([later + "-more"]) is not None
    assert parse([f"{later}-more, {later}"]) is None and parse([f"{later}-a,b"]) is None
    assert trace_of({"traceparent": f"{later}-more, {later}"}).source == "minted"
    minted = {trace_of({}).trace_id for _ in range(5)}
    assert len(minted) == 5 and all(re.fullmatch("[0-9a-f]{32}", t) for t in minted)


@pytest.fixture(scope="module")
def traced(probe_server: Any, fitted: Fitted) -> Iterator[Any]:
    import_probe(probe_server, fitted.document(probe_id="sea"))
    ok(arm(probe_server, "sea", windows=["prompt", "last_user"]))
    yield probe_server
    ok(httpx.delete(probe_server.base_url + "/api/probes/sea", headers=JSON))


def traces(resp: httpx.Response, key: str = "millm_probe_verdicts") -> set[tuple[str, str | None, str]]:
    assert resp.status_code == 200, resp.text
    results = resp.json()[key] if key in resp.json() else resp.json()["data"]
    return {(r["trace_id"], r["parent_id"], r["trace_source"]) for r in results}


def post_chat(srv: Any, headers: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": user(HELD_SEA[0]), "max_tokens": 3, "temperature": 0}
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers=headers)


def test_results_join_the_callers_trace(traced: Any) -> None:
    assert traces(post_chat(traced, {"traceparent": VALID})) == {("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "traceparent")}
    events = ok(httpx.get(traced.base_url + "/api/probes/events", params={"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}))
    assert events["total"] >= 2


@pytest.mark.parametrize("bad", [VALID.upper(), "00-" + "0" * 32 + "-00f067aa0ba902b7-01", VALID + "-more", "ff" + VALID[2:], "garbage"])
def test_a_malformed_header_is_ignored_and_an_id_minted(traced: Any, bad: str) -> None:
    first, second = traces(post_chat(traced, {"traceparent": bad})), traces(post_chat(traced, {"traceparent": bad}))
    assert len(first) == len(second) == 1
    (a, parent, source), (b, _, _) = first.pop(), second.pop()
    assert source == "minted" and parent is None and a != b and "4bf92f35" not in a


def test_a_repeated_header_is_ignored_on_the_score_route(traced: Any, tiny_engine: Any) -> None:
    body = {"inputs": [{"token_ids": chat_ids(tiny_engine, user(HELD_SEA[0]))}]}
    once = httpx.post(traced.base_url + "/api/probes/score", json=body, headers={"traceparent": VALID})
    assert traces(once, "data") == {("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "traceparent")}
    twice = httpx.post(traced.base_url + "/api/probes/score", json=body, headers=[("traceparent", VALID), ("traceparent", VALID)])
    assert {source for _, _, source in traces(twice, "data")} == {"minted"}


def test_a_repeated_header_is_ignored_on_completions(traced: Any) -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    assert {source for _, _, source in traces(post_chat(traced, [("traceparent", VALID), ("traceparent", other)]))} == {"minted"}
    later = "01" + VALID[2:] + "-more"  # a later version's value, which would parse alone
    assert {source for _, _, source in traces(post_chat(traced, {"traceparent": later}))} == {"traceparent"}
    assert {source for _, _, source in traces(post_chat(traced, [("traceparent", later), ("traceparent", later)]))} == {"minted"}
