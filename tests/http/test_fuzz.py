"""Fuzzed bodies against a running server: 1,200 per endpoint, valid, near-valid and
hostile. Whatever is sent, the server answers without a 5xx; every refusal is OpenAI's
error shape; every success that carried an undeclared top-level field names it in
X-miLLM-Ignored-Fields."""

from __future__ import annotations

import json
from typing import Any

import http_sfv
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from millm_core.config import load_settings
from millm_core.contracts.known import KNOWN_FIELDS
from millm_core.server.app import assemble, build_host
from millm_core.sfv import percent_encode_nonprintable

# Each endpoint's request type as the server builds it, with every installed plugin's fields.
ENDPOINT_CONTRACTS = assemble(build_host(load_settings(environ={}))).request_types

EXAMPLES = 1200
# The fuzzed server runs at most this many rows (prompts × n) per request (the default
# is 64), as the fixture's 64-token window keeps long budgets cheap. The bodies sent are
# the same (derandomised): near-valid ones ask for at most 3 prompts × n=3 = 9 rows from
# their own ranges, so they run as before; the many-rows bodies (1-64 prompts × n=1-64)
# still straddle the cap, the rows under it running and those over it refused as
# too_many_rows (400), as over the default cap. Running every body of 17-64 rows was most
# of this test's time (chat with n up to 64 always ran: seconds per body on 2 cores).
ROW_CAP = 16
PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=16)
weird_keys = st.sampled_from(["user", "foo", "ünïcode", "", " ", "emoji🙂", "a\tb", "__proto__", "x" * 200]) | st.text(max_size=10)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]), "content": st.text(max_size=20) | st.none()},
    optional={"name": st.text(max_size=5), "extra": json_values},
)


def near_valid(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """Structurally right bodies with a random subset of declared fields, each given a
    plausible or hostile value, plus the odd unknown field."""
    declared = sorted(set(ENDPOINT_CONTRACTS[endpoint].__struct_fields__) - {"model", "messages", "prompt", "input", "stream"})
    base = {"model": st.sampled_from(["tiny", "tiny", "tiny", "other"])}
    if endpoint == "chat.completions":
        base["messages"] = st.lists(message, min_size=0, max_size=3)
    elif endpoint == "completions":
        base["prompt"] = st.text(max_size=20) | st.lists(st.text(max_size=10), max_size=3)
    else:
        base["input"] = st.text(max_size=20) | st.lists(st.text(max_size=10), max_size=3)
    small = st.integers(min_value=-3, max_value=6) | st.floats(min_value=-3, max_value=3) | json_values
    optional: dict[str, st.SearchStrategy[Any]] = {name: small for name in declared}
    optional["max_tokens"] = st.integers(min_value=-1, max_value=8) | json_values
    optional["n"] = st.integers(min_value=0, max_value=3) | json_values
    optional["stream"] = st.booleans()
    return st.fixed_dictionaries(base, optional=optional).flatmap(
        lambda body: st.dictionaries(weird_keys, json_values, max_size=2).map(lambda extra: {**extra, **body})
    )


def bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    hostile = st.dictionaries(weird_keys, json_values, max_size=6).map(lambda d: json.dumps(d).encode())
    not_objects = json_values.map(lambda v: json.dumps(v).encode())
    raw = st.binary(max_size=40) | st.text(max_size=40).map(str.encode)
    deep = st.integers(min_value=50, max_value=5000).map(lambda d: ("[" * d + "]" * d).encode())
    huge = st.integers(min_value=10**19, max_value=10**40).map(lambda n: json.dumps({"model": "tiny", "max_tokens": n, "seed": n}).encode())
    valid = near_valid(endpoint).map(lambda d: json.dumps(d).encode())
    # Invalid UTF-8 inside a JSON string; many rows (n × prompts); template parameters a
    # client must not set; very long stop strings.
    bad_utf8 = st.binary(min_size=1, max_size=8).map(lambda b: b'{"model": "tiny", "prompt": "' + b"\xff" + b + b'", "input": "x", "messages": []}')
    many_rows = st.tuples(st.integers(1, 64), st.integers(1, 64)).map(
        lambda t: json.dumps({"model": "tiny", "prompt": ["x"] * t[0], "n": t[1], "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "input": "x"}).encode()
    )
    template_kwargs = st.dictionaries(st.sampled_from(["chat_template", "tokenize", "tools", "documents", "messages", "flag", "return_dict"]), json_values, max_size=3).map(
        lambda kw: json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "chat_template_kwargs": kw}).encode()
    )
    long_stop = st.integers(1, 5000).map(lambda k: json.dumps({"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stop": ["s" * k]}).encode())
    return st.one_of(valid, valid, valid, hostile, not_objects, raw, deep, huge, bad_utf8, many_rows, template_kwargs, long_stop)


def check(resp: httpx.Response, sent: bytes, endpoint: str) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text, sent[:300])
    if resp.status_code >= 300:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
        return
    try:
        body = json.loads(sent)
    except ValueError:  # pragma: no cover - a 2xx needs a JSON object
        raise AssertionError("a non-JSON body was served") from None
    # Known output-changing fields a 2xx carried were neutral: accepted, never "unused".
    unknown = [k for k in body if k not in ENDPOINT_CONTRACTS[endpoint].__struct_fields__ and k not in KNOWN_FIELDS]
    if not unknown:
        return
    parsed = http_sfv.List()
    parsed.parse(resp.headers["x-millm-ignored-fields"].encode())
    listed = [item.value for item in parsed]
    capped = listed and listed[-1].startswith("+") and listed[-1].endswith(" more")
    for key in unknown:
        assert percent_encode_nonprintable(key) in listed or capped, (key, listed)


@pytest.fixture(scope="module")
def fuzzed_server(make_server, short_context_model):  # type: ignore[no-untyped-def]
    """``short_context_server``'s model and settings, with the row cap ``ROW_CAP``."""
    with make_server(models=[short_context_model], default_max_tokens=4, max_rows_per_request=ROW_CAP) as srv:
        yield srv


@pytest.mark.parametrize("endpoint", sorted(PATHS))
def test_fuzzed_bodies_never_break_the_server(fuzzed_server, endpoint: str) -> None:  # type: ignore[no-untyped-def]
    url = fuzzed_server.base_url + PATHS[endpoint]
    with httpx.Client(timeout=30, headers={"content-type": "application/json"}) as http:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
        @given(bodies(endpoint))
        def run(sent: bytes) -> None:
            if endpoint != "embeddings" and b'"stream": true' in sent:
                with http.stream("POST", url, content=sent) as resp:
                    resp.read()
                    if resp.status_code == 200:
                        assert resp.content.endswith(b"data: [DONE]\n\n")
                        return
                    check(resp, sent, endpoint)
                    return
            check(http.post(url, content=sent), sent, endpoint)

        run()
