"""The Batch API against a real server, driven by the openai SDK: a batch's output lines
are the answers the same requests get live (body and ``X-miLLM-*`` headers), on chat,
completions and embeddings; bad input lines fail the batch by line number, bad bodies go
to the error file; limits, cancel, pagination and file deletion."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch, FileObject

from ..batches.helpers import Slow, by_custom_id, jsonl, line, read_lines, sdk, submit, unminted, wait

CHAT = "/v1/chat/completions"
PROMPTS = ["Tell me about the sea", "Name a colour", "Count to three", "What is a tree?", "Say hello", "Describe rain"]


def _live(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    resp = httpx.post(base_url + path, json=body, timeout=120)
    return resp


def _millm_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("x-millm-")}


def test_a_chat_batch_answers_what_the_same_requests_get_live(server: Any) -> None:
    client = sdk(server.base_url)
    bodies = {
        f"req-{i}": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0, **extra}
        for i, (p, extra) in enumerate(
            zip(PROMPTS, [{}, {"seed": 7}, {"user": "me"}, {"n": 2}, {"stop": ["e"]}, {"max_tokens": 3}], strict=True)
        )
    }
    batch = submit(client, jsonl(line(cid, body) for cid, body in bodies.items()), metadata={"run": "one"})
    assert batch.status == "validating" and batch.metadata == {"run": "one"}
    done = wait(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        6,
        6,
        0,
    )
    assert done.error_file_id is None and done.output_file_id is not None and done.model == "tiny"
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at  # type: ignore[operator]
    output = by_custom_id(read_lines(client, done.output_file_id))
    assert sorted(output) == sorted(bodies)
    prompt_tokens = completion_tokens = 0
    for cid, body in bodies.items():
        live = _live(server.base_url, CHAT, {**body, "class": "agent"})  # batch lines run in the agent lane
        assert live.status_code == 200, live.text
        item = output[cid]
        assert item["error"] is None and item["id"].startswith("batch_req_")
        response = item["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert unminted(response["body"]) == unminted(live.json())
        assert response["millm"]["headers"] == _millm_headers(live)
        assert response["millm"]["headers"]["x-millm-lane"] == "agent"
        prompt_tokens += live.json()["usage"]["prompt_tokens"]
        completion_tokens += live.json()["usage"]["completion_tokens"]
    assert "x-millm-seed" in output["req-1"]["response"]["millm"]["headers"]
    assert output["req-2"]["response"]["millm"]["headers"]["x-millm-ignored-fields"] == '"user"'
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == (prompt_tokens, completion_tokens)
    assert done.usage.total_tokens == prompt_tokens + completion_tokens


@pytest.mark.parametrize(
    ("endpoint", "bodies"),
    [
        ("/v1/completions", {"c-0": {"model": "tiny", "prompt": "The sea is", "max_tokens": 6, "temperature": 0},
                             "c-1": {"model": "tiny", "prompt": ["One", "Two"], "max_tokens": 4, "temperature": 0, "seed": 3}}),
        ("/v1/embeddings", {"e-0": {"model": "tiny", "input": "a sentence"},
                            "e-1": {"model": "tiny", "input": ["one", "two words"], "pooling": "last", "normalize": True}}),
    ],
)  # fmt: skip
def test_completions_and_embeddings_batches_answer_as_live(server: Any, endpoint: str, bodies: dict[str, dict[str, Any]]) -> None:
    client = sdk(server.base_url)
    done = wait(client, submit(client, jsonl(line(cid, body, endpoint) for cid, body in bodies.items()), endpoint=endpoint).id)
    assert done.status == "completed", done
    output = by_custom_id(read_lines(client, done.output_file_id))
    lane = {"class": "agent"} if endpoint != "/v1/embeddings" else {}  # embeddings have no lane
    for cid, body in bodies.items():
        live = _live(server.base_url, endpoint, {**body, **lane})
        assert live.status_code == 200, live.text
        assert unminted(output[cid]["response"]["body"]) == unminted(live.json())
        assert output[cid]["response"]["millm"]["headers"] == _millm_headers(live)
    assert done.usage is not None and done.usage.input_tokens == sum(
        _live(server.base_url, endpoint, b).json()["usage"]["prompt_tokens"] for b in bodies.values()
    )


def test_bad_lines_fail_the_batch_naming_each_line(server: Any) -> None:
    client = sdk(server.base_url)
    good = line("ok", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    text = "\n".join(
        [
            json.dumps(good),  # 1
            "{not json",  # 2
            "[1, 2]",  # 3
            json.dumps({k: v for k, v in good.items() if k != "custom_id"}),  # 4
            json.dumps(good),  # 5: the custom_id of line 1
            "",  # 6: blank lines are skipped, and counted
            json.dumps({**good, "custom_id": "m", "method": "GET"}),  # 7
            json.dumps({**good, "custom_id": "u", "url": "/v1/completions"}),  # 8
            json.dumps({**good, "custom_id": "b", "body": "text"}),  # 9
            json.dumps({**good, "custom_id": "x", "extra": 1}),  # 10
            json.dumps({**good, "custom_id": ""}),  # 11
            '{"custom_id": "deep", "body": ' + "[" * 5000 + "]" * 5000 + "}",  # 12: nested past the recursion limit
        ]
    )
    done = wait(client, submit(client, text.encode()).id)
    assert done.status == "failed" and done.failed_at is not None and done.in_progress_at is None
    assert done.errors is not None and done.errors.data is not None
    found = [(e.line, e.code, e.param) for e in done.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "invalid_json_line", None),
        (4, "missing_required_parameter", "custom_id"),
        (5, "duplicate_custom_id", "custom_id"),
        (7, "invalid_method", "method"),
        (8, "invalid_url", "url"),
        (9, "invalid_body", "body"),
        (10, "unknown_parameter", "extra"),
        (11, "invalid_custom_id", "custom_id"),
        (12, "invalid_json_line", None),
    ]
    assert "line 1" in done.errors.data[3].message  # the duplicate names the first
    assert done.request_counts is not None and done.request_counts.total == 0
    assert done.output_file_id is None and done.error_file_id is None
    empty = wait(client, submit(client, b"\n\n").id)
    assert empty.status == "failed" and empty.errors is not None and [e.code for e in empty.errors.data or []] == ["empty_file"]


def test_what_a_body_asks_for_is_checked_when_its_line_runs(server: Any) -> None:
    client = sdk(server.base_url)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    bodies = {
        "fine": ask,
        "no-model": {**ask, "model": "nope"},
        "hot": {**ask, "temperature": 9},
        "honoured-nowhere": {**ask, "response_format": {"type": "json_object"}, "stop": ["x"]},
    }
    lines = [line(cid, body) for cid, body in bodies.items()] + [line("streamed", {**ask, "stream": True})]
    done = wait(client, submit(client, jsonl(lines)).id)
    assert done.status == "completed"
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        5,
        1,
        4,
    )
    errors = by_custom_id(read_lines(client, done.error_file_id))
    assert sorted(errors) == ["honoured-nowhere", "hot", "no-model", "streamed"]
    assert list(by_custom_id(read_lines(client, done.output_file_id))) == ["fine"]
    for cid in ("no-model", "hot", "honoured-nowhere"):
        live = _live(server.base_url, CHAT, {**bodies[cid], "class": "agent"})
        assert live.status_code >= 400
        assert errors[cid]["response"]["status_code"] == live.status_code
        assert errors[cid]["response"]["body"] == live.json()  # the endpoint's own error, as live
    assert errors["streamed"]["response"]["status_code"] == 400 and errors["streamed"]["response"]["body"]["error"]["param"] == "stream"


def test_objects_have_openais_shapes(server: Any) -> None:
    client = sdk(server.base_url)
    batch = wait(
        client,
        submit(
            client, jsonl([line("a", {"model": "tiny", "prompt": "x", "max_tokens": 1}, "/v1/completions")]), endpoint="/v1/completions"
        ).id,
    )
    raw_batch = httpx.get(f"{server.base_url}/v1/batches/{batch.id}").json()
    assert set(raw_batch) == set(Batch.model_fields) and raw_batch["object"] == "batch"
    assert raw_batch["expires_at"] == raw_batch["created_at"] + 24 * 3600
    raw_file = httpx.get(f"{server.base_url}/v1/files/{batch.output_file_id}").json()
    assert set(raw_file) == set(FileObject.model_fields) and raw_file["purpose"] == "batch_output"
    assert raw_file["filename"] == f"{batch.id}_output.jsonl"
    assert raw_file["bytes"] == len(client.files.content(batch.output_file_id).content)


def test_create_refusals_name_the_field(server: Any) -> None:
    client = sdk(server.base_url)
    file_id = client.files.create(file=("in.jsonl", jsonl([line("a", {"model": "tiny", "prompt": "x"})])), purpose="batch").id
    base = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    cases = [
        ({**base, "input_file_id": "file-nope"}, 404, "input_file_id"),
        ({**base, "endpoint": "/v1/responses"}, 400, "endpoint"),
        ({**base, "completion_window": "1h"}, 400, "completion_window"),
        ({**base, "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({**base, "metadata": {"k": "v" * 513}}, 400, "metadata[...]"),  # msgspec names a mapping value so
        ({**base, "surprise": 1}, 400, "surprise"),
        ({**base, "output_expires_after": {"anchor": "created_at", "seconds": 3600}}, 400, "output_expires_after"),
        ({k: v for k, v in base.items() if k != "endpoint"}, 400, None),
    ]
    for body, status, param in cases:
        resp = httpx.post(server.base_url + "/v1/batches", json=body)
        assert resp.status_code == status, (body, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        if param is not None:
            assert resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"  # type: ignore[index]
    as_json = httpx.post(server.base_url + "/v1/files", json={"purpose": "batch"})
    assert as_json.status_code == 400
    expiring = httpx.post(
        server.base_url + "/v1/files", data={"purpose": "batch", "expires_after[anchor]": "created_at"}, files={"file": ("a.jsonl", b"{}")}
    )
    assert expiring.status_code == 400 and expiring.json()["error"]["param"] == "expires_after"


def _multipart(content: bytes) -> tuple[bytes, str]:
    boundary = "millmtestboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def test_upload_limits_are_refused_by_name(make_server: Any) -> None:
    with make_server(batch_max_file_bytes=2048, batch_max_lines=3) as srv:
        client = sdk(srv.base_url)
        small = jsonl(line(f"r{i}", {"model": "tiny", "prompt": "x"}) for i in range(3))
        assert client.files.create(file=("ok.jsonl", small), purpose="batch").bytes == len(small)
        with pytest.raises(openai.BadRequestError) as many:
            client.files.create(file=("many.jsonl", small + small[:10]), purpose="batch")
        assert many.value.body["code"] == "too_many_lines" and many.value.body["param"] == "file"  # type: ignore[index]
        assert "--batch-max-lines" in many.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.APIStatusError) as large:
            client.files.create(file=("large.jsonl", b"x" * 3000), purpose="batch")
        assert large.value.status_code == 413 and large.value.body["code"] == "file_too_large"  # type: ignore[index]
        # A body of no declared length is refused while it arrives.
        body, media = _multipart(b"y" * 200_000)
        chunked = httpx.post(
            srv.base_url + "/v1/files",
            content=iter([body[i : i + 4096] for i in range(0, len(body), 4096)]),
            headers={"Content-Type": media},
        )
        assert chunked.status_code == 413 and chunked.json()["error"]["param"] == "file"
        # Just under the limit (the multipart framing is not counted): accepted.
        body, media = _multipart(b"z" * 2048)
        assert httpx.post(srv.base_url + "/v1/files", content=body, headers={"Content-Type": media}).status_code == 200
        assert [f.filename for f in client.files.list()] == ["in.jsonl", "ok.jsonl"]  # nothing refused was kept


def test_stored_files_have_a_total_limit(make_server: Any) -> None:
    """Every stored file counts (uploads and results): an upload that would pass
    --batch-max-storage-bytes is refused and not kept; deleting files makes room. A batch's
    results are always stored (they may pass the limit: a batch never fails for them)."""
    limit = 4000
    with make_server(batch_max_storage_bytes=limit) as srv:
        client = sdk(srv.base_url)
        ask = jsonl([line("a", {"model": "tiny", "prompt": "x", "max_tokens": 2}, url="/v1/completions")])
        first = client.files.create(file=("one.jsonl", ask * 10), purpose="batch")
        second = client.files.create(file=("two.jsonl", ask), purpose="batch")
        done = wait(client, client.batches.create(input_file_id=second.id, endpoint="/v1/completions", completion_window="24h").id)
        assert done.status == "completed" and done.output_file_id
        used = sum(f.bytes for f in client.files.list())
        assert used > first.bytes + second.bytes  # the results count
        room = limit - used
        with pytest.raises(openai.APIStatusError) as full:
            client.files.create(file=("too-big.jsonl", b"x" * (room + 1)), purpose="batch")
        error = full.value.body
        assert (full.value.status_code, error["code"], error["param"]) == (413, "storage_limit_exceeded", "file")  # type: ignore[index]
        assert "--batch-max-storage-bytes" in error["message"]  # type: ignore[index]
        assert len(client.files.list().data) == 3  # the refused upload was not kept
        assert client.files.create(file=("fits.jsonl", b"{}" + b" " * (room - 3) + b"\n"), purpose="batch").bytes == room
        # Full: any upload is refused, and no batch starts (it would write result files).
        body, media = _multipart(b"{}\n")
        assert httpx.post(srv.base_url + "/v1/files", content=body, headers={"Content-Type": media}).json()["error"]["code"] == "storage_limit_exceeded"
        with pytest.raises(openai.APIStatusError) as no_batch:
            client.batches.create(input_file_id=second.id, endpoint="/v1/completions", completion_window="24h")
        assert (no_batch.value.status_code, no_batch.value.body["code"], no_batch.value.body["param"]) == (413, "storage_limit_exceeded", "input_file_id")  # type: ignore[index]
        # Deleting a file makes room again.
        client.files.delete(first.id)
        assert client.files.create(file=("again.jsonl", b"{}\n"), purpose="batch").bytes == 3


def test_a_line_longer_than_a_request_body_fails_the_batch(make_server: Any) -> None:
    """A line is one request: past ``--max-body-bytes`` it is refused by line number, as
    the same body sent live is (413), before any line runs."""
    with make_server(max_body_bytes=4096) as srv:
        client = sdk(srv.base_url)
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        big = {**ask, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert _live(srv.base_url, CHAT, big).status_code == 413
        done = wait(client, submit(client, jsonl([line("a", ask), line("big", big), line("b", ask)])).id)
        assert done.status == "failed" and done.errors is not None and done.errors.data is not None
        assert [(e.line, e.code) for e in done.errors.data] == [(2, "line_too_long")]
        assert "--max-body-bytes" in (done.errors.data[0].message or "")
        assert done.request_counts is not None and done.request_counts.total == 0


def test_cancel_stops_a_running_batch_with_partial_output(make_server: Any) -> None:
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings(environ={}))
    host.register(Slow("Story", 0.03), "test-batches-slow")  # ~1.5 s a line: still running when cancelled
    with make_server(host=host, batch_concurrency=1) as srv:
        client = sdk(srv.base_url)
        lines = [
            line(f"r{i:02d}", {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": 48, "temperature": 0}, "/v1/completions")
            for i in range(40)
        ]
        batch = submit(client, jsonl(lines), endpoint="/v1/completions")
        running = wait(client, batch.id, until={"in_progress"})
        deadline = time.monotonic() + 120
        while (counts := client.batches.retrieve(batch.id).request_counts) is not None and counts.completed < 2:
            assert time.monotonic() < deadline, "no line finished"
            time.sleep(0.02)
        live = _live(srv.base_url, "/v1/completions", {"model": "tiny", "prompt": "Live:", "max_tokens": 4, "temperature": 0})
        assert live.status_code == 200 and live.headers["x-millm-lane"] == "interactive"
        assert client.batches.retrieve(batch.id).status == "in_progress"  # served while the batch runs
        with pytest.raises(openai.ConflictError) as in_use:
            client.files.delete(running.input_file_id)
        assert in_use.value.body["code"] == "file_in_use"  # type: ignore[index]
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        done = wait(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None and done.completed_at is None
        assert done.request_counts is not None and 2 <= done.request_counts.completed < 40 and done.request_counts.failed == 0
        output = by_custom_id(read_lines(client, done.output_file_id))
        assert len(output) == done.request_counts.completed and set(output) <= {item["custom_id"] for item in lines}
        assert done.error_file_id is None
        assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is
        assert client.files.delete(done.input_file_id).deleted  # finished: its input may go
        with pytest.raises(openai.NotFoundError):
            client.files.content(done.input_file_id)
        finished = wait(client, submit(client, jsonl(lines[:1]), endpoint="/v1/completions").id)
        with pytest.raises(openai.ConflictError) as late:
            client.batches.cancel(finished.id)
        assert late.value.body["code"] == "batch_not_cancellable"  # type: ignore[index]


def test_batches_and_files_page_as_openai_does(make_server: Any) -> None:
    with make_server() as srv:
        client = sdk(srv.base_url)
        ids = [submit(client, b"\n").id for _ in range(5)]  # empty files: failed at once
        for batch_id in ids:
            wait(client, batch_id)
        newest_first = list(reversed(ids))
        first = client.batches.list(limit=2)
        assert [b.id for b in first.data] == newest_first[:2] and first.has_more
        assert [b.id for b in client.batches.list(limit=2, after=first.data[-1].id).data] == newest_first[2:4]
        assert [b.id for b in client.batches.list(limit=1)] == newest_first  # the SDK's auto-paging follows after
        raw = httpx.get(srv.base_url + "/v1/batches", params={"limit": 5}).json()
        assert raw["object"] == "list" and raw["has_more"] is False and raw["first_id"] == ids[-1] and raw["last_id"] == ids[0]
        for params, param in [
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"after": "batch_nope"}, "after"),
            ({"order": "asc"}, "order"),
        ]:
            resp = httpx.get(srv.base_url + "/v1/batches", params=params)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param
        files = [f.id for f in client.files.list(purpose="batch")]
        assert len(files) == 5
        assert [f.id for f in client.files.list(purpose="batch", order="asc", limit=2)] == list(reversed(files))
        assert client.files.retrieve(files[0]).bytes == 1
        assert client.files.delete(files[0]).deleted and files[0] not in [f.id for f in client.files.list()]
        with pytest.raises(openai.NotFoundError):
            client.files.delete(files[0])


def test_without_the_lanes_plugin_lines_run_as_sent(make_server: Any) -> None:
    from millm_core.config import load_settings
    from millm_core.server.app import build_host

    host = build_host(load_settings({"block_plugins": ("lanes",)}, environ={}))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 6, "temperature": 0}
    with make_server(host=host) as srv:
        client = sdk(srv.base_url)
        done = wait(client, submit(client, jsonl([line("a", body)])).id)
        live = _live(srv.base_url, CHAT, body)
        response = by_custom_id(read_lines(client, done.output_file_id))["a"]["response"]
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 1
    assert "x-millm-lane" not in response["millm"]["headers"] and "x-millm-ignored-fields" not in response["millm"]["headers"]
    assert unminted(response["body"]) == unminted(live.json()) and response["millm"]["headers"] == _millm_headers(live)


def test_the_batch_usage_counts_the_prompt_tokens_its_lines_resumed(server: Any) -> None:
    """Lines sharing a long prompt prefix resume it from the prefix cache; the batch's
    ``input_tokens_details.cached_tokens`` adds up what each line's own usage reports."""
    client = sdk(server.base_url)
    shared = "the cat sat on the mat and looked at the sea " * 14  # past the cache's first 128-token block
    bodies = {f"c-{i}": {"model": "tiny", "messages": [{"role": "user", "content": shared + str(i)}], "max_tokens": 2, "temperature": 0} for i in range(3)}
    done = wait(client, submit(client, jsonl(line(cid, body) for cid, body in bodies.items())).id)
    assert done.status == "completed" and done.output_file_id is not None and done.error_file_id is None, done
    output = by_custom_id(read_lines(client, done.output_file_id))
    cached = [output[cid]["response"]["body"]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for cid in bodies]
    assert sum(cached) > 0, cached
    assert done.usage is not None and done.usage.input_tokens_details.cached_tokens == sum(cached)
