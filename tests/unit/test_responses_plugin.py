"""The ``responses`` plugin's parts without a server: sealing (the key id, why a blob does
not open), the stored table's two bounds, the translation's stored history and reports,
and that a streamed response ends with exactly the items, statuses and top-level keys of
the non-streamed one for the same chat reply (including replies the tiny model cannot be
made to write: reasoning after the text, a cut after function calls)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from millm_core.api import InvalidRequest, Store, event_stream
from millm_plugins.responses.events import ResponseStream
from millm_plugins.responses.objects import COLLIDED, ResponseObject, with_extensions
from millm_plugins.responses.output import from_completion, function_call, started
from millm_plugins.responses.routes import ResponsesState, _frames
from millm_plugins.responses.sealing import Sealer, SealError
from millm_plugins.responses.storage import ResponseStore
from millm_plugins.responses.translate import Translation, translate

from ..http.helpers import open_reasoning, seal_reasoning

KEY = bytes(range(32))
OTHER = bytes(32)


# ------------------------------------------------------------------ sealing


def test_a_blob_names_its_key_and_says_why_it_does_not_open() -> None:
    sealer = Sealer(KEY)
    blob = sealer.seal("the reasoning")
    assert open_reasoning(blob, KEY) == "the reasoning"  # the documented format
    assert sealer.open(seal_reasoning("written elsewhere", KEY)) == "written elsewhere"
    reasons = {}
    for name, bad in {
        "other_key": Sealer(OTHER).seal("the reasoning"),
        "altered": blob[:-6] + ("A" if blob[-6] != "A" else "B") + blob[-5:],
        "malformed": "not a blob",
    }.items():
        with pytest.raises(SealError) as refused:
            sealer.open(bad)
        reasons[name] = refused.value.reason
    assert reasons == {"other_key": "other_key", "altered": "altered", "malformed": "malformed"}


# ------------------------------------------------------------------ the stored table


def _response(number: int, padding: int = 0) -> dict[str, Any]:
    return {"id": f"resp_{number}", "created_at": number, "output": [], "pad": "x" * padding}


def test_the_store_keeps_at_most_its_rows_and_its_bytes() -> None:
    rows = ResponseStore(Store(":memory:"), limit=2, max_bytes=10**9)
    assert all(rows.put(_response(n), []) for n in range(4))
    assert [rows.get(f"resp_{n}") is not None for n in range(4)] == [False, False, True, True] and rows.count() == 2

    one = len(json.dumps(_response(0, 1000), separators=(",", ":"))) + len("[]")
    sized = ResponseStore(Store(":memory:"), limit=100, max_bytes=2 * one + 10)
    assert all(sized.put(_response(n, 1000), []) for n in range(3))
    assert [sized.get(f"resp_{n}") is not None for n in range(3)] == [False, True, True]
    assert sized.size() == 2 * one
    assert sized.put(_response(9, 5000), []) is False  # larger than the bound alone: not kept
    assert sized.get("resp_9") is None and sized.count() == 2
    assert sized.delete("resp_1") and sized.size() == one

    assert not ResponseStore(Store(":memory:"), limit=0, max_bytes=100).enabled
    assert ResponseStore(Store(":memory:"), limit=5, max_bytes=0).put(_response(1), []) is False


# ------------------------------------------------------------------ translation


def _reasoning(**fields: Any) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], **fields}


def test_a_stored_conversation_renders_its_plain_text_and_reports_nothing() -> None:
    history = [
        {"type": "message", "role": "user", "content": "Hi"},
        # Stored output: the blob was sealed under a key the server no longer holds.
        _reasoning(content=[{"type": "reasoning_text", "text": "think"}], encrypted_content=Sealer(OTHER).seal("think"), summary=[{"type": "summary_text", "text": "s"}]),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
    ]
    translation = translate({"model": "m", "input": "More"}, history, Sealer(KEY))
    assert translation.chat["messages"][1] == {"role": "assistant", "reasoning_content": "think", "content": "Hello"}
    assert translation.reported == []
    assert translation.unreported("messages[1].reasoning_content") and not translation.unreported("messages[2].content")


def test_input_may_be_left_out_of_a_follow_up() -> None:
    history = [{"type": "message", "role": "user", "content": "Hi"}]
    translation = translate({"model": "m", "instructions": "Be brief."}, history, None)
    assert translation.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert translation.history == history


def test_a_bad_stored_item_is_a_400_naming_previous_response_id() -> None:
    with pytest.raises(InvalidRequest) as refused:
        translate({"model": "m", "input": "x"}, [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}], None)
    assert refused.value.param == "previous_response_id"
    assert function_call({"type": "function", "function": {"name": "f", "arguments": "{}"}}, "completed").call_id.startswith("call_")


def test_a_summary_beside_the_reasoning_is_reported_and_a_sealed_item_is_kept_in_plain_text() -> None:
    sealer = Sealer(KEY)
    items = [
        {"role": "user", "content": "Hi"},
        _reasoning(encrypted_content=sealer.seal("sealed thought"), summary=[{"type": "summary_text", "text": "short"}]),
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    translation = translate({"model": "m", "input": items}, [], sealer)
    assert translation.reported == ["input[1].summary"]
    assert translation.chat["messages"][1]["reasoning_content"] == "sealed thought"
    kept = translation.history[1]
    assert "encrypted_content" not in kept and kept["content"] == [{"type": "reasoning_text", "text": "sealed thought"}]
    with pytest.raises(InvalidRequest) as refused:
        translate({"model": "m", "input": [_reasoning(encrypted_content=Sealer(OTHER).seal("x"))]}, [], sealer)
    assert refused.value.param == "input[0].encrypted_content" and "another key" in refused.value.message


# ------------------------------------------------------------------ streamed = non-streamed


def _translation(**body: Any) -> Translation:
    return translate({"model": "m", "input": "Hi", **body}, [], None)


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **choice: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}]}


def _streamed(translation: Translation, chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    stream = ResponseStream(translation, started(translation, "m"), None)
    events = stream.start()
    for chunk in chunks:
        events += stream.feed(chunk)
    events += stream.end()
    assert stream.final is not None
    return stream.final, events


def _shape(response: dict[str, Any]) -> dict[str, Any]:
    """A response without its ids and times."""
    items = [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]
    return {**{k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}, "output": items}


def _call(name: str) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": "{}"}}


USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
REPLIES: list[tuple[str, list[dict[str, Any]], dict[str, Any], str]] = [
    (
        "reasoning after the text",
        [_chunk({"reasoning_content": "a"}), _chunk({"content": "b"}), _chunk({"reasoning_content": "c"}), _chunk(finish="stop")],
        {"reasoning_content": "ac", "content": "b"},
        "stop",
    ),
    ("reasoning cut by the budget", [_chunk({"reasoning_content": "a"}), _chunk(finish="length")], {"reasoning_content": "a", "content": None}, "length"),
    ("reasoning only, completed", [_chunk({"reasoning_content": "a"}), _chunk(finish="stop")], {"reasoning_content": "a", "content": None}, "stop"),
    (
        "cut after function calls",
        [_chunk({"content": "x"}), _chunk({"tool_calls": [_call("f"), _call("g")]}), _chunk(finish="length")],
        {"content": "x", "tool_calls": [_call("f"), _call("g")]},
        "length",
    ),
    ("nothing, cut", [_chunk(finish="length")], {"content": None}, "length"),
    ("text cut", [_chunk({"content": "x"}), _chunk({"content": "y"}, finish="length")], {"content": "xy"}, "length"),
]


@pytest.mark.parametrize(("case", "chunks", "message", "finish"), REPLIES, ids=[r[0] for r in REPLIES])
def test_a_streamed_response_ends_as_the_non_streamed_one(case: str, chunks: list[dict[str, Any]], message: dict[str, Any], finish: str) -> None:
    translation = _translation()
    extra = {"thinking_budget_forced_at": 2, "a_plugins_key": [1]}
    chunks = [*chunks[:-1], {**chunks[-1], "choices": [{**chunks[-1]["choices"][0], **extra}], "usage": USAGE}, {"choices": [], "millm_steering": {"x": 1}}]
    streamed, events = _streamed(translation, chunks)
    completion = {"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **extra}], "usage": USAGE, "millm_steering": {"x": 1}}
    whole = from_completion(translation, completion, None)
    assert _shape(streamed) == _shape(whole)
    assert whole["thinking_budget_forced_at"] == 2 and whole["a_plugins_key"] == [1]
    # Every item's last done event says what the final response says about it.
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    final = streamed["output"]
    assert sorted(done) == list(range(len(final)))
    assert [done[i]["status"] for i in range(len(final))] == [item["status"] for item in final]


def test_an_extension_named_like_a_response_field_is_kept_apart() -> None:
    response = ResponseObject(id="resp_1", created_at=1, status="completed", model="m")
    data = with_extensions(response, {"status": "shadow", "metadata": {"k": 1}, "mine": 2})
    assert data["status"] == "completed" and data["metadata"] == {} and data["mine"] == 2
    assert data[COLLIDED] == {"status": "shadow", "metadata": {"k": 1}}


# ------------------------------------------------------------------ the route's stream


class _CutReply:
    """A dispatched chat stream that ends without ``[DONE]``."""

    request_id = "req_test"
    finished = False

    async def __aenter__(self) -> _CutReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def events(self) -> Any:
        yield _chunk({"content": "partial"})


def test_a_chat_stream_cut_short_ends_with_response_failed() -> None:
    translation = _translation(store=False)
    stream = ResponseStream(translation, started(translation, "m"), None)
    state = ResponsesState(store=ResponseStore(Store(":memory:"), 10, 10**6), sealer=Sealer(KEY))

    async def run() -> list[bytes]:
        return [frame async for frame in _frames(_CutReply(), stream, translation, state)]  # type: ignore[arg-type]

    events = [json.loads(frame.split(b"\ndata: ", 1)[1]) for frame in asyncio.run(run())]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert events[-2]["code"] == "internal_error"


def test_an_event_stream_whose_client_left_before_its_first_frame_is_closed() -> None:
    started_body, closed = [], []

    async def frames() -> Any:
        started_body.append(True)
        yield b"data: x\n\n"

    async def on_close() -> None:
        closed.append(True)

    async def run() -> None:
        response = event_stream(frames(), on_close=on_close)

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}  # gone before anything was sent

        async def send(message: dict[str, Any]) -> None:
            await asyncio.sleep(0.01)

        await response({"type": "http", "asgi": {"spec_version": "2.1"}}, receive, send)  # type: ignore[arg-type]

    asyncio.run(run())
    assert started_body == [] and closed == [True]
