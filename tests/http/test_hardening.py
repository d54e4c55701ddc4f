"""Hostile input and operator safety, black-box against real servers: API keys on every
route, the Host allow-list, JSON-only writes to /api, request ids on 500s, fresh seeds,
chat_template_kwargs limited to template variables, a template that raises, row caps,
stop caps, include_usage, embeddings refusals, X-miLLM-Backend, and a non-streamed
request cancelled when its client disconnects."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from typing import Any

import httpx
import openai
import pytest
from starlette.requests import Request
from starlette.responses import Response

from millm_core.api import hookimpl
from millm_core.config import load_settings
from millm_core.server.app import build_host

from .helpers import GatePlugin, scheduler_stats, wait_until

MESSAGES = [{"role": "user", "content": "go"}]


def _chat(base_url: str, **body: Any) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **body}, timeout=30)


# ------------------------------------------------------------------ API keys


def test_api_keys_guard_every_route_but_health(make_server) -> None:  # type: ignore[no-untyped-def]
    from structlog.testing import capture_logs

    keys = ("k-first-6a1f", "k-second-93bd")
    with capture_logs() as logs, make_server(api_key=keys) as srv:
        for path in ("/v1/models", "/v1/openapi.json", "/v1/docs", "/api/policy", "/api/saes", "/api/health/inference", "/api/steering"):
            resp = httpx.get(srv.base_url + path)
            assert resp.status_code == 401, path
            assert resp.json()["error"] == {"message": "Missing API key: send Authorization: Bearer <key>", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
            assert resp.headers["www-authenticate"].startswith("Bearer") and resp.headers["x-request-id"]
            wrong = httpx.get(srv.base_url + path, headers={"Authorization": "Bearer k-first-6a1"})
            assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Invalid API key"
            assert httpx.get(srv.base_url + path, headers={"Authorization": "Bearer " + keys[1]}).status_code == 200, path
        for path in ("/api/health", "/api/health/ready"):
            assert httpx.get(srv.base_url + path).status_code == 200
        # Writes are guarded too, before anything reads the body.
        assert httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).status_code == 401
        # The official SDK authenticates with api_key= unchanged.
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=keys[0], max_retries=0)
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices  # type: ignore[arg-type]
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0).models.list()
        assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    assert not any(key in repr(logs) for key in keys)  # never logged


def test_host_allow_list(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(allowed_hosts=("127.0.0.1", "my.server")) as srv:
        assert httpx.get(srv.base_url + "/v1/models").status_code == 200
        assert httpx.get(srv.base_url + "/v1/models", headers={"Host": "My.Server:8000"}).status_code == 200
        for host in ("attacker.example:8000", "localhost"):  # the list replaces the local default
            rebound = httpx.get(srv.base_url + "/v1/models", headers={"Host": host})
            assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "host_not_allowed", host
    with make_server(allowed_hosts=("*",)) as srv:
        assert httpx.get(srv.base_url + "/v1/models", headers={"Host": "attacker.example:8000"}).status_code == 200


def test_a_loopback_server_answers_only_local_host_names_by_default(server) -> None:  # type: ignore[no-untyped-def]
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as Host
    (and its requests are then same-origin for the browser: it could read the answers)."""
    port = httpx.URL(server.base_url).port
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io", "localhost.attacker.example"):
        resp = httpx.post(server.base_url + "/v1/chat/completions", headers={"Host": host}, json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "host_not_allowed", host
        assert "--allowed-hosts" in resp.json()["error"]["message"]
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}", "[::1]"):
        assert httpx.get(server.base_url + "/v1/models", headers={"Host": host}).status_code == 200, host
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # HTTP/1.0, no Host: not a browser
        raw.sendall(b"GET /api/health HTTP/1.0\r\n\r\n")
        status = raw.recv(64).split(b" ")[1]
        assert status == b"200", status


def test_the_default_host_list_follows_the_listening_address() -> None:
    from millm_core.server.guard import host_allow_list

    local = ("localhost", "127.0.0.1", "[::1]")
    assert host_allow_list((), "127.0.0.1") == local
    assert host_allow_list((), "localhost") == local
    assert host_allow_list((), "127.0.0.2") == (*local, "127.0.0.2")
    assert host_allow_list((), "::1") == host_allow_list((), "[::1]") == local
    assert host_allow_list((), "::ffff:127.0.0.1") == (*local, "[::ffff:127.0.0.1]")
    for anywhere in ("0.0.0.0", "::", "192.168.1.5", "my.server"):
        assert host_allow_list((), anywhere) == ()  # any Host
    assert host_allow_list(("*",), "127.0.0.1") == () and host_allow_list(("a", "b"), "127.0.0.1") == ("a", "b")


def test_writes_to_api_need_a_json_content_type(server) -> None:  # type: ignore[no-untyped-def]
    """A web page can send text/plain or form posts cross-site without a preflight; none
    of them may change the server's state."""
    url = server.base_url + "/api/saes"
    for headers, content in (({"Content-Type": "text/plain"}, b'{"path": "/x"}'), ({"Content-Type": "application/x-www-form-urlencoded"}, b"path=/x"), ({}, b"")):
        resp = httpx.post(url, headers=headers, content=content)
        assert resp.status_code == 415 and resp.json()["error"]["code"] == "unsupported_media_type", resp.text
    assert httpx.request("DELETE", server.base_url + "/api/steering").status_code == 415
    json_post = httpx.post(url, json={"path": "/does/not/exist"})
    assert json_post.status_code == 400  # reached the route: the path is refused there


def test_a_web_page_of_another_origin_cannot_write(server) -> None:  # type: ignore[no-untyped-def]
    """A page elsewhere can post a form (multipart: a file upload) or text/plain JSON to
    any URL without a preflight; the browser names its origin, and the write is refused
    before any route runs. Same-origin pages, clients that send no Origin (the SDKs, curl)
    and writes no page can send without a preflight (JSON, or with a key: a browser
    extension, a proxy that rewrites Host) go through; reads are not affected."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1", "http://localhost:" + str(httpx.URL(server.base_url).port)):
        headers = {"Origin": origin, "Content-Type": "text/plain"}
        resp = httpx.post(server.base_url + "/v1/chat/completions", headers=headers, content=json.dumps(chat))
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "cross_origin_write", (origin, resp.text)
        upload = httpx.post(server.base_url + "/v1/files", headers={"Origin": origin}, data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
        assert upload.status_code == 403, upload.text
        assert httpx.get(server.base_url + "/v1/models", headers={"Origin": origin}).status_code == 200
        assert httpx.post(server.base_url + "/v1/chat/completions", headers={"Origin": origin}, json=chat).status_code == 200
        keyed = {"Origin": origin, "Content-Type": "text/plain", "Authorization": "Bearer x"}
        assert httpx.post(server.base_url + "/v1/chat/completions", headers=keyed, content=json.dumps(chat)).status_code == 200
    same = httpx.post(server.base_url + "/v1/chat/completions", headers={"Origin": server.base_url.upper().replace("HTTP", "http")}, json=chat)
    assert same.status_code == 200, same.text
    assert httpx.post(server.base_url + "/v1/chat/completions", json=chat).status_code == 200


# ------------------------------------------------------------------ errors and seeds


class Exploding:
    @hookimpl
    def millm_register_routes(self, register: Any) -> None:
        async def explode(request: Request) -> Response:
            raise RuntimeError("unexpected on purpose")

        register("/api/test/explode", explode, ["GET"])


class ExplodingValidate:
    @hookimpl
    def millm_validate(self, ctx: Any, request: Any) -> None:
        raise RuntimeError("a plugin bug")


def test_unexpected_500_carries_the_request_id_and_the_plugin_once_in_the_log(make_server) -> None:  # type: ignore[no-untyped-def]
    from structlog.testing import capture_logs

    host = build_host(load_settings(environ={}))
    host.register(Exploding(), "exploding")
    host.register(ExplodingValidate(), "buggy")
    with make_server(host=host) as srv, capture_logs() as logs:
        resp = httpx.get(srv.base_url + "/api/test/explode", headers={"X-Request-Id": "r7-probe"})
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
        assert resp.headers["x-request-id"] == "r7-probe"
        chat = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1}, headers={"X-Request-Id": "r8"})
        assert chat.status_code == 500 and chat.headers["x-request-id"] == "r8"
        # Logged once, by millm: the app answers the 500 and does not raise the same error on
        # to the server (hypercorn would log its traceback a second time).
        assert asyncio.run(_asgi_get(srv.app, "/api/test/explode"))[0]["status"] == 500
    errors = {e.get("request_id"): e for e in logs if e["event"] == "unhandled_error"}
    assert errors["r7-probe"]["plugin"] == "exploding" and errors["r8"]["plugin"] == "buggy"
    assert errors["r8"]["exc_type"] == "RuntimeError"


async def _asgi_get(app: Any, path: str) -> list[dict[str, Any]]:
    """The messages ``app`` sends for ``GET path``, called as a server calls it."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


def test_the_plugin_that_raised_is_found_in_the_traceback() -> None:
    host = build_host(load_settings(environ={}))
    host.register(ExplodingValidate(), "buggy")

    def raised(fn: Any) -> BaseException:
        """What ``fn`` raises, its traceback starting past this test's own frames (this
        module also holds the plugin classes, which a server's stack would not)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the exception is the subject
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_globals.get("__name__") == __name__ and tb.tb_frame.f_locals.get("self") is None:
                tb = tb.tb_next
            return exc.with_traceback(tb)
        raise AssertionError("nothing raised")

    buggy = ExplodingValidate()
    host.register(buggy, "buggy-too")
    assert host.culprit(raised(lambda: buggy.millm_validate(None, None))) == "buggy-too"  # the object's own method
    assert host.culprit(raised(lambda: ExplodingValidate().millm_validate(None, None))) == "buggy"  # its module
    # Two plugins side by side in one package: each module is its own plugin's.
    import types

    acme = {name: types.ModuleType(f"acme.{name}") for name in ("a", "b")}
    for module in acme.values():
        exec("def fail():\n    raise ValueError('x')\n", module.__dict__)  # its frames say module.__name__
        host.register(module, module.__name__.rpartition(".")[2])
    assert host.culprit(raised(acme["b"].fail)) == "b" and host.culprit(raised(acme["a"].fail)) == "a"
    from millm_plugins.sampling.defaults import parse_defaults

    assert host.culprit(raised(lambda: parse_defaults("temperature=9"))) == "sampling"  # a module of the plugin's package
    assert host.culprit(raised(lambda: load_settings({"port": "x"}, environ={}))) is None  # the core's own code


def test_unseeded_requests_never_reuse_a_seed_from_the_request_id(server) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0}
    url = server.base_url + "/v1/chat/completions"
    texts = {httpx.post(url, json=body, headers={"X-Request-Id": "same-id"}).json()["choices"][0]["message"]["content"] for _ in range(3)}
    assert len(texts) > 1  # 24 tokens drawn at temperature 1 from a random model: a repeat means a shared seed


# ------------------------------------------------------------------ chat templates


@pytest.mark.parametrize("kwargs", [{"chat_template": "Z"}, {"tokenize": True}, {"tools": []}, {"add_generation_prompt": False}, {"messages": []}])
def test_chat_template_kwargs_take_template_variables_only(server, kwargs: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    resp = _chat(server.base_url, chat_template_kwargs={"flag": True, **kwargs})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == f"chat_template_kwargs.{next(iter(kwargs))}"
    assert _chat(server.base_url, chat_template_kwargs={"flag": True}).status_code == 200  # variables are fine


@pytest.fixture(scope="module")
def picky_model(tiny_dir: str, tmp_path_factory: pytest.TempPathFactory, base_settings: Any) -> Any:
    """The tiny model with a template that refuses system messages, as many real ones do."""
    from millm_core.engine import ModelLocation
    from millm_core.registry import ServedModel
    from millm_engines.transformers.loader import load_engine

    path = tmp_path_factory.mktemp("picky") / "model"
    shutil.copytree(tiny_dir, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    config_file.write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    engine = load_engine(ModelLocation(path=str(path), served_name="picky"), base_settings)
    return ServedModel(info=engine.info, engine=engine)


def test_a_template_that_raises_is_a_400(make_server, picky_model: Any) -> None:  # type: ignore[no-untyped-def]
    with make_server(models=[picky_model]) as srv:
        body = {"model": "picky", "max_tokens": 2}
        refused = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "messages": [{"role": "system", "content": "be brief"}, *MESSAGES]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "chat_template_refused" and "System role not supported" in error["message"] and error["param"] == "messages"
        assert httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "messages": MESSAGES}).status_code == 200


# ------------------------------------------------------------------ limits and honesty


def test_rows_per_request_are_capped_by_name(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(max_rows_per_request=2) as srv:
        many_choices = _chat(srv.base_url, n=3)
        assert many_choices.status_code == 400
        assert (many_choices.json()["error"]["code"], many_choices.json()["error"]["param"]) == ("too_many_rows", "n")
        many_prompts = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 1})
        assert (many_prompts.status_code, many_prompts.json()["error"]["param"]) == (400, "prompt")
        many_conversations = _chat(srv.base_url, extra_messages=[MESSAGES, MESSAGES])
        assert (many_conversations.status_code, many_conversations.json()["error"]["param"]) == (400, "extra_messages")
        assert "3 conversation(s)" in many_conversations.json()["error"]["message"]
        assert _chat(srv.base_url, n=2).status_code == 200


def test_the_row_cap_is_the_setting_not_the_schema(server, make_server) -> None:  # type: ignore[no-untyped-def]
    """Prompts, n and conversations are counted against --max-rows-per-request alone: 65
    prompts are too_many_rows under the default 64 and served under 128 (the request
    schema capped prompt lists and n at 64 whatever the setting said)."""
    prompts = [f"p{i}" for i in range(65)]
    over = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1}, timeout=60)
    assert (over.status_code, over.json()["error"]["code"], over.json()["error"]["param"]) == (400, "too_many_rows", "prompt"), over.text
    with make_server(max_rows_per_request=128) as srv:
        many = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1}, timeout=120)
        assert many.status_code == 200 and len(many.json()["choices"]) == 65, many.text
        choices = _chat(srv.base_url, n=65, max_tokens=1)
        assert choices.status_code == 200 and len(choices.json()["choices"]) == 65, choices.text


def test_scoring_checks_the_context_window(short_context_server) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(short_context_server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "word " * 200, "max_tokens": 1, "logprobs": 1})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text


def test_stop_strings_are_capped(server) -> None:  # type: ignore[no-untyped-def]
    resp = _chat(server.base_url, stop=["x" * 1025])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop[0]", resp.text
    assert _chat(server.base_url, stop=["x" * 1024]).status_code == 200


def test_include_usage_false_sends_no_usage(server) -> None:  # type: ignore[no-untyped-def]
    def frames(options: dict[str, Any] | None) -> list[dict[str, Any]]:
        extra = {"stream_options": options} if options is not None else {}
        raw = _chat(server.base_url, stream=True, max_tokens=4, **extra).text
        return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]

    assert not any("usage" in f for f in frames({"include_usage": False}))
    assert any("usage" in f for f in frames({"include_usage": True})) and any("usage" in f for f in frames(None))
    # Without a stream nothing reads the options: refused (as OpenAI does), not dropped.
    unstreamed = _chat(server.base_url, max_tokens=2, stream_options={"include_usage": False})
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream_options", unstreamed.text
    assert _chat(server.base_url, max_tokens=2, stream_options=None).status_code == 200  # null: not sent


def test_embeddings_refuse_generation_fields(server) -> None:  # type: ignore[no-untyped-def]
    url = server.base_url + "/v1/embeddings"
    for field, value in (("seed", 3), ("n", 2), ("logprobs", True), ("steering", {"features": []}), ("response_format", {"type": "json_object"})):
        resp = httpx.post(url, json={"model": "tiny", "input": "x", field: value})
        assert resp.status_code == 400 and (resp.json()["error"]["code"], resp.json()["error"]["param"]) == ("field_not_honoured", field), resp.text
    assert httpx.post(url, json={"model": "tiny", "input": "x", "n": 1}).status_code == 200


def test_backend_header_and_inference_say_what_runs(make_server, tiny_model: Any) -> None:  # type: ignore[no-untyped-def]
    """The tiny model is a Llama: on the lean decode step its rows join other requests'
    batches. A model whose cache cannot be merged (a sliding-window layer) runs each
    request alone on the same engine class, and says so, per response and per model."""
    from millm_core.engine import ModelLocation
    from millm_core.registry import ServedModel
    from millm_engines.transformers.loader import load_engine
    from millm_engines.transformers.testing import tiny_model_dir

    sliding = tiny_model_dir(architecture="qwen2", sliding_window=64)
    serial_engine = load_engine(ModelLocation(path=sliding, served_name="serial"), load_settings({}, environ={}))
    serial = ServedModel(info=serial_engine.info, engine=serial_engine)
    with make_server(models=[tiny_model, serial]) as srv:
        assert _chat(srv.base_url).headers["x-millm-backend"] == "batched"
        assert _chat(srv.base_url, model="serial").headers["x-millm-backend"] == "serial"
        report = httpx.get(srv.base_url + "/api/health/inference").json()
        assert report["models"] == {"tiny": "batched", "serial": "serial"} and report["healthy"] is True


def test_model_not_loaded_503_has_retry_after(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(models=[]) as srv:
        resp = _chat(srv.base_url)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_not_loaded"
        assert int(resp.headers["retry-after"]) >= 1


# ------------------------------------------------------------------ disconnects


_stats = scheduler_stats


def test_a_non_streamed_request_is_cancelled_when_its_client_disconnects(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.02)  # 20 ms a token: 400 tokens would take 8 s
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0}).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request)
            deadline = time.monotonic() + 10
            while _stats(srv.base_url)["active_rows"] != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _stats(srv.base_url)["active_rows"] == 1
        # The socket is closed: the row is freed at the next step, long before 400 tokens.
        deadline = time.monotonic() + 10
        while _stats(srv.base_url)["cancelled_rows"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = _stats(srv.base_url)
        assert stats["cancelled_rows"] == 1 and stats["active_rows"] == 0
        assert stats["generated_tokens"] < 200


def test_a_request_that_cannot_fit_in_memory_is_503_before_it_runs(make_server, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Admission estimates the rows' memory (KV cache, prefill, logits) against what the
    device has free now; the probe of free memory is set so that a small request fits and
    a large one does not."""
    from millm_engines.transformers.memory import HEADROOM_BYTES, rows_bytes

    engine = tiny_model.engine
    dtype = next(engine.model.parameters()).dtype
    small, large = rows_bytes(engine.model.config, dtype, [16], 4), rows_bytes(engine.model.config, dtype, [16] * 8, 120)
    assert large > 4 * small
    engine.memory_probe = lambda device: HEADROOM_BYTES + 2 * small
    try:
        with make_server(models=[tiny_model]) as srv:
            refused = _chat(srv.base_url, n=8, max_tokens=120)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert (error["code"], error["type"]) == ("insufficient_memory", "invalid_request_error") and "cpu" in error["message"]
            assert int(refused.headers["retry-after"]) >= 1
            assert _stats(srv.base_url)["steps"] == 0  # refused before anything ran
            assert _chat(srv.base_url, max_tokens=4).status_code == 200
    finally:
        del engine.memory_probe


def test_memory_admitted_to_one_request_is_not_promised_to_the_next(make_server, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Admission counts the rows admitted before and not finished (queued or running) as
    taken: with room for one request, a second concurrent one is refused while the first
    runs, and admitted once it ended (its claim released, streamed or not)."""
    from millm_engines.transformers.memory import HEADROOM_BYTES, rows_bytes

    engine = tiny_model.engine
    dtype = next(engine.model.parameters()).dtype
    prompt = len(engine.render_chat(MESSAGES))
    one = rows_bytes(engine.model.config, dtype, [prompt], 200)
    engine.memory_probe = lambda device: HEADROOM_BYTES + one + one // 2  # room for one such request, not two
    try:
        with make_server(models=[tiny_model]) as srv:
            url = srv.base_url + "/v1/chat/completions"
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=60) as first:
                assert first.status_code == 200
                lines = first.iter_lines()
                next(lines)  # the first is admitted and streaming
                second = _chat(srv.base_url, max_tokens=200)
                assert second.status_code == 503, second.text
                assert second.json()["error"]["code"] == "insufficient_memory"
                assert "admitted before" in second.json()["error"]["message"]
                for _ in lines:  # let the first finish
                    pass
            assert _chat(srv.base_url, max_tokens=200).status_code == 200  # the stream's claim was released
            assert _chat(srv.base_url, max_tokens=200).status_code == 200  # and so was the non-streamed one's
    finally:
        del engine.memory_probe


def test_slow_body_clients_are_capped_and_dropped(make_server) -> None:  # type: ignore[no-untyped-def]
    """A client that sends headers and then only part of its body holds a request slot:
    past --max-inflight others get 503 server_busy (health still answers), and after
    --read-timeout it gets 408 and the slot frees."""
    with make_server(max_inflight=1, read_timeout=1) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            busy = None
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                busy = httpx.get(srv.base_url + "/v1/models")
                if busy.status_code == 503:
                    break
                time.sleep(0.05)
            assert busy is not None and busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
            assert busy.headers["retry-after"] == "1"
            assert httpx.get(srv.base_url + "/api/health").status_code == 200
            slow.settimeout(10)
            started = time.monotonic()
            answer = b""  # the body did not arrive within the read timeout: read the whole answer
            while b"request_timeout" not in answer and time.monotonic() - started < 5:
                chunk = slow.recv(4096)
                if not chunk:
                    break
                answer += chunk
            assert time.monotonic() - started < 5
            assert answer.split(b" ", 2)[1] == b"408" and b"request_timeout" in answer, answer[:200]
        assert wait_until(lambda: httpx.get(srv.base_url + "/v1/models").status_code == 200)


class NoEos:
    """Keeps every row from ending early, so a generation lasts exactly max_tokens."""

    def __init__(self, eos: frozenset[int]) -> None:
        self.bias = {token: -1e9 for token in eos}

    @hookimpl
    def millm_pre_forward(self, ctx: Any, request: Any, plan: Any) -> None:
        bias = self.bias

        class _Processor:
            def logit_bias(self) -> dict[int, float]:
                return bias

            def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
                return text, False

            def flush(self) -> str:
                return ""

        plan.add_processor(lambda _row: _Processor())


def test_the_read_timeout_never_cuts_a_long_generation(make_server, tiny_engine) -> None:  # type: ignore[no-untyped-def]
    """--read-timeout bounds how long a client takes to send its request, not how long the
    answer takes: generations of three times the timeout complete, streamed or not."""
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.1)  # 100 ms a token: 30 tokens take 3 s
    slow.gate.set()
    host.register(slow, "slow")
    host.register(NoEos(tiny_engine.eos_token_ids), "no-eos")
    with make_server(host=host, read_timeout=1) as srv:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 30, "temperature": 0}
        started = time.monotonic()
        plain = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 30 and time.monotonic() - started > 2.5
        streamed = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n") and '"error"' not in streamed.text


def test_a_stream_whose_client_leaves_before_the_first_chunk_is_cancelled(make_server) -> None:  # type: ignore[no-untyped-def]
    host = build_host(load_settings(environ={}))
    slow = GatePlugin(delay=0.02)
    slow.gate.set()
    host.register(slow, "slow")
    with make_server(host=host) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # fmt: skip
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request)  # and close at once, before any chunk is read
        assert wait_until(lambda: _stats(srv.base_url)["cancelled_rows"] == 1)
        stats = _stats(srv.base_url)
        assert stats["active_rows"] == 0 and stats["generated_tokens"] < 200


def test_default_max_tokens_zero_runs_to_the_context_window(make_server, short_context_model) -> None:  # type: ignore[no-untyped-def]
    """``--default-max-tokens 0``: a request without max_tokens may fill the whole window."""
    with make_server(models=[short_context_model], default_max_tokens=0) as srv:
        resp = httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "the cat", "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    usage, choice = resp.json()["usage"], resp.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
