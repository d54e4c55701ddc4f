"""Decoding bodies into contracts: ranges refused (never clamped), types refused with the
JSON path, nothing but InvalidRequest escapes."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from millm_core.codec import convert, decode_json
from millm_core.config import load_settings
from millm_core.contracts.completions import CompletionRequest
from millm_core.errors import InvalidRequest
from millm_core.server.app import assemble, build_host

# The chat request type as a server with every installed plugin builds it (top_k is the
# sampling plugin's field, joined on at start-up).
ChatCompletionRequest = assemble(build_host(load_settings(environ={}))).request_types["chat.completions"]

BASE: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# field -> (lowest valid, highest valid); integers are exact bounds.
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 20),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "seed": (0, 2**32 - 1),
    "max_tokens": (1, math.inf),  # bounded later by the context window
    "n": (1, math.inf),  # bounded by --max-rows-per-request (400 too_many_rows)
}
INTEGER_FIELDS = {"top_k", "seed", "max_tokens", "n"}


def _number(field: str) -> st.SearchStrategy[Any]:
    if field in INTEGER_FIELDS:
        return st.integers(min_value=-(2**70), max_value=2**70)
    return st.floats(allow_nan=False, allow_infinity=False, width=64)


@pytest.mark.parametrize("field", sorted(RANGES))
@given(data=st.data())
def test_in_range_accepted_out_of_range_refused_never_clamped(field: str, data: st.DataObject) -> None:
    value = data.draw(_number(field))
    low, high = RANGES[field]
    body = {**BASE, field: value}
    if low <= value <= high:
        decoded = convert(body, ChatCompletionRequest)
        assert getattr(decoded, field) == value  # the exact value, never a clamped one
    else:
        with pytest.raises(InvalidRequest) as info:
            convert(body, ChatCompletionRequest)
        assert info.value.param == field
        assert info.value.status == 400


@pytest.mark.parametrize("field", ["seed", "n", "max_tokens", "top_k"])
def test_booleans_are_not_integers(field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        convert({**BASE, field: True}, ChatCompletionRequest)
    assert info.value.param == field


def test_nan_and_infinity_are_refused() -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(InvalidRequest):
            convert({**BASE, "temperature": bad}, ChatCompletionRequest)


def test_type_error_names_nested_path() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}
    with pytest.raises(InvalidRequest) as info:
        convert(body, ChatCompletionRequest)
    assert info.value.param == "messages[1].role"


def test_stop_rules() -> None:
    assert convert({**BASE, "stop": "x"}, ChatCompletionRequest).stop == "x"
    assert convert({**BASE, "stop": ["a", "b", "c", "d"]}, ChatCompletionRequest).stop == ["a", "b", "c", "d"]
    for bad in ("", ["a", ""], ["a", "b", "c", "d", "e"], [1]):
        with pytest.raises(InvalidRequest):
            convert({**BASE, "stop": bad}, ChatCompletionRequest)


def test_empty_messages_and_prompt_lists_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        convert({"model": "m", "messages": []}, ChatCompletionRequest)
    with pytest.raises(InvalidRequest):
        convert({"model": "m", "prompt": []}, CompletionRequest)


def test_deep_nesting_is_invalid_json_not_a_crash() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json(b"[" * 5000 + b"]" * 5000)
    assert info.value.code == "invalid_json"


def test_invalid_json_has_its_own_code() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_json(b'{"model": ')
    assert info.value.code == "invalid_json"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([*RANGES, "model", "messages", "prompt", "stop", "stream", "x"]), json_values, max_size=6))
def test_any_json_body_decodes_or_raises_invalid_request(body: dict[str, Any]) -> None:
    """Fuzzed bodies: the only failure a client can cause is a 400 InvalidRequest."""
    for contract in (ChatCompletionRequest, CompletionRequest):
        try:
            decoded = convert(body, contract)
        except InvalidRequest as exc:
            assert exc.status == 400
        else:
            assert isinstance(decoded, msgspec.Struct)


def test_openai_sampling_defaults_ask_for_nothing() -> None:
    """OpenAI's defaults for its sampling fields are neutral: with no plugin honouring
    them (nothing registered), they are not refused; any other value is."""
    from millm_core.contracts.completions import CompletionRequest
    from millm_core.fields import FieldPolicy

    policy = FieldPolicy()
    defaults = msgspec.convert({"model": "m", "prompt": "x", "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "stop": []}, CompletionRequest)
    assert policy.refusals(defaults, "completions", frozenset(), ("model", "prompt")) == []
    changed = msgspec.convert({"model": "m", "prompt": "x", "top_p": 0.9, "frequency_penalty": 0.5, "presence_penalty": -1, "stop": ["."]}, CompletionRequest)
    assert policy.refusals(changed, "completions", frozenset(), ("model", "prompt")) == ["top_p", "stop", "frequency_penalty", "presence_penalty"]
