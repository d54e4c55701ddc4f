"""The tool-call processor in the core's row driver, beside the sampling plugin's stop
sequences, on a character-level "tokenizer" (token id = code point): what streams as
content, what is held, what becomes ``tool_calls``, and when a reply stays content.

Each case writes the reply a model would write, token by token, so the expectations are
the OpenAI contract's, not the code's."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from millm_core.rows import RowDriver
from millm_plugins.sampling.processors import StopSequences
from millm_plugins.structured.errors import ConstrainedOutputInvalid
from millm_plugins.tools.formats import HERMES, LLAMA3, PYTHONIC, CallFormat
from millm_plugins.tools.processor import ToolCalls

EOS = 0
OFFERED = frozenset({"get_weather", "get_time"})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


def run(reply: str, *processors: object, eos: bool = True) -> tuple[list[str], str | None, dict | None]:
    """Feed ``reply`` one character per step; the text each step emitted, the finish
    reason and the message fields the row ended with."""
    driver = RowDriver(0, decode=decode, processors=list(processors), eos_token_ids=frozenset({EOS}), max_new_tokens=len(reply) + 1 if eos else len(reply))  # type: ignore[arg-type]
    emitted: list[str] = []
    for token in [ord(c) for c in reply] + ([EOS] if eos else []):
        event = driver.accept(token)
        emitted.append(event.text)
        if event.finish_reason:
            return emitted, event.finish_reason, event.fields
    raise AssertionError("the row did not end")


def calls(fmt: CallFormat = HERMES, **kwargs: object) -> ToolCalls:
    return ToolCalls(fmt, OFFERED, parallel=kwargs.pop("parallel", True), **kwargs)  # type: ignore[arg-type]


def test_content_before_a_call_streams_and_the_call_becomes_tool_calls() -> None:
    emitted, reason, fields = run("Let me check. " + CALL, calls())
    assert reason == "tool_calls"
    assert "".join(emitted) == "Let me check."  # the trailing space before the call is not content
    assert emitted.index("L") == 0  # content went out as it came, not at the end
    assert fields is not None
    (call,) = fields["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_parallel_calls_and_parallel_false() -> None:
    two = CALL + "\n" + CALL.replace("get_weather", "get_time").replace('"city": "Paris"', '"zone": "utc"')
    _, _, fields = run(two, calls())
    assert [c["function"]["name"] for c in fields["tool_calls"]] == ["get_weather", "get_time"]  # type: ignore[index]
    assert [c["index"] for c in fields["tool_calls"]] == [0, 1]  # type: ignore[index]
    _, reason, fields = run(two, calls(parallel=False))
    assert reason == "tool_calls" and [c["function"]["name"] for c in fields["tool_calls"]] == ["get_weather"]  # type: ignore[index]


@pytest.mark.parametrize(
    "reply",
    [
        CALL.replace("get_weather", "launch_rockets"),  # a function the request did not offer
        CALL.replace('"Paris"}', '"Paris"'),  # malformed JSON
        CALL[:-5],  # never closed
        CALL + " and then some words",  # text after the call
    ],
)
def test_a_reply_that_is_not_a_well_formed_offered_call_is_content(reply: str) -> None:
    emitted, reason, fields = run(reply, calls())
    assert reason == "stop" and fields is None
    assert "".join(emitted) == reply  # nothing lost, nothing added


def test_a_call_cut_by_the_budget_is_content_with_length() -> None:
    emitted, reason, fields = run(CALL[:30], calls(), eos=False)
    assert (reason, fields) == ("length", None) and "".join(emitted) == CALL[:30]


def test_stop_matches_in_content_but_never_inside_a_call() -> None:
    # "Paris" is a stop string: in the call's arguments it must not end the reply.
    emitted, reason, fields = run("Sure. " + CALL, calls(), StopSequences(("Paris",)))
    assert reason == "tool_calls" and json.loads(fields["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}  # type: ignore[index]
    emitted, reason, fields = run("Paris is sunny. " + CALL, calls(), StopSequences(("Paris",)))
    assert (reason, fields, "".join(emitted)) == ("stop", None, "")


def test_a_forced_opening_is_part_of_the_call_not_of_the_content() -> None:
    forced = HERMES.forced([{"type": "function", "function": {"name": "get_weather"}}], "get_weather")
    rest = '{"city": "Rome"}' + forced.suffix
    emitted, reason, fields = run(rest, calls(opening=forced.opening))
    assert "".join(emitted) == "" and reason == "tool_calls"
    assert json.loads(fields["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}  # type: ignore[index]
    # A forced call that does not parse is returned whole: the opening written for the
    # model, then what it wrote (the continuation alone was a headless fragment).
    emitted, reason, fields = run("oops", calls(opening=forced.opening))
    assert ("".join(emitted), reason, fields) == (forced.opening + "oops", "stop", None)


def test_forced_arguments_that_do_not_validate_fail_the_request() -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Rome"]}}}
    with pytest.raises(ConstrainedOutputInvalid):
        run(CALL, calls(schemas={"get_weather": schema}))


def test_special_token_markers_are_read_back() -> None:
    """A tokenizer that writes <|tool_call_start|> as one special token decodes it to ""; the
    processor maps its id back to the marker, so the call still parses."""
    start, end = 1, 2
    reply = [start, *map(ord, "[get_weather(city='Paris')]"), end]

    def skip_special(ids: Sequence[int]) -> str:  # this tokenizer's decode skips its special tokens
        return "".join(chr(i) for i in ids if i not in (EOS, start, end))

    processor = calls(PYTHONIC, markers={start: "<|tool_call_start|>", end: "<|tool_call_end|>"})
    driver = RowDriver(0, decode=skip_special, processors=[processor], eos_token_ids=frozenset({EOS}), max_new_tokens=99)  # type: ignore[list-item]
    for token in [*reply, EOS]:
        event = driver.accept(token)
    assert event.finish_reason == "tool_calls"
    assert json.loads(event.fields["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}  # type: ignore[index]


def test_llama3_whole_reply_calls_and_plain_replies() -> None:
    _, reason, fields = run('{"name": "get_time", "parameters": {"zone": "utc"}}', calls(LLAMA3))
    assert reason == "tool_calls" and fields["tool_calls"][0]["function"]["name"] == "get_time"  # type: ignore[index]
    emitted, reason, fields = run("It is noon.", calls(LLAMA3))
    assert ("".join(emitted), reason, fields) == ("It is noon.", "stop", None)
