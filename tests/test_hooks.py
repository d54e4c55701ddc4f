"""Each hook in millm_core.hookspecs is documented in docs/hooks.md and exercised by a test.

The start-up and request hooks not covered elsewhere (routes, a plugin's resolve) are
exercised here with small plugins on a real server.
"""

from __future__ import annotations

import inspect
import pathlib
from typing import Any

import httpx
import msgspec
import openai
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from millm_core import hookspecs
from millm_core.config import load_settings
from millm_core.hookspecs import hookimpl
from millm_core.openapi import RouteDoc
from millm_core.registry import ModelRegistry, ServedModel
from millm_core.server.app import build_host

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("millm_")]


def test_every_hook_is_documented_and_tested() -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    plugins = "\n".join(p.read_text() for p in ROOT.glob("millm_*/**/*.py") if p.name != "hookspecs.py")
    assert len(HOOKS) >= 9
    for name in HOOKS:
        assert f"### `{name}(" in docs, f"{name} has no section in docs/hooks.md"
        assert name in tests or name in plugins, f"{name} has no implementation under test"


class RoutePlugin:
    @hookimpl
    def millm_register_routes(self, register: Any) -> None:
        async def ping(request: Request) -> Response:
            models = [m.info.served_name for m in request.app.state.millm.models]
            return JSONResponse({"pong": True, "models": models})

        register("/api/example/ping", ping, ["GET"])
        register("/api/example/echo/{word}", echo, ["POST"], doc=RouteDoc("Echo a word", request=Shout, response=Shout, errors=("400",)))


class Shout(msgspec.Struct):
    word: str


async def echo(request: Request) -> Response:
    return JSONResponse({"word": request.path_params["word"]})


class AliasPlugin:
    """Resolves the alias "default" to whichever model is served first."""

    @hookimpl
    def millm_resolve(self, ctx: Any, request: Any, models: ModelRegistry) -> ServedModel | None:
        if request.model == "default":
            return next(iter(models))
        return None


def test_register_routes_and_resolve(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(RoutePlugin(), "routes")
    host.register(AliasPlugin(), "alias")
    with make_server(host=host) as srv:
        assert httpx.get(srv.base_url + "/api/example/ping").json() == {"pong": True, "models": ["tiny", "tiny-no-template"]}
        assert httpx.post(srv.base_url + "/api/example/echo/hi", json={"word": "hi"}).json() == {"word": "hi"}
        paths = httpx.get(srv.base_url + "/v1/openapi.json").json()["paths"]
        assert "/api/example/ping" not in paths  # registered without a doc
        echo_op = paths["/api/example/echo/{word}"]["post"]
        assert echo_op["parameters"][0]["name"] == "word" and set(echo_op["responses"]) == {"200", "400", "413", "415"}
        assert echo_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/Shout")
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        resp = client.chat.completions.with_raw_response.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert resp.headers["x-millm-model"] == "tiny"
        # Names no plugin claims still reach the core's resolve and its 404.
        try:
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
        except openai.NotFoundError as exc:
            assert exc.body["code"] == "model_not_found"
        else:  # pragma: no cover
            raise AssertionError("expected 404")
