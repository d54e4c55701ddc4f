"""Two real millm servers sharing one PostgreSQL database (``--db postgresql://…``), as
replicas on several machines would: what an operator writes through one is what requests
on the other run with, and what its routes list.

The steering tests are the shared-SQLite-file ones (tests/steering/test_shared_db.py), run
here over PostgreSQL; circuits, probes and batches are checked the same way."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..batches.helpers import jsonl, line, read_lines, sdk, submit
from ..circuits.conftest import imported, setup_saes
from ..circuits.helpers import chat as circuit_chat
from ..circuits.helpers import document, members
from ..circuits.helpers import write_sae as circuit_sae
from ..probes.helpers import Fitted, import_probe
from ..steering import test_shared_db as shared
from ..steering.test_sae_api import write_sae

SEEN_WITHIN_S = 10.0


def on(make_server: Any, pg_url: str, files: pathlib.Path, **overrides: Any) -> Any:
    """A server on the database ``pg_url``. The batch data directory is always named: its
    default (``<db>-files``) is made from a file path, not a URL."""
    return make_server(db=pg_url, batch_data_dir=str(files), **overrides)


@pytest.fixture(scope="module")
def saes(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("pg-saes")
    return {name: write_sae(folder / name, tiny_engine.info.d_model, seed=len(name)) for name in ("alpha", "beta")}


@pytest.fixture
def pair(make_server: Any, saes: dict[str, str], pg_url: str, tmp_path: pathlib.Path) -> Iterator[tuple[Any, Any]]:
    """Two servers on one PostgreSQL database, both SAEs registered (through the first)."""
    with on(make_server, pg_url, tmp_path / "files") as a, on(make_server, pg_url, tmp_path / "files") as b:
        for name, path in saes.items():
            shared.ok(httpx.post(a.base_url + "/api/saes", json={"path": path, "id": name}), 201)
        yield a, b


# The shared-database steering tests, on PostgreSQL (their ``pair`` is the one above).
test_a_write_on_one_server_is_seen_by_the_other = shared.test_a_write_on_one_server_is_seen_by_the_other
test_profiles_written_on_one_server_serve_requests_on_the_other = shared.test_profiles_written_on_one_server_serve_requests_on_the_other
test_a_write_that_conflicts_with_the_other_servers_is_refused = shared.test_a_write_that_conflicts_with_the_other_servers_is_refused


def test_the_servers_run_on_postgres(pair: tuple[Any, Any]) -> None:
    a, b = pair
    for srv in (a, b):
        store = srv.app.state.millm.app.store
        assert type(store).__name__ == "PostgresStore" and store.path.startswith("postgresql://")


def test_a_circuit_imported_on_one_server_is_listed_and_steers_on_the_other(
    make_server: Any, tiny_engine: Any, pg_url: str, tmp_path: pathlib.Path
) -> None:
    paths = {
        name: circuit_sae(tmp_path / name, tiny_engine.info.d_model, seed=seed) for seed, name in enumerate(("alpha", "beta", "gamma"))
    }
    with on(make_server, pg_url, tmp_path / "files") as one, on(make_server, pg_url, tmp_path / "files") as two:
        setup_saes(one.base_url, paths)
        circuit = imported(one.base_url, document("shared", {0: ("alpha", [(3, 6.0)]), 1: ("beta", [(7, 4.0)])}), activate=True)
        listed = httpx.get(two.base_url + "/api/circuits").json()["data"]
        assert [c["id"] for c in listed] == [circuit["id"]]
        deadline = time.monotonic() + SEEN_WITHIN_S
        while members(circuit_chat(two.base_url).headers["x-millm-steering"])[0][1].get("id") != circuit["id"]:
            assert time.monotonic() < deadline, "the other server's requests never ran with the circuit"
            time.sleep(0.1)
        assert httpx.post(two.base_url + f"/api/circuits/{circuit['id']}/deactivate", json={}).status_code == 200
        assert httpx.get(one.base_url + "/api/circuits/active").json()["active"] == []


def test_a_probe_imported_on_one_server_is_listed_on_the_other(
    make_server: Any, tiny_engine: Any, pg_url: str, tmp_path: pathlib.Path
) -> None:
    """The probes plugin reads its documents when a server starts: the second server starts
    after the import, on the same database."""
    doc = Fitted(tiny_engine).document("sea", probe_id="shared-sea")
    with on(make_server, pg_url, tmp_path / "files") as one:
        import_probe(one, doc)
        with on(make_server, pg_url, tmp_path / "files") as two:
            listed = httpx.get(two.base_url + "/api/probes").json()["data"]
            assert [(p["id"], p["name"]) for p in listed] == [("shared-sea", "sea")]


def test_a_batch_created_on_one_server_completes_and_is_read_on_the_other(make_server: Any, pg_url: str, tmp_path: pathlib.Path) -> None:
    """One data directory (as a shared filesystem would be): the first server holds its
    lock and runs the batch; the second reads its status, counts and output."""
    folder = tmp_path / "files"
    content = jsonl([line(f"l{i}", {"model": "tiny", "prompt": f"x{i}", "max_tokens": 2}, "/v1/completions") for i in range(3)])
    with on(make_server, pg_url, folder) as first, on(make_server, pg_url, folder) as second:
        batch = submit(sdk(first.base_url), content, endpoint="/v1/completions")
        other = sdk(second.base_url)
        deadline = time.monotonic() + 180
        while (seen := other.batches.retrieve(batch.id)).status != "completed":
            assert seen.status not in ("failed", "cancelled", "expired"), seen
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
        assert seen.request_counts is not None and (seen.request_counts.total, seen.request_counts.completed) == (3, 3)
        assert [b.id for b in other.batches.list().data] == [batch.id]
        out = read_lines(other, seen.output_file_id)
        assert sorted(r["custom_id"] for r in out) == ["l0", "l1", "l2"]  # each line exactly once


def test_a_response_stored_on_one_server_is_continued_on_the_other(make_server: Any, pg_url: str, tmp_path: pathlib.Path) -> None:
    with on(make_server, pg_url, tmp_path / "files") as one, on(make_server, pg_url, tmp_path / "files") as two:
        first = httpx.post(one.base_url + "/v1/responses", json={"model": "tiny", "input": "Hello", "max_output_tokens": 3}, timeout=60)
        assert first.status_code == 200, first.text
        kept = httpx.get(two.base_url + f"/v1/responses/{first.json()['id']}")
        assert kept.status_code == 200 and kept.json()["id"] == first.json()["id"]
        body = {"model": "tiny", "input": "And?", "max_output_tokens": 3, "previous_response_id": first.json()["id"]}
        follow = httpx.post(two.base_url + "/v1/responses", json=body, timeout=60)
        assert follow.status_code == 200, follow.text
        assert httpx.delete(one.base_url + f"/v1/responses/{follow.json()['id']}").status_code == 200
        assert httpx.get(two.base_url + f"/v1/responses/{follow.json()['id']}").status_code == 404


def test_without_a_shared_data_directory_a_server_on_postgres_does_not_start(make_server: Any, pg_url: str) -> None:
    """A database server has no file for ``<db>-files`` to sit beside, and a directory of
    this machine's own would let servers on other machines run batches whose files they do
    not have: the server refuses to start, saying what to set (never a directory named
    after the URL)."""
    import asyncio

    from millm_core.config import load_settings
    from millm_core.registry import ModelRegistry
    from millm_core.server.app import build_host, create_app

    host = build_host(load_settings(environ={}))
    app = create_app(load_settings({"db": pg_url}, environ={}, plugin_settings=host.plugin_settings()), host=host, models=ModelRegistry())

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(Exception, match="--batch-data-dir"):
        asyncio.run(start())
    assert not any(p.name.startswith("postgres") for p in pathlib.Path.cwd().iterdir())
