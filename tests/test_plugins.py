"""The plugin spine: discovery through entry points, allow/block lists, hook order, and a
real third-party package that refuses requests in validate."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from millm_core.api import RequestField, hookimpl
from millm_core.config import load_settings
from millm_core.errors import ConfigError
from millm_core.plugins import PluginHost
from millm_core.server.app import build_host

from .packages import installed


@pytest.fixture(scope="module")
def installed_guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The example guard package, pip-installed as a user would."""
    with installed("millm-example-guard", "millm_example_guard", tmp_path_factory.mktemp("guard")) as target:
        yield target

def test_builtins_are_discovered_like_third_party_plugins() -> None:
    names = {ep.name for ep in importlib.metadata.entry_points(group="millm")}
    assert {"engine.transformers", "sampling", "smollm2"} <= names
    host = build_host(load_settings(environ={}))
    assert {"core", "engine.transformers", "sampling", "smollm2"} <= set(host.names())


def test_importing_plugins_does_not_import_torch() -> None:
    code = (
        "import sys; from millm_core.server.app import build_host; from millm_core.config import load_settings;"
        "build_host(load_settings(environ={})); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_third_party_package_is_discovered_ordered_and_refuses(installed_guard: str, make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    assert "guard" in host.names()
    # tryfirst: the guard validates before the core does.
    order = host.hook_order("millm_validate")
    assert order.index("guard") < order.index("core")
    with make_server(host=host) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a forbidden topic"}])
        assert info.value.body == {
            "message": "messages[0].content contains the word 'forbidden', which this server refuses",
            "type": "invalid_request_error",
            "param": "messages[0].content",
            "code": "content_refused",
        }
        ok = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": ["fine", "also fine"], "max_tokens": 2})
        assert ok.status_code == 200
        assert ok.headers["x-guard"] == "checked"
        assert ok.json()["guard"] == {"choices_checked": 2}


def test_plugin_setting_changes_behaviour_and_appears_on_the_command_line(installed_guard: str, make_server) -> None:  # type: ignore[no-untyped-def]
    from millm_core.cli import build_parser

    host = build_host(load_settings(environ={}))
    declared = PluginHost.declared_settings()
    assert {"guard_word", "embeddings_max_inputs"} <= {s.name for s in declared}
    serve_help = build_parser(declared)._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    assert "--guard-word" in serve_help and "MILLM_GUARD_WORD" in serve_help
    with make_server(host=host, guard_word="banana") as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a banana"}], max_tokens=2)
        assert info.value.body["message"] == "messages[0].content contains the word 'banana', which this server refuses"
        assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "forbidden"}], max_tokens=2).choices


def test_allow_list_excludes_the_guard(installed_guard: str) -> None:
    host = build_host(load_settings({"plugins": ("sampling",)}, environ={}))
    assert "guard" not in host.names()
    assert "engine.transformers" in host.names()  # engines are infrastructure, always on
    assert any(r.name == "guard" and not r.loaded for r in host.records)


def test_unknown_plugin_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown plugin 'nope'"):
        build_host(load_settings({"plugins": ("nope",)}, environ={}))


def test_without_sampling_plugin_nothing_generates(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings({"plugins": ()}, environ={}))
    assert not host.has("sampling")
    with make_server(host=host) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        for field, value in (("temperature", 0.5), ("stop", ["x"]), ("seed", 3), ("top_p", 0.9), ("max_tokens", 2)):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **{field: value})
            assert info.value.body["code"] == "field_not_honoured"
            assert info.value.body["param"] == field
        # Even a request with nothing to refuse is not generated: no plugin serves it.
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["code"] == "field_not_honoured"
        assert "no enabled plugin serves" in info.value.body["message"]
        stats = httpx.get(srv.base_url + "/api/health/inference").json()["scheduler"]
        assert stats["steps"] == 0  # no generation code ran


def test_block_list_removes_an_engine() -> None:
    host = PluginHost()
    host.discover(load_settings({"block_plugins": ("engine.transformers",)}, environ={}))
    assert not host.has("engine.transformers")
    assert [factory.name for factory in host.engines()] == ["gguf"]


def test_third_party_field_is_decoded_checked_published_and_in_the_policy(installed_guard: str, make_server) -> None:  # type: ignore[no-untyped-def]
    """The guard package owns ``guard_words`` through millm_register_request_fields: the
    server decodes it in its one typed pass, names it in range errors, publishes its schema
    and lists it in /api/policy, and the plugin reads the typed value."""
    host = build_host(load_settings(environ={}))
    with make_server(host=host) as srv:
        url = srv.base_url + "/v1/chat/completions"
        base = {"model": "tiny", "messages": [{"role": "user", "content": "a kiwi"}], "max_tokens": 2}
        refused = httpx.post(url, json={**base, "guard_words": ["kiwi"]})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "messages[0].content contains the word 'kiwi', which this server refuses"
        assert httpx.post(url, json={**base, "guard_words": ["plum"]}).status_code == 200
        too_many = httpx.post(url, json={**base, "guard_words": [f"w{i}" for i in range(9)]})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "guard_words"
        wrong_type = httpx.post(url, json={**base, "guard_words": [""]})
        assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "guard_words[0]"
        # Not reported as unknown: the field is declared.
        assert "x-millm-ignored-fields" not in httpx.post(url, json={**base, "guard_words": []}).headers
        schemas = httpx.get(srv.base_url + "/v1/openapi.json").json()["components"]["schemas"]
        prop = schemas["ChatCompletionRequest"]["properties"]["guard_words"]
        assert {"type": "array", "maxItems": 8}.items() <= prop["anyOf"][0].items()
        from millm_example_guard.plugin import WORDS  # type: ignore[import-not-found]

        assert WORDS.description and prop["anyOf"][0]["description"] == WORDS.description  # the field's own words
        cells = [c for c in httpx.get(srv.base_url + "/api/policy").json()["data"] if c["field"] == "guard_words"]
        assert {(c["endpoint"], c["engine"], c["status"], c["by"]) for c in cells} == {
            (endpoint, engine, "honoured", "guard") for endpoint in ("chat.completions", "completions") for engine in ("transformers", "gguf")
        }



class ProbeFieldPlugin:
    """A third party's feature that needs a capability of its own, named by a string."""

    @hookimpl
    def millm_register_request_fields(self, register: Any) -> None:
        register(RequestField("probe_depth", int, ("chat.completions",), owner="depth-probes", requires="depth_probes"))


def test_a_plugin_may_require_and_an_engine_may_offer_a_capability_of_its_own(make_server, tiny_model) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    host.register(ProbeFieldPlugin(), "depth-probes")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "probe_depth": 2}
    with make_server(host=host, models=[tiny_model]) as srv:
        refused = httpx.post(srv.base_url + "/v1/chat/completions", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "probe_depth"
        assert "lacks the capability depth_probes" in refused.json()["error"]["message"]
        cell = next(c for c in httpx.get(srv.base_url + "/api/policy").json()["data"] if c["field"] == "probe_depth" and c["engine"] == "transformers")
        assert cell["status"] == "refused" and "depth_probes" in cell["reason"]
    engine = tiny_model.engine
    engine.capabilities = engine.capabilities | {"depth_probes"}  # an engine that offers it
    try:
        with make_server(host=host, models=[tiny_model]) as srv:
            assert httpx.post(srv.base_url + "/v1/chat/completions", json=body).status_code == 200
    finally:
        del engine.capabilities  # back to the class's declaration


class _Refuser:
    """Refuses requests that carry ``x-refuse``, naming itself; records when it ran."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def validate(self, ctx: Any, request: Any) -> list[Any]:
        from millm_core.api import Problem

        self.calls.append(self.name)
        return [Problem(f"refused by {self.name}", code=f"refused_{self.name}")] if "x-refuse" in ctx.headers else []


class _Plain(_Refuser):
    @hookimpl
    def millm_validate(self, ctx: Any, request: Any) -> list[Any]:
        return self.validate(ctx, request)


class _First(_Refuser):
    @hookimpl(tryfirst=True)
    def millm_validate(self, ctx: Any, request: Any) -> list[Any]:
        return self.validate(ctx, request)


def test_validation_problems_come_in_registration_order_whatever_runs_first(make_server: Any) -> None:
    """A ``tryfirst`` validate runs before the others (pluggy then calls the last
    registered first), but the problems are reported in the plugins' registration order:
    the first registered plugin's decides the error, and the message lists them in order."""
    calls: list[str] = []
    host = build_host(load_settings(environ={}))
    host.register(_Plain("a", calls), "a")
    host.register(_First("b", calls), "b")
    host.register(_Plain("c", calls), "c")
    with make_server(host=host) as srv:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        resp = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"x-refuse": "1"}, timeout=30)
    assert calls == ["b", "c", "a"]
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == "refused_a", resp.text
    message = error["message"]
    assert message.index("refused by a") < message.index("refused by b") < message.index("refused by c"), message


class _Wrapper:
    @hookimpl(wrapper=True)
    def millm_validate(self, ctx: Any, request: Any) -> Any:
        return (yield)


def test_a_wrapper_on_a_hook_called_one_by_one_is_refused_at_registration() -> None:
    host = build_host(load_settings(environ={}))
    with pytest.raises(ConfigError, match="takes no wrappers"):
        host.register(_Wrapper(), "wrapper")
    assert "wrapper" not in host.names()


def test_a_plugin_that_cannot_import_is_named_and_can_be_blocked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An installed plugin whose module raises on import: every command says which plugin
    and how to leave it out (no traceback), and --block-plugins or MILLM_BLOCK_PLUGINS
    then work, because a blocked plugin is never imported."""
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[millm]\nbroken = broken_plugin\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("MILLM_BLOCK_PLUGINS", None)

    def models(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "millm_core.cli", *args], env={**env, **extra}, capture_output=True, text=True, timeout=120)

    for args in (("models",), ("serve", "--help")):
        failed = models(*args)
        assert failed.returncode == 2, failed.stderr
        assert failed.stderr.strip() == (
            "millm: plugin 'broken' (broken_plugin) could not be imported: ImportError: needs a library that is not installed; "
            "fix or uninstall it, or leave it out with --block-plugins broken"
        )
    for run in (models("models", "--block-plugins", "broken"), models("models", "--block-plugins=broken"), models("models", MILLM_BLOCK_PLUGINS="broken")):
        assert run.returncode == 0, run.stderr
        assert "plugin sampling\tfeature\tloaded" in run.stdout and "broken" not in run.stdout


def test_the_block_list_is_read_before_discovery() -> None:
    from millm_core.config import blocked_plugins

    assert blocked_plugins(["serve", "--block-plugins", "a, b"], environ={"MILLM_BLOCK_PLUGINS": "c"}) == ("a", "b")
    assert blocked_plugins(["serve", "--block-plugins=a"], environ={}) == ("a",)
    assert blocked_plugins(["serve", "--block-plugins", "a", "--block-plugins=b"], environ={}) == ("b",)  # the last, as argparse
    from millm_core.cli import build_parser

    assert build_parser().parse_args(["serve", "--block-plugins", "a", "--block-plugins", "b"]).block_plugins == "b"
    with pytest.raises(SystemExit):  # no abbreviation could be read otherwise than the early read reads it
        build_parser().parse_args(["serve", "--block-plug", "a"])
    assert blocked_plugins(["serve"], environ={"MILLM_BLOCK_PLUGINS": "c,d"}) == ("c", "d")
    assert blocked_plugins([], environ={}, overrides={"block_plugins": ("e",)}) == ("e",)
    assert blocked_plugins([], environ={"MILLM_BLOCK_PLUGINS": "c"}, overrides={"block_plugins": "f"}) == ("f",)


def test_passing_an_installed_plugin_again_says_so(installed_guard: str) -> None:
    import millm_example_guard.plugin as guard  # type: ignore[import-not-found]

    host = build_host(load_settings(environ={}))
    assert host.has("guard")
    for name in ("guard", "guard-again"):  # the same name, or the same module under another name
        with pytest.raises(ConfigError, match=r"registered already, as 'guard' from millm_example_guard\.plugin.*do not register it again"):
            host.register(guard, name)
