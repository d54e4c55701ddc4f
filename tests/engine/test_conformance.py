"""The engine conformance suite (:mod:`millm_core.conformance`) on both built-in engines,
as a third-party engine plugin would run it on its own."""

from __future__ import annotations

import pytest

from millm_core.api import Engine, EngineFactory, ServedModel
from millm_core.conformance import EngineConformance, registered_factory
from millm_engines.gguf import plugin as gguf_plugin
from millm_engines.transformers import plugin as transformers_plugin


class TestTransformersConformance(EngineConformance):
    """The transformers engine on the tiny model (the session's ``tiny_engine``)."""

    @pytest.fixture
    def conformance_engine(self, tiny_engine: Engine) -> Engine:
        return tiny_engine

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
