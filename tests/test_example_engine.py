"""The example third-party engine plugin (examples/millm-example-engine): a byte-level
bigram model. It is pip-installed like any third party's package, discovered through its
entry point, passes the engine conformance suite, and serves the openai SDK."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from millm_core.api import ConfigError, ModelLocation, RowSpec, SamplingParams
from millm_core.config import load_settings
from millm_core.conformance import EngineConformance, drive, registered_factory
from millm_core.engine import Capability, Embedder, Engine, EngineFactory, JoinTogether, Scorer
from millm_core.loading import load, locate
from millm_core.registry import ServedModel
from millm_core.server.app import build_host

from .packages import installed

EOS = 256
# The chat format of a model without a template, and a corpus whose greedy answer to it ends
# at the end-of-text token: ":" → " " → "h" → "i" → "!" → EOS.
CHAT_PROMPT = "user: say hi\nassistant:"
TEXTS = [
    "user: hi!\nassistant: hi!",
    "user: hello\nassistant: hi! how happy i am to help!",
    "user: who are you?\nassistant: a bigram model of bytes.",
    "hi!",
]


@pytest.fixture(scope="module")
def installed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The example engine package, pip-installed as a user would."""
    with installed("millm-example-engine", "millm_example_engine", tmp_path_factory.mktemp("engine")) as target:
        yield target


@pytest.fixture(scope="module")
def model_path(installed_engine: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from millm_example_engine.engine import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny.bigram.json"), TEXTS)


@pytest.fixture(scope="module")
def served(model_path: str) -> ServedModel:
    """Loaded the way ``millm serve --model tiny.bigram.json`` loads it."""
    settings = load_settings({"model": model_path}, environ={})
    host = build_host(settings)
    engine = load(locate(settings, host), settings, host)
    return ServedModel(info=engine.info, engine=engine)


def greedy_reference(path: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(text, finish reason) of a greedy walk over the file's table, computed here from
    the JSON alone: after byte c the most frequent next token (ties: lowest id); a byte
    without a row continues as a text's start would."""
    with open(path) as fh:
        table = {int(k): {int(t): n for t, n in row.items()} for k, row in json.load(fh)["table"].items()}
    out, last = bytearray(), prompt.encode()[-1]
    for _ in range(max_tokens):
        row = table.get(last) or table[EOS]
        last = min(row, key=lambda t: (-row[t], t))
        if last == EOS:
            return out.decode(), "stop"
        out.append(last)
    return out.decode(), "length"


def test_installed_package_is_discovered_as_an_engine(installed_engine: str) -> None:
    host = build_host(load_settings(environ={}))
    assert "engine.example" in host.names()
    [record] = [r for r in host.records if r.name == "engine.example"]
    assert record.kind == "engine" and record.loaded
    assert "example" in [factory.name for factory in host.engines()]


def test_served_model_is_named_by_the_file_and_fingerprinted(served: ServedModel, model_path: str) -> None:
    assert served.info.served_name == "tiny-bigram"
    assert served.info.engine == "bigram" and served.info.vocab_size == 257
    assert served.info.revision != "unrecorded"  # the file's hash
    assert served.engine.eos_token_ids == frozenset({EOS})


@pytest.fixture(scope="module")
def conformance_engine(served: ServedModel) -> Engine:
    return served.engine


class TestExampleEngineConformance(EngineConformance):
    """The whole engine contract; the Scorer and Embedder tests skip (not offered)."""

    @pytest.fixture
    def conformance_factory(self, installed_engine: str) -> EngineFactory:
        from millm_example_engine import plugin

        return registered_factory(plugin, "example")

    def test_requests_joined_together_equal_solo(self, conformance_engine: Engine) -> None:
        """The example engine joins one request at a time: it is not JoinTogether (the
        core then joins its requests one by one, covered by the joining tests)."""
        assert not isinstance(conformance_engine, JoinTogether)

    # The suite skips what an engine does not offer; these say so by asserting it instead.
    def test_temperature_zero_is_the_argmax(self, conformance_engine: Engine) -> None:
        """Not a Scorer; its greedy walk is checked against the bigram table itself
        (test_the_reference_walk_is_not_trivial and the HTTP tests below)."""
        assert not isinstance(conformance_engine, Scorer) and Capability.SCORING not in conformance_engine.capabilities

    def test_taps_read_each_row_as_alone(self, conformance_engine: Engine) -> None:
        assert Capability.TAPS not in conformance_engine.capabilities  # a bigram table has no residual stream

    def test_rewind_takes_tokens_back(self, conformance_engine: Engine) -> None:
        assert Capability.REWIND not in conformance_engine.capabilities

    def test_embeddings_do_not_depend_on_the_batch(self, conformance_engine: Engine) -> None:
        assert not isinstance(conformance_engine, Embedder) and Capability.EMBEDDINGS not in conformance_engine.capabilities


def test_the_reference_walk_is_not_trivial(model_path: str) -> None:
    assert greedy_reference(model_path, CHAT_PROMPT, 40) == (" hi!", "stop")
    text, reason = greedy_reference(model_path, "The capital of France is", 40)
    assert len(text) > 4 and reason == "stop"


def test_openai_sdk_against_a_real_server(served: ServedModel, model_path: str, make_server: Any) -> None:
    name = served.info.served_name
    messages: Any = [{"role": "user", "content": "say hi"}]
    with make_server(models=[served]) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=40)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == greedy_reference(model_path, CHAT_PROMPT, 40)
        assert reply.system_fingerprint == served.info.system_fingerprint
        assert reply.usage is not None and reply.usage.prompt_tokens == len(CHAT_PROMPT.encode())

        # A greedy walk that never reaches EOS runs to its budget.
        text = client.completions.create(model=name, prompt="The ca", temperature=0, max_tokens=12)
        assert (text.choices[0].text, text.choices[0].finish_reason) == greedy_reference(model_path, "The ca", 12)

        seeded = [
            client.chat.completions.with_raw_response.create(model=name, messages=messages, temperature=1, seed=7, max_tokens=30)
            for _ in range(2)
        ]
        first, second = (r.parse().choices[0].message.content for r in seeded)
        assert first == second and first
        assert seeded[0].headers["x-millm-seed"].startswith("7;")

        refused: dict[str, dict[str, Any]] = {
            "steering": {"extra_body": {"steering": {"features": [{"index": 1, "strength": 2.0}]}}},
            "logprobs": {"logprobs": True, "max_tokens": 1},
        }
        for field, extra in refused.items():
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=name, messages=messages, **extra)
            body: Any = info.value.body
            assert info.value.status_code == 400
            assert (body["code"], body["param"]) == ("field_not_honoured", field), body


def test_bad_files_are_config_errors(installed_engine: str, tmp_path: pathlib.Path) -> None:
    from millm_example_engine.engine import load as load_bigram

    settings = load_settings(environ={})
    for body in ("not json", '{"format": "other"}', '{"format": "millm-bigram/1", "table": {"300": {"1": 1}}}',
                 '{"format": "millm-bigram/1", "table": {"1": {"2": 0}}}'):  # fmt: skip
        path = tmp_path / "bad.bigram.json"
        path.write_text(body)
        with pytest.raises(ConfigError):
            load_bigram(ModelLocation(path=str(path), served_name="bad"), settings)


def test_seeded_sampling_follows_the_counts(served: ServedModel, model_path: str) -> None:
    """At temperature 1 the next byte is drawn in proportion to its count: over many
    seeds, the share of each byte after "h" matches the table's."""
    with open(model_path) as fh:
        counts = {int(t): n for t, n in json.load(fh)["table"][str(ord("h"))].items()}
    seen: dict[int, int] = {}
    for seed in range(400):
        row = RowSpec(prompt_ids=tuple(b"h"), sampling=SamplingParams(temperature=1.0, seed=seed))
        [[token]] = drive(served.engine, [row], 1)
        seen[token] = seen.get(token, 0) + 1
    assert set(seen) == set(counts)
    total = sum(counts.values())
    for token, count in counts.items():
        assert math.isclose(seen[token] / 400, count / total, abs_tol=0.08), (chr(token), seen, counts)


def test_model_roots_list_the_files_a_third_party_engine_loads(installed_engine: str, model_path: str, tmp_path: pathlib.Path) -> None:
    """``--model-roots`` lists what some installed engine's ``can_load`` takes: the
    example engine's ``.bigram.json`` files, at the top and one level down; other files
    are not models."""
    from millm_core.lifecycle import candidates

    (tmp_path / "org").mkdir()
    shutil.copy(model_path, tmp_path / "top.bigram.json")
    shutil.copy(model_path, tmp_path / "org" / "nested.bigram.json")
    (tmp_path / "notes.txt").write_text("not a model")
    settings = load_settings({"model_roots": (str(tmp_path),)}, environ={})
    found = candidates(settings, build_host(settings))
    listed = {c.id for c in found.values() if c.source == "directory"}
    assert listed == {"top.bigram.json", "org/nested.bigram.json"}


def test_an_engine_whose_check_raises_hides_no_other_model(installed_engine: str, model_path: str, tmp_path: pathlib.Path, make_server: Any) -> None:
    """One engine's ``can_load`` raising (a file it cannot read, a bug) is logged; the
    models the other engines take are still listed, over HTTP too, and load."""
    from millm_core.api import EngineFactory, hookimpl
    from millm_core.lifecycle import candidates

    class Broken:
        @hookimpl
        def millm_register_engines(self, register: Any) -> None:
            def can_load(location: Any) -> bool:
                raise PermissionError(location.path)

            register(EngineFactory(name="broken", capabilities=frozenset(), can_load=can_load, load=lambda *_: None, priority=1))

    shutil.copy(model_path, tmp_path / "top.bigram.json")
    settings = load_settings({"model_roots": (str(tmp_path),)}, environ={})
    host = build_host(settings)
    host.register(Broken(), "broken")
    assert {c.id for c in candidates(settings, host).values() if c.source == "directory"} == {"top.bigram.json"}
    with make_server(host=host, models=[], model_roots=(str(tmp_path),)) as srv:
        listed = httpx.get(srv.base_url + "/api/models", timeout=60).json()["data"]
        assert [(m["id"], m["engine"]) for m in listed if m["id"] == "top.bigram.json"] == [("top.bigram.json", "example")]
        loaded = httpx.post(srv.base_url + "/api/models/top.bigram.json/load", json={}, timeout=60)
        assert loaded.status_code == 200 and loaded.json()["state"] == "loaded", loaded.text
