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
    # Implementations the suite loads: the built-in engines and plugins and the example
    # plugin (the core only calls hooks, so its mentions do not count).
    builtin = [*ROOT.glob("millm_engines/**/*.py"), *ROOT.glob("millm_plugins/**/*.py"), *ROOT.glob("examples/**/*.py")]
    implemented = "\n".join(p.read_text() for p in builtin)
    assert len(HOOKS) >= 9
    for name in HOOKS:
        assert f"### `{name}(" in docs, f"{name} has no section in docs/hooks.md"
        assert f"def {name}(" in tests or f"def {name}(" in implemented, f"{name} has no implementation under test"


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


class ClosingPlugin:
    """Closing chunks at chosen orders, and a record of every finalize call."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, tuple[str, ...]]] = []

    @hookimpl
    def millm_finalize(self, ctx: Any, request: Any, outcome: Any, out: Any) -> None:
        if outcome.kind != "generation":
            return
        self.seen.append((outcome.cancelled, tuple(c.finish_reason for c in outcome.choices)))
        out.extend("z_first", 1, order=5)
        out.extend("a_late", 2, order=95)
        out.extensions["b_default"] = 3  # no order: the default, 50


def test_closing_chunks_follow_their_order_and_an_interrupted_stream_is_finalized(make_server) -> None:  # type: ignore[no-untyped-def]
    import json
    import time

    from .http.helpers import GatePlugin

    plugin = ClosingPlugin()
    host = build_host(load_settings(environ={}))
    host.register(plugin, "closing")
    slow = GatePlugin(delay=0.02)  # 20 ms a token: the long stream is still running when the client leaves
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        closing = [next(k for k in c if k not in ("id", "object", "created", "model", "choices", "system_fingerprint", "usage")) for c in chunks if c["choices"] == []]
        assert closing == ["z_first", "b_default", "millm_steering", "a_late"]
        assert plugin.seen[-1][0] is False
        long = {**body, "max_tokens": 400, "temperature": 0}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=long, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                    break  # the client leaves mid-stream, after some text
        deadline = time.monotonic() + 30
        while len(plugin.seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert len(plugin.seen) == 2, plugin.seen  # finalized once, never twice
        cancelled, reasons = plugin.seen[-1]
        assert cancelled is True and reasons == ("cancelled",), plugin.seen



class WaitingPlugin:
    """A pre-forward that adds a wait: it records when it ran, and refuses the request when
    the prompt asks for it."""

    def __init__(self) -> None:
        self.order: list[str] = []

    @hookimpl
    def millm_pre_forward(self, ctx: Any, request: Any, plan: Any) -> None:
        import asyncio

        from millm_core.api import InvalidRequest, PassThrough

        refuse = "refuse" in str(getattr(request, "prompt", ""))

        async def first() -> None:
            await asyncio.sleep(0.05)
            self.order.append("first")

        async def second() -> None:
            self.order.append("second")
            if refuse:
                raise InvalidRequest("the wait says no", param="prompt")

        plan.add_wait(first)
        plan.add_wait(second)
        plan.add_processor(lambda row: self.order.append("row") or PassThrough())


def test_a_pre_forward_wait_runs_before_the_rows_and_can_refuse(make_server) -> None:  # type: ignore[no-untyped-def]
    """``plan.add_wait``: the waits run in order, before any row is made; one that raises
    refuses the request with its error, on a stream too (nothing was sent yet)."""
    plugin = WaitingPlugin()
    host = build_host(load_settings(environ={}))
    host.register(plugin, "waiting")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert plugin.order == ["first", "second", "row"]
        plugin.order.clear()
        for stream in (False, True):
            resp = httpx.post(srv.base_url + "/v1/completions", json={**body, "prompt": "refuse", "stream": stream}, timeout=60)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["message"] == "the wait says no" and resp.json()["error"]["param"] == "prompt"
        assert plugin.order == ["first", "second"] * 2  # no row was made


def builtin_plugins() -> dict[str, Any]:
    """The core's own plugin and every installed one, by name."""
    import importlib.metadata

    from millm_core import builtin

    return {builtin.NAME: builtin, **{ep.name: ep.load() for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT)}}


def hook_orders(plugin: Any) -> dict[str, str]:
    """The hooks ``plugin`` implements: "tryfirst", "trylast" or ""."""
    declared = {}
    for attr in dir(plugin):
        opts = getattr(getattr(plugin, attr), f"{hookspecs.PROJECT}_impl", None)
        if attr.startswith("millm_") and opts is not None:
            declared[attr] = "tryfirst" if opts.get("tryfirst") else "trylast" if opts.get("trylast") else ""
    return declared


def test_each_hooks_built_in_line_names_every_plugin_that_implements_it() -> None:
    """Under each hook's section in docs/hooks.md, the "*Built-in:*" paragraph names the
    built-in plugins that implement it, all of them and no other."""
    import re

    docs = (ROOT / "docs" / "hooks.md").read_text()
    plugins = builtin_plugins()
    implementers: dict[str, set[str]] = {}
    for name, plugin in plugins.items():
        for hook in hook_orders(plugin):
            implementers.setdefault(hook, set()).add(name)
    for hook in HOOKS:
        section = re.split(r"^##+ ", docs.split(f"### `{hook}(", 1)[1], maxsplit=1, flags=re.M)[0]
        line = re.search(r"^\*Built-in:\*(.*?)(?:\n\n|\Z)", section, re.M | re.S)
        named = set(re.findall(r"`([a-z0-9_.]+)`", line[1])) & set(plugins) if line else set()
        assert named == implementers.get(hook, set()), f"{hook}: the docs name {sorted(named)}, the code {sorted(implementers.get(hook, set()))}"


def test_the_hook_table_lists_what_each_builtin_plugin_implements() -> None:
    """docs/hooks.md's table of built-in plugins against the code: every installed plugin
    (and the core's own) has a row with its kind, every hook it implements and no other,
    and a hook's ``tryfirst``/``trylast`` is said where, and only where, it is declared."""
    import re

    from millm_core.plugins import plugin_kind

    docs = (ROOT / "docs" / "hooks.md").read_text()
    table = docs.split("## Which hooks each built-in plugin implements", 1)[1].split("\n\n", 2)[1]
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines()[2:]:
        name, kind, hooks = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[name.strip("`")] = (kind, hooks)
    plugins = builtin_plugins()
    assert sorted(rows) == sorted(plugins)
    for name, plugin in plugins.items():
        declared = hook_orders(plugin)
        kind, hooks = rows[name]
        assert kind.split()[0] == plugin_kind(plugin), name
        listed: dict[str, str] = {}
        depth, segment, segments = 0, "", []
        for char in hooks + ",":  # split at the commas outside parentheses
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == "," and depth == 0:
                segments.append(segment)
                segment = ""
            else:
                segment += char
        for segment in segments:
            head, _, note = segment.partition("(")
            (hook,) = re.findall(r"`(millm_\w+)`", head)
            order = re.match(r"\s*(tryfirst|trylast)\b", note)
            listed[hook] = order[1] if order else ""
        assert listed == declared, f"{name}: the table says {listed}, the code declares {declared}"


class LocatingPlugin:
    """Finds one name of its own (a lab's alias for a checkpoint directory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.asked: list[str] = []

    @hookimpl
    def millm_locate_model(self, name: str, settings: Any) -> Any:
        from millm_core.api import ModelLocation

        self.asked.append(name)
        return ModelLocation(path=self.path, served_name=name, revision="lab-1") if name == "lab/tiny-alias" else None


def test_locate_model_is_asked_for_names_no_source_offers(tiny_dir: str) -> None:
    """``--model`` names a model: a directory or a plugin's model source first; only then
    ``millm_locate_model`` (first answer wins); ``--served-name`` still renames it, and a
    name nobody finds is a configuration error naming what was tried."""
    import pytest

    from millm_core.errors import ConfigError
    from millm_core.loading import locate

    def host_with(plugin: LocatingPlugin, **values: Any) -> tuple[Any, Any]:
        settings = load_settings(values, environ={})
        host = build_host(settings)
        host.register(plugin, "locator")
        return settings, host

    plugin = LocatingPlugin(tiny_dir)
    settings, host = host_with(plugin, model="lab/tiny-alias")
    found = locate(settings, host)
    assert (found.path, found.served_name, found.revision) == (tiny_dir, "lab/tiny-alias", "lab-1")
    settings, host = host_with(plugin, model="lab/tiny-alias", served_name="mine")
    assert locate(settings, host).served_name == "mine"
    settings, host = host_with(plugin, model="lab/nowhere")
    with pytest.raises(ConfigError, match="lab/nowhere"):
        locate(settings, host)
    assert plugin.asked == ["lab/tiny-alias", "lab/tiny-alias", "lab/nowhere"]
    settings, host = host_with(plugin, model="SmolLM2-135M-Instruct")  # the smollm2 plugin's source
    assert locate(settings, host).served_name == "SmolLM2-135M-Instruct"
    assert plugin.asked[-1] == "lab/nowhere"  # a source answered: the hook was not asked


def test_the_hf_cache_plugin_locates_a_cached_repository(tiny_dir: str, tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """The built-in ``millm_locate_model``: a repository id found in the local Hugging Face
    cache (its refs/main snapshot), nothing for one that is not there (never a download)."""
    import os

    from huggingface_hub import constants

    from millm_plugins.hf_cache import plugin as hf_cache

    snapshot = tmp_path / "models--acme--Tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in os.listdir(tiny_dir):
        os.symlink(os.path.join(tiny_dir, name), snapshot / name)
    (tmp_path / "models--acme--Tiny" / "refs").mkdir()
    (tmp_path / "models--acme--Tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    settings = load_settings({}, environ={})
    found = hf_cache.millm_locate_model("acme/Tiny", settings)
    assert found is not None and os.path.samefile(found.path, snapshot) and found.served_name == "acme/Tiny"
    assert hf_cache.millm_locate_model("acme/Missing", settings) is None
