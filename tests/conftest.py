"""Shared fixtures: the tiny model (built once, cached on disk), its engine (loaded once
per session), and real servers on 127.0.0.1 driven by the openai SDK and httpx."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from hypothesis import settings as hypothesis_settings

from millm_core.config import Settings, load_settings
from millm_core.engine import ModelLocation
from millm_core.loading import local_revision
from millm_core.logs import configure_logging
from millm_core.plugins import PluginHost
from millm_core.registry import ModelRegistry, ServedModel
from millm_core.server.app import build_host, create_app
from millm_core.testing import RunningServer
from millm_engines.gguf.testing import tiny_gguf
from millm_engines.transformers.testing import tiny_model_dir

from .gguf.helpers import load_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CI runs the property tests derandomised (reproducible verdicts); local runs keep
# exploring new examples, which is how edge cases get found and then pinned with @example.
hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")
configure_logging("console", os.environ.get("MILLM_TEST_LOG_LEVEL", "warning"))
TINY = "tiny"


def _share_the_default_ssl_context() -> None:
    """Build httpx's default TLS context (the CA bundle loaded) once per session, not once
    per client. ``httpx.post``/``httpx.get`` and every ``openai.OpenAI`` build a client per
    call, and loading the CA bundle is ~50 ms of each (314 clients were 17 s of 47 s in
    test_profiles + test_hardening). Nothing else changes: the tests' requests still go
    over real sockets to real servers (plain http on 127.0.0.1, where the context is never
    used); a client asking for anything but the default (``verify=False``, a context of its
    own, a client certificate) gets what httpx builds for it."""
    import functools

    try:
        import httpx._transports.default as transport
    except ImportError:  # pragma: no cover - another httpx layout: clients build their own
        return
    create = transport.create_ssl_context

    @functools.cache
    def default(trust_env: bool, cafile: str | None, capath: str | None) -> Any:
        return create(verify=True, cert=None, trust_env=trust_env)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is True and cert is None:
            return default(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return create(verify=verify, cert=cert, trust_env=trust_env)

    transport.create_ssl_context = create_ssl_context


_share_the_default_ssl_context()


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_dir_no_template() -> str:
    return tiny_model_dir(chat_template=False)


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    return load_settings({"log_level": "warning"}, environ={})


def _load(path: str, name: str, settings: Settings) -> ServedModel:
    from millm_engines.transformers.loader import load_engine

    engine = load_engine(ModelLocation(path=path, served_name=name, revision=local_revision(path)), settings)
    return ServedModel(info=engine.info, engine=engine)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: str, base_settings: Settings) -> ServedModel:
    return _load(tiny_dir, TINY, base_settings)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: ServedModel) -> Any:
    return tiny_model.engine


@pytest.fixture(scope="session")
def no_template_model(tiny_dir_no_template: str, base_settings: Settings) -> ServedModel:
    return _load(tiny_dir_no_template, "tiny-no-template", base_settings)


ServerFactory = Callable[..., contextlib.AbstractContextManager[RunningServer]]


@pytest.fixture
def info_logs() -> Iterator[None]:
    """Log at info for one test (the suite logs at warning), then restore."""
    configure_logging("console", "info")
    try:
        yield
    finally:
        configure_logging("console", os.environ.get("MILLM_TEST_LOG_LEVEL", "warning"))


@pytest.fixture(scope="session")
def make_server(tiny_model: ServedModel, no_template_model: ServedModel) -> ServerFactory:
    """``with make_server(max_queue=2, host=my_host) as srv:`` — a fresh real server over
    the session's loaded models, with settings overrides."""

    @contextlib.contextmanager
    def factory(host: PluginHost | None = None, models: list[ServedModel] | None = None, **overrides: Any) -> Iterator[RunningServer]:
        host = host or build_host(load_settings(environ={}))
        settings = load_settings({"log_level": "warning", "db": ":memory:", **overrides}, environ={}, plugin_settings=host.plugin_settings())
        registry = ModelRegistry()
        for model in models if models is not None else [tiny_model, no_template_model]:
            registry.add(model)
        app = create_app(settings, host=host, models=registry)
        with RunningServer(app) as server:
            yield server

    return factory


@pytest.fixture(scope="session")
def server(make_server: ServerFactory) -> Iterator[RunningServer]:
    with make_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="session")
def short_context_model(tiny_dir: str) -> ServedModel:
    """The tiny model with a 64-token window (served as ``tiny``)."""
    return _load(tiny_dir, TINY, load_settings({"max_model_len": 64}, environ={}))


@pytest.fixture(scope="session")
def short_context_server(short_context_model: ServedModel, make_server: ServerFactory) -> Iterator[RunningServer]:
    """A server whose model has a 64-token window, so that fuzzed requests that are valid
    stay cheap (long budgets are refused as context_length_exceeded)."""
    with make_server(models=[short_context_model], default_max_tokens=4) as srv:
        yield srv


# ------------------------------------------------------------------ GGUF


@pytest.fixture(scope="session")
def gguf_path(tiny_dir: str) -> str:
    return tiny_gguf(tiny_dir)


@pytest.fixture(scope="session")
def gguf_q8_path(tiny_dir: str) -> str:
    """The tiny model with Q8_0 matrices: a quantized file, on llama.cpp's flash-attention
    path as real GGUF models are (the f32 file keeps unfused f32 attention)."""
    return tiny_gguf(tiny_dir, file_name="tiny.Q8_0.gguf", quantization="Q8_0")


@pytest.fixture(scope="session")
def gguf_model(gguf_path: str) -> ServedModel:
    return load_gguf(gguf_path)


@pytest.fixture(scope="session")
def gguf_server(make_server, gguf_model: ServedModel) -> Iterator[RunningServer]:  # type: ignore[no-untyped-def]
    with make_server(models=[gguf_model]) as srv:
        yield srv


# ------------------------------------------------------------------ tool-calling templates

TEMPLATES = os.path.join(os.path.dirname(__file__), "fixtures", "templates")
EXAMPLE_TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "templates", "smollm2-hermes-tools.jinja")


@pytest.fixture(scope="session")
def tool_models() -> dict[str, ServedModel]:
    """The tiny model (with a 2048-token window: tool lists are long in its small
    vocabulary) served with each call format's chat template (``--chat-template``):
    ``tiny-hermes``, ``tiny-lfm2``, ``tiny-llama3``, and ``tiny`` with the example
    SmolLM2 Hermes template that docs/tools.md's examples use."""
    tiny_dir = tiny_model_dir(context=2048)
    models: dict[str, ServedModel] = {}
    for name in ("hermes", "lfm2", "llama3"):
        settings = load_settings({"log_level": "warning", "chat_template": os.path.join(TEMPLATES, f"{name}.jinja")}, environ={})
        models[name] = _load(tiny_dir, f"tiny-{name}", settings)
    settings = load_settings({"log_level": "warning", "chat_template": EXAMPLE_TOOLS_TEMPLATE}, environ={})
    models["example"] = _load(tiny_dir, TINY, settings)
    return models


@pytest.fixture(scope="session")
def tools_server(make_server: ServerFactory, tool_models: dict[str, ServedModel], no_template_model: ServedModel) -> Iterator[RunningServer]:
    """A server whose models take tools (one per call format), beside one without a template."""
    with make_server(models=[*tool_models.values(), no_template_model]) as srv:
        yield srv


# ------------------------------------------------------------------ a reasoning template


@pytest.fixture(scope="session")
def reasoning_model(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    """The tiny model served as ``tiny-think`` with a reasoning template whose prompt opens
    the block, as DeepSeek-R1's does (``tests/fixtures/templates/think.jinja`` with
    ``open_thinking`` on unless ``enable_thinking`` is false), so that its random weights
    always reason; a 2048-token window. Tool calls are Hermes blocks."""
    template = (pathlib.Path(TEMPLATES) / "think.jinja").read_text()
    opened = template.replace("open_thinking is defined and open_thinking", "true")
    path = tmp_path_factory.mktemp("templates") / "think-open.jinja"
    path.write_text(opened)
    settings = load_settings({"log_level": "warning", "chat_template": str(path)}, environ={})
    return _load(tiny_model_dir(context=2048), "tiny-think", settings)


@pytest.fixture(scope="session")
def reasoning_server(make_server: ServerFactory, reasoning_model: ServedModel, tiny_model: ServedModel) -> Iterator[RunningServer]:
    """A server with the reasoning-template model beside the plain tiny model."""
    with make_server(models=[reasoning_model, tiny_model]) as srv:
        yield srv

