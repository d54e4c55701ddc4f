"""The engine conformance suite (:mod:`millm_core.conformance`) on both built-in engines,
as a third-party engine plugin would run it on its own."""

from __future__ import annotations

import pytest

from millm_core.api import Engine, EngineFactory, JoinTogether, ModelLocation, ServedModel
from millm_core.config import load_settings
from millm_core.conformance import EngineConformance, registered_factory
from millm_engines.gguf import plugin as gguf_plugin
from millm_engines.transformers import plugin as transformers_plugin
from millm_engines.transformers.loader import load_engine


class TestTransformersConformance(EngineConformance):
    """The transformers engine on the tiny model (the session's ``tiny_engine``)."""

    @pytest.fixture
    def conformance_engine(self, tiny_engine: Engine) -> Engine:
        return tiny_engine

    @pytest.fixture
    def conformance_factory(self) -> EngineFactory:
        return registered_factory(transformers_plugin, "transformers")


@pytest.fixture(scope="module")
def tiny_bf16_engine(tiny_dir: str) -> Engine:
    settings = load_settings({"dtype": "bfloat16", "log_level": "warning"}, environ={})
    return load_engine(ModelLocation(path=tiny_dir, served_name="tiny-bf16"), settings)


class TestTransformersBfloat16Conformance(EngineConformance):
    """The transformers engine on the tiny model in bfloat16, where joining requests
    share the lean prefill's passes (on CPUs whose bf16 products pass its check)."""

    @pytest.fixture
    def conformance_engine(self, tiny_bf16_engine: Engine) -> Engine:
        return tiny_bf16_engine

    @pytest.fixture
    def conformance_factory(self) -> EngineFactory:
        return registered_factory(transformers_plugin, "transformers")


class TestGGUFConformance(EngineConformance):
    """The GGUF engine (llama.cpp) on the tiny model's f32 GGUF (the session's ``gguf_model``)."""

    @pytest.fixture
    def conformance_engine(self, gguf_model: ServedModel) -> Engine:
        return gguf_model.engine

    @pytest.fixture
    def conformance_factory(self) -> EngineFactory:
        return registered_factory(gguf_plugin, "gguf")

    def test_requests_joined_together_equal_solo(self, conformance_engine: Engine) -> None:
        """The GGUF engine joins one request at a time (a joining prompt shares its calls
        only with other rows' single tokens), so it is not JoinTogether."""
        assert not isinstance(conformance_engine, JoinTogether)
