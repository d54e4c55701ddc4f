"""millm as two Ray Serve replicas of the tiny model behind one HTTP route, on a local Ray
cluster started here, sharing one SQLite file (docs/scale-out.md).

- Requests spread over both replicas (each response names its replica in
  ``X-miLLM-Replica``) and answer as greedy HF ``generate`` does.
- A profile created through one replica steers a request served by the other, as the
  steered reference does.
- A batch accepted by any replica runs (the replica holding the data directory's lock
  drives it), and every replica answers the Batch API's reads.
- Killing the replica that runs the batches (its actor, mid-stream) cuts the streams it
  held and nothing else: the other replica's streams finish, new requests are served by
  it, and it takes the data directory's lock over and runs the next batch (Ray starts a
  replacement meanwhile; it is not waited for: a model load).

Ray is a dependency of these tests (``millm[ray]``): without it they fail, never skip.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from millm_core.config import load_settings
from millm_core.errors import ConfigError
from millm_core.plugins import PluginHost

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn when imported
    warnings.simplefilter("ignore", DeprecationWarning)
    import ray
    from ray import serve

    from millm_plugins.rayserve.deployment import APP_NAME, DEPLOYMENT, build_app

from ..http.helpers import chat_ids, hf_reference
from ..steering.test_inline import MESSAGES, parse
from ..steering.test_inline import hf_reference as steered_reference
from ..steering.test_profiles import FEATURES, features
from ..steering.test_sae_api import write_sae

REPLICA = "x-millm-replica"
SEEN_WITHIN_S = 5.0  # an operator write reaches the other replica's requests within REFRESH_S (0.1 s); two cores are shared
PROMPTS = ["Tell me about the sea.", "Name a colour.", "What is a river?", "Count to three."]


@dataclass
class Cluster:
    base_url: str
    root: pathlib.Path
    replicas: set[str] = field(default_factory=set)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scaleout")
    port = _free_port()
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        values = {"model": tiny_dir, "served_name": "tiny", "db": str(root / "millm.db"), "log_level": "warning", "threads": 1}
        settings = load_settings(values, environ={}, plugin_settings=PluginHost.declared_settings())
        serve.run(build_app(settings, num_replicas=2), name=APP_NAME, route_prefix="/")
        prefix = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#"
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        yield Cluster(f"http://127.0.0.1:{port}", root, {name.removeprefix(prefix) for name in actors})
    finally:
        serve.shutdown()
        ray.shutdown()


def test_replicas_on_an_in_memory_database_are_refused() -> None:
    settings = load_settings({"db": ":memory:"}, environ={}, plugin_settings=PluginHost.declared_settings())
    with pytest.raises(ConfigError, match="database of its own"):
        build_app(settings, num_replicas=2)
    build_app(settings, num_replicas=1)  # one replica shares with no one


def _chat(client: openai.OpenAI, prompt: str, **extra: Any) -> tuple[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0, **extra
    )
    return raw.headers[REPLICA], raw.parse()


def test_requests_spread_over_both_replicas_and_answer_as_the_reference(cluster: Cluster, tiny_engine: Any) -> None:
    client = cluster.client()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: (PROMPTS[i % 4], *_chat(client, PROMPTS[i % 4])), range(16)))
    served = {replica for _, replica, _ in answers}
    assert len(cluster.replicas) == 2 and served == cluster.replicas, (served, cluster.replicas)
    want = {p: hf_reference(tiny_engine, chat_ids(tiny_engine, [{"role": "user", "content": p}]), 8) for p in PROMPTS}
    for prompt, _, reply in answers:
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == want[prompt]


def _until_served_by(client: httpx.Client, other: str, body: dict[str, Any]) -> httpx.Response:
    """The first answer to ``body`` that the replica ``other`` served with a 200, within
    SEEN_WITHIN_S (the router picks replicas; the other replica sees the write once it has
    looked at the database)."""
    deadline = time.monotonic() + SEEN_WITHIN_S
    while True:
        with ThreadPoolExecutor(2) as pool:  # two at once: the router spreads them
            replies = list(pool.map(lambda _: client.post("/v1/chat/completions", json=body), range(2)))
        for resp in replies:
            if resp.headers[REPLICA] == other and resp.status_code == 200:
                return resp
        assert time.monotonic() < deadline, [(r.headers[REPLICA], r.status_code, r.text[:120]) for r in replies]
        time.sleep(0.1)


def test_a_profile_created_through_one_replica_steers_a_request_on_the_other(cluster: Cluster, tiny_engine: Any) -> None:
    sae = write_sae(cluster.root / "sae", tiny_engine.info.d_model, seed=5)
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        assert client.post("/api/saes", json={"path": sae, "id": "alpha"}).status_code == 201
        assert client.post("/api/saes/alpha/attach", json={"layer": 1}).status_code == 200
        created = client.post("/api/profiles", json={"name": "calm", "sae_id": "alpha", "layer": 1, "features": features(FEATURES)})
        assert created.status_code == 201, created.text
        writer = created.headers[REPLICA]
        [other] = cluster.replicas - {writer}
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "profile": "calm"}
        steered = _until_served_by(client, other, body)
    [(kind, params)] = parse(steered.headers["x-millm-steering"])
    assert (kind, params["source"], params["sae"]) == ("profile", "request", "alpha")
    assert steered.json()["choices"][0]["message"]["content"] == steered_reference(tiny_engine, sae, FEATURES)


BATCH_LINES = [
    {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 4, "temperature": 0}}
    for i, p in enumerate(PROMPTS)
]  # fmt: skip


def _create_batch(client: openai.OpenAI) -> tuple[str, str]:
    """(batch id, the replica that accepted it)."""
    content = "".join(json.dumps(line) + "\n" for line in BATCH_LINES).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    raw = client.batches.with_raw_response.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    return raw.parse().id, raw.headers[REPLICA]


def _completed(client: openai.OpenAI, batch_id: str, within_s: float = 30) -> set[str]:
    """Wait for the batch to complete; the replicas that answered its retrieves."""
    readers: set[str] = set()
    deadline = time.monotonic() + within_s
    while True:
        raw = client.batches.with_raw_response.retrieve(batch_id)
        readers.add(raw.headers[REPLICA])
        batch = raw.parse()
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            assert (batch.status, batch.request_counts.completed) == ("completed", len(BATCH_LINES)), batch
            return readers
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def _run_batch(client: openai.OpenAI) -> set[str]:
    """Create a batch and wait for it: the replicas that accepted and answered it."""
    batch_id, accepted = _create_batch(client)
    return {accepted} | _completed(client, batch_id)


def test_a_batch_accepted_by_any_replica_runs_and_every_replica_answers_reads(cluster: Cluster) -> None:
    client = cluster.client()
    created: dict[str, str] = {}  # batch id -> the replica that accepted it
    deadline = time.monotonic() + 30
    while set(created.values()) != cluster.replicas:  # until each replica has accepted one
        assert time.monotonic() < deadline, created
        batch_id, replica = _create_batch(client)
        created[batch_id] = replica
    for batch_id in created:
        _completed(client, batch_id)
    # Each finished batch reads the same through every replica, whichever accepted it. The
    # router picks a replica per request, so read until each replica has answered (a batch
    # that finishes before its first poll may otherwise have been read through one only).
    for batch_id, accepted in created.items():
        readers: set[str] = set()
        deadline = time.monotonic() + 30
        while readers != cluster.replicas:
            assert time.monotonic() < deadline, (batch_id, accepted, readers)
            raw = client.batches.with_raw_response.retrieve(batch_id)
            batch = raw.parse()
            assert (batch.status, batch.request_counts.completed) == ("completed", len(BATCH_LINES)), batch
            readers.add(raw.headers[REPLICA])


@dataclass
class Stream:
    started: threading.Event = field(default_factory=threading.Event)
    replica: str | None = None
    chunks: int = 0
    finish: str | None = None
    error: BaseException | None = None


LONG = [{"role": "user", "content": "What is a river?"}]  # greedy HF generate draws no EOS in its first 200 tokens


def _stream(client: openai.OpenAI, out: Stream) -> None:
    try:
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=LONG, max_tokens=200, temperature=0, stream=True)
        out.replica = raw.headers[REPLICA]
        for chunk in raw.parse():
            if chunk.choices:
                out.chunks += 1
                out.started.set()
                out.finish = chunk.choices[0].finish_reason or out.finish
    except BaseException as exc:  # noqa: BLE001 - what a cut stream raises is the point
        out.error = exc
    finally:
        out.started.set()


def _replica(replica: str) -> Any:
    return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT}#{replica}", namespace="serve")


def _pid(replica: str) -> int:
    return int(ray.get(_replica(replica).__ray_call__.remote(lambda _: os.getpid())))


def _lock_holders(cluster: Cluster) -> set[int]:
    """The processes holding an flock on the batches data directory's ``.lock`` (/proc/locks)."""
    lock = os.stat(cluster.root / "millm-files" / ".lock")
    device = f"{os.major(lock.st_dev):02x}:{os.minor(lock.st_dev):02x}:{lock.st_ino}"
    with open("/proc/locks") as table:
        rows = [line.split() for line in table if "->" not in line]
    return {int(row[4]) for row in rows if row[1] == "FLOCK" and row[5] == device}


def test_killing_a_replica_mid_stream_loses_only_the_requests_it_held(cluster: Cluster, tiny_engine: Any) -> None:
    client = cluster.client()
    assert hf_reference(tiny_engine, chat_ids(tiny_engine, LONG), 200)[1] == "length"  # every stream runs its 200 tokens
    streams = [Stream() for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(client, s), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    for s in streams:
        assert s.started.wait(30)
    assert [s.error for s in streams] == [None] * len(streams)
    held = {s.replica for s in streams}
    assert held == cluster.replicas, held  # both replicas hold streams when one dies
    pids = {replica: _pid(replica) for replica in held}
    [victim] = [replica for replica, pid in pids.items() if {pid} == _lock_holders(cluster)]  # the one running batches
    [survivor] = held - {victim}
    cut = [s for s in streams if s.replica == victim and s.finish is None]  # open when it dies
    assert cut
    ray.kill(_replica(victim))
    after = [(p, *_chat(client, p)) for p in PROMPTS + PROMPTS]  # sent after the kill, one at a time
    for thread in threads:
        thread.join(60)
    for s in streams:
        if s in cut:  # an error, or an end without a finish reason
            assert s.error is not None or s.finish is None, (s.chunks, s.finish)
        else:
            assert (s.error, s.finish) == (None, "length")
    assert {replica for _, replica, _ in after} == {survivor}
    want = {p: hf_reference(tiny_engine, chat_ids(tiny_engine, [{"role": "user", "content": p}]), 8) for p in PROMPTS}
    for prompt, _, reply in after:
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == want[prompt]
    # The survivor takes the data directory's lock over (within ADOPT_S) and runs the batches.
    deadline = time.monotonic() + 10
    while _lock_holders(cluster) != {pids[survivor]}:
        assert time.monotonic() < deadline, (_lock_holders(cluster), pids)
        time.sleep(0.2)
    assert survivor in _run_batch(client)  # accepted or answered by it; run by it, the lock holder
