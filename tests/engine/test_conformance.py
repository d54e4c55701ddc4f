"""The engine conformance suite (:mod:`millm_core.conformance`) on both built-in engines,
as a third-party engine plugin would run it on its own."""

from __future__ import annotations

import pytest

from millm_core.api import Capability, Engine, EngineFactory, JoinTogether, ModelLocation, Scorer, ServedModel
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

    # The suite skips what an engine does not offer; these say so by asserting it instead.
    def test_temperature_zero_is_the_argmax(self, conformance_engine: Engine) -> None:
        """Not a Scorer (llama.cpp's logits are not read back); its greedy text equals the
        transformers engine's on the same weights (tests/gguf/test_gguf_engine.py)."""
        assert not isinstance(conformance_engine, Scorer) and Capability.SCORING not in conformance_engine.capabilities

    def test_taps_read_each_row_as_alone(self, conformance_engine: Engine) -> None:
        """llama.cpp exposes no residual stream: no taps."""
        assert Capability.TAPS not in conformance_engine.capabilities


class _OwnCapability:
    """An engine declaring, beside its own, a capability named by a third party."""

    def __init__(self, engine: Engine, name: str) -> None:
        self._engine = engine
        self.capabilities = engine.capabilities | {name}

    def __getattr__(self, attr: str) -> object:
        return getattr(self._engine, attr)


def test_a_capability_of_a_third_partys_own_passes_the_declarations_check(tiny_engine: Engine, request: pytest.FixtureRequest) -> None:
    suite = EngineConformance()
    suite.test_capabilities_have_their_protocols(_OwnCapability(tiny_engine, "probes"), request)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="Capability members or names"):
        suite.test_capabilities_have_their_protocols(_OwnCapability(tiny_engine, 7), request)  # type: ignore[arg-type]
