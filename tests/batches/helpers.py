"""Helpers for the Batch API tests: JSONL files, uploads through the openai SDK, waiting
for a batch to finish, and reading its output files."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import openai
from openai.types import Batch

FINISHED = {"completed", "failed", "cancelled", "expired"}
# What two answers to the same request may differ in: minted per response.
MINTED = ("id", "created")


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="not-needed", max_retries=0)


def jsonl(lines: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def submit(client: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions", **extra: Any) -> Batch:
    uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **extra)  # type: ignore[arg-type]


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 180.0, until: set[str] = FINISHED) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout} s: {batch.request_counts}"
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for item in lines:
        assert item["custom_id"] not in found, f"{item['custom_id']} appears twice"
        found[item["custom_id"]] = item
    return found


def unminted(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in MINTED}
