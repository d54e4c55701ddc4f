"""A real server with three SAEs registered: ``alpha`` attached at layer 0, ``beta`` at
layer 1, and ``gamma`` registered but not attached (circuits spanning it cannot serve in
full)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .helpers import JSON, write_sae


@pytest.fixture(scope="package")
def sae_paths(tiny_engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("circuit-saes")
    return {name: write_sae(folder / name, tiny_engine.info.d_model, seed=seed) for seed, name in enumerate(("alpha", "beta", "gamma"))}


def setup_saes(base_url: str, sae_paths: dict[str, str]) -> None:
    for name, path in sae_paths.items():
        assert httpx.post(base_url + "/api/saes", json={"path": path, "id": name}).status_code == 201
    assert httpx.post(base_url + "/api/saes/alpha/attach", json={"layer": 0}).status_code == 200
    assert httpx.post(base_url + "/api/saes/beta/attach", json={"layer": 1}).status_code == 200


@pytest.fixture(scope="module")
def circuit_server(make_server, sae_paths: dict[str, str]) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    with make_server() as server:
        setup_saes(server.base_url, sae_paths)
        yield server


def clean(base_url: str) -> None:
    """Deactivate and delete every circuit, delete every profile, clear the live values."""
    for circuit in httpx.get(base_url + "/api/circuits").json()["data"]:
        httpx.delete(base_url + "/api/circuits/" + circuit["id"], headers=JSON)
    for profile in httpx.get(base_url + "/api/profiles").json()["data"]:
        httpx.delete(base_url + "/api/profiles/" + profile["name"], headers=JSON)
    httpx.delete(base_url + "/api/steering", headers=JSON)


@pytest.fixture
def srv(circuit_server: Any) -> Iterator[Any]:
    """The module's server, emptied of circuits, profiles and live values after each test."""
    yield circuit_server
    clean(circuit_server.base_url)


def imported(base_url: str, doc: dict[str, Any], *, activate: bool = False, **activation: Any) -> dict[str, Any]:
    """Import ``doc`` (and activate it): the import response."""
    resp = httpx.post(base_url + "/api/circuits/import", json=doc)
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    if activate:
        done = httpx.post(base_url + f"/api/circuits/{body['id']}/activate", json=activation)
        assert done.status_code == 200, done.text
    return body


def sae_path(sae_paths: dict[str, str], name: str) -> pathlib.Path:
    return pathlib.Path(sae_paths[name])
