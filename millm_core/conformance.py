"""An engine conformance suite that any engine plugin can run in its own tests.

The rules here are the ones the core relies on when it serves an engine: a row's tokens
depend on its own request alone (not on its batch, its row position or rows joining and
leaving), seeded sampling is a pure function of ``(seed, stream, position)``, greedy is the
argmax, declared capabilities are true, a rewound row goes on as if the tokens taken back had
never been drawn, and embeddings do not depend on their batch. Each test drives the engine's
own batch API (``open_batch``/``step``/``join``/``retain``/``rewind``/``close``) directly, the
way the core's row driver does, with small token budgets.

Usage, in a plugin's test module::

    import pytest
    from millm_core.conformance import EngineConformance, registered_factory

    from my_engine import plugin


    @pytest.fixture(scope="module")  # module-level: pytest deprecates scoped fixtures on classes
    def conformance_engine():
        return load_my_tiny_model()


    @pytest.fixture
    def conformance_factory():
        return registered_factory(plugin, "my-engine")


    class TestMyEngine(EngineConformance):
        pass

This module imports pytest: import it from tests only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec
import numpy as np
import pytest

from .engine import (
    Capability,
    EagerJoin,
    Embedder,
    Engine,
    EngineFactory,
    Joinable,
    JoinTogether,
    ResidualReader,
    Rewinding,
    RowSpec,
    SamplingParams,
    Scorer,
    Tap,
    Tapping,
)

__all__ = ["GREEDY", "PROTOCOLS", "EngineConformance", "drive", "registered_factory"]

GREEDY = SamplingParams(temperature=0.0)

# The optional protocol each capability promises.
PROTOCOLS: Mapping[Capability, type] = {
    Capability.EMBEDDINGS: Embedder,
    Capability.SCORING: Scorer,
    Capability.STEERING: ResidualReader,
    Capability.TAPS: Tapping,
    Capability.REWIND: Rewinding,
}


def registered_factory(plugin: Any, name: str | None = None) -> EngineFactory:
    """The :class:`EngineFactory` that ``plugin`` (a plugin module or object) registers
    through ``millm_register_engines``: the one called ``name`` when it registers several."""
    found: list[EngineFactory] = []
    plugin.millm_register_engines(register=found.append)
    matching = [f for f in found if name is None or f.name == name]
    if len(matching) != 1:
        raise LookupError(f"the plugin registers {[f.name for f in found]}; expected exactly one named {name!r}")
    return matching[0]


def drive(
    engine: Engine,
    rows: Sequence[RowSpec],
    budget: int,
    *,
    joins: Mapping[int, Sequence[RowSpec]] | None = None,
    drop: Mapping[int, Sequence[int]] | None = None,
    eager: bool = False,
    together: Mapping[int, Sequence[Sequence[RowSpec]]] | None = None,
) -> list[list[int]]:
    """Step ``rows`` together until each ends (at an EOS token, included, or after
    ``budget`` tokens) and return each row's tokens, in order: the initial rows, then the
    joined ones. ``joins[k]``: rows that join (:meth:`Joinable.join`) after ``k`` steps.
    ``drop[k]``: rows (by that index) freed with :meth:`Engine.retain` after step ``k``
    (0-based). A finished row is freed with ``retain`` too, as the core does. With
    ``eager``, rows that join after a step draw their first token at once
    (:meth:`EagerJoin.first_tokens`), as the core does on such an engine.
    ``together[k]``: requests whose rows join in one :meth:`JoinTogether.join_together`
    call after ``k`` steps (each must be accepted); not at a step ``joins`` also uses."""
    pending: dict[int, tuple[list[Sequence[RowSpec]], bool]] = {k: ([rows_k], False) for k, rows_k in (joins or {}).items()}
    for k, requests in (together or {}).items():
        assert k not in pending, f"step {k} has both joins and together"
        pending[k] = (list(requests), True)
    drop = drop or {}
    out: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))
    batch = engine.open_batch(list(rows))
    try:
        step = 0
        while live or pending:
            if step in pending or (not live and pending):
                requests, grouped = pending.pop(step if step in pending else min(pending))
                if grouped:
                    outcome = cast(JoinTogether, engine).join_together(batch, [list(r) for r in requests])
                    assert len(outcome) == len(requests), f"join_together answered for {len(outcome)} of {len(requests)} requests"
                    assert all(e is None for e in outcome), f"join_together refused a request: {outcome}"
                else:
                    cast(Joinable, engine).join(batch, list(requests[0]))
                new = [row for request in requests for row in request]
                joined = range(len(out), len(out) + len(new))
                live += joined
                out += [[] for _ in new]
                if eager and step > 0:
                    firsts = cast(EagerJoin, engine).first_tokens(batch, [None] * len(new))
                    assert len(firsts) == len(new), f"first_tokens returned {len(firsts)} tokens for {len(new)} joined rows"
                    for index, token in zip(joined, firsts, strict=True):
                        out[index].append(int(token))
                    keep = [pos for pos, index in enumerate(live) if not _done(engine, out[index], budget)]
                    if len(keep) != len(live):
                        if keep or pending:
                            engine.retain(batch, keep)
                        live = [live[pos] for pos in keep]
                    if not live and not pending:
                        break
            tokens = engine.step(batch, [None] * len(live))
            assert len(tokens) == len(live), f"step returned {len(tokens)} tokens for {len(live)} live rows"
            for index, token in zip(live, tokens, strict=True):
                out[index].append(int(token))
            dropped = set(drop.get(step, ()))
            keep = [pos for pos, index in enumerate(live) if index not in dropped and not _done(engine, out[index], budget)]
            step += 1
            if len(keep) != len(live):
                if keep or pending:
                    engine.retain(batch, keep)
                live = [live[pos] for pos in keep]
    finally:
        engine.close(batch)
    return out


def _done(engine: Engine, tokens: Sequence[int], budget: int) -> bool:
    return len(tokens) >= budget or (bool(tokens) and tokens[-1] in engine.eos_token_ids)


class EngineConformance:
    """The engine contract as tests: subclass it as ``class TestMyEngine(EngineConformance)``.

    Fixtures the subclass (or its conftest) provides:

    - ``conformance_engine`` (required): a loaded :class:`~millm_core.engine.Engine`,
      ideally a tiny model; its scope is your choice (module or session scope loads it once).
      The tests open one batch at a time and close it before they return.
    - ``conformance_factory`` (optional): the :class:`~millm_core.engine.EngineFactory`
      your plugin registers (:func:`registered_factory` finds it). Without it the check that
      the declared capabilities equal the loaded engine's is skipped.

    Class attributes to adjust: ``PROMPTS`` (three texts of different token lengths, each
    running longer than ``JOIN_AFTER`` tokens before an EOS), ``MAX_NEW_TOKENS`` (the token
    budget of every row), ``JOIN_AFTER`` (steps before rows join or leave), ``SEED``.

    Tests of what the engine does not offer (not Joinable, EagerJoin, JoinTogether, a
    Scorer or an Embedder; no taps or rewind capability) are reported as skipped, saying
    why; override such a test in your subclass to assert the absence instead, if your
    suite counts skips. Capabilities may be :class:`~millm_core.engine.Capability` members
    or a third party's own names (strings). The suite runs in seconds on a tiny model on a CPU.
    """

    PROMPTS: tuple[str, str, str] = ("The capital of France is", "x", "def main():\n    return 42")
    MAX_NEW_TOKENS = 10
    JOIN_AFTER = 3
    SEED = 1234

    # ------------------------------------------------------------------ helpers

    def _prompts(self, engine: Engine) -> list[tuple[int, ...]]:
        return [tuple(engine.encode(text, add_special_tokens=True)) for text in self.PROMPTS]

    def _row(self, prompt: tuple[int, ...], sampling: SamplingParams = GREEDY) -> RowSpec:
        return RowSpec(prompt_ids=prompt, sampling=sampling, max_new_tokens=self.MAX_NEW_TOKENS)

    def _solo(self, engine: Engine, row: RowSpec) -> list[int]:
        return drive(engine, [row], self.MAX_NEW_TOKENS)[0]

    def _runs_past(self, solo: Sequence[int], steps: int) -> None:
        assert len(solo) > steps, f"a prompt of PROMPTS ended after {len(solo)} tokens: choose prompts that run longer than {steps}"

    @staticmethod
    def _factory(request: pytest.FixtureRequest) -> EngineFactory | None:
        try:
            factory = request.getfixturevalue("conformance_factory")
        except pytest.FixtureLookupError:
            return None
        return cast(EngineFactory | None, factory)

    # ------------------------------------------------------------------ generation

    def test_batch_equals_solo(self, conformance_engine: Engine) -> None:
        """Batch invariance: greedy rows of different prompt lengths stepped together get,
        row by row, exactly the tokens each gets alone."""
        engine = conformance_engine
        rows = [self._row(p) for p in self._prompts(engine)]
        assert len({len(r.prompt_ids) for r in rows}) > 1, "PROMPTS should have different token lengths"
        assert drive(engine, rows, self.MAX_NEW_TOKENS) == [self._solo(engine, r) for r in rows]

    def test_joined_row_equals_solo(self, conformance_engine: Engine) -> None:
        """Continuous batching: a row that joins a running batch after ``JOIN_AFTER`` steps
        gets its solo tokens, and the rows already running keep theirs."""
        engine = conformance_engine
        if not isinstance(engine, Joinable):
            pytest.skip("engine is not Joinable")
        running, joining = [self._row(p) for p in self._prompts(engine)[:2]], self._row(self._prompts(engine)[2])
        solo = [self._solo(engine, r) for r in [*running, joining]]
        for tokens in solo[:2]:
            self._runs_past(tokens, self.JOIN_AFTER)
        batch = engine.open_batch(running)
        try:
            fits = engine.can_join([joining])
        finally:
            engine.close(batch)
        if not fits:
            pytest.skip("the engine is Joinable but can_join refuses one row beside two (as loaded)")
        got = drive(engine, running, self.MAX_NEW_TOKENS, joins={self.JOIN_AFTER: [joining]})
        assert got[:2] == solo[:2], "the running rows changed when a row joined"
        assert got[2] == solo[2], "the joined row differs from its solo run"

    def test_joined_rows_drawn_at_join_equal_solo(self, conformance_engine: Engine) -> None:
        """:class:`~millm_core.engine.EagerJoin`: rows that join after ``JOIN_AFTER`` steps
        and draw their first token at once (one greedy, one seeded) get their solo tokens,
        and the rows already running keep theirs."""
        engine = conformance_engine
        if not isinstance(engine, EagerJoin):
            pytest.skip("engine is not EagerJoin")
        prompts = self._prompts(engine)
        running = [self._row(p) for p in prompts[:2]]
        joining = [self._row(prompts[2]), self._row(prompts[0], SamplingParams(temperature=1.0, seed=self.SEED))]
        solo = [self._solo(engine, r) for r in [*running, *joining]]
        for tokens in solo[:2]:
            self._runs_past(tokens, self.JOIN_AFTER + 1)
        got = drive(engine, running, self.MAX_NEW_TOKENS, joins={self.JOIN_AFTER: joining}, eager=True)
        assert got[:2] == solo[:2], "the running rows changed when rows joined and drew at once"
        assert got[2:] == solo[2:], "a row that drew its first token at join differs from its solo run"

    def test_requests_joined_together_equal_solo(self, conformance_engine: Engine) -> None:
        """:class:`~millm_core.engine.JoinTogether`: two requests (one of two seeded rows)
        joining in one call after ``JOIN_AFTER`` steps get the tokens each gets alone, and
        the row already running keeps its own. (An engine that is not JoinTogether is
        joined one request at a time, which the tests above cover.)"""
        engine = conformance_engine
        if not isinstance(engine, JoinTogether):
            pytest.skip("engine is not JoinTogether")
        prompts = self._prompts(engine)
        running = self._row(prompts[0])
        seeded = [SamplingParams(temperature=1.0, seed=self.SEED + i) for i in range(2)]
        requests = [[self._row(prompts[2])], [self._row(prompts[1], seeded[0]), self._row(prompts[2], seeded[1])]]
        solo = [self._solo(engine, running), *[row for request in requests for row in drive(engine, request, self.MAX_NEW_TOKENS)]]
        self._runs_past(solo[0], self.JOIN_AFTER + 1)
        got = drive(engine, [running], self.MAX_NEW_TOKENS, together={self.JOIN_AFTER: requests}, eager=isinstance(engine, EagerJoin))
        assert got[0] == solo[0], "the running row changed when requests joined together"
        assert got[1:] == solo[1:], "a request joined together with another differs from its run alone"

    def test_retain_frees_rows(self, conformance_engine: Engine) -> None:
        """``retain(keep=[1])`` after ``JOIN_AFTER`` steps leaves row 1 alone in the batch:
        each later step returns one token, and row 1's tokens equal its solo tokens."""
        engine = conformance_engine
        rows = [self._row(p) for p in self._prompts(engine)]
        solo = [self._solo(engine, r) for r in rows]
        for tokens in solo:
            self._runs_past(tokens, self.JOIN_AFTER + 1)
        # drive() asserts one token per live row at every step, so after the retain exactly one.
        got = drive(engine, rows, self.MAX_NEW_TOKENS, drop={self.JOIN_AFTER: [0, 2]})
        assert got[1] == solo[1]
        assert [got[0], got[2]] == [solo[0][: self.JOIN_AFTER + 1], solo[2][: self.JOIN_AFTER + 1]]

    def test_logit_bias_is_per_row(self, conformance_engine: Engine) -> None:
        """``step`` adds ``biases[i]`` to row i's logits only: a large bias forces row 0's
        token and leaves row 1's untouched."""
        engine = conformance_engine
        rows = [self._row(p) for p in self._prompts(engine)[:2]]
        solo = [self._solo(engine, r)[0] for r in rows]
        forced = next(
            t for t in range(engine.info.vocab_size // 2, engine.info.vocab_size) if t not in engine.eos_token_ids and t not in solo
        )
        batch = engine.open_batch(rows)
        try:
            tokens = engine.step(batch, [{forced: 1e4}, None])
        finally:
            engine.close(batch)
        assert tokens == [forced, solo[1]]

    # ------------------------------------------------------------------ sampling

    def test_seeded_sampling_is_a_function_of_seed_stream_position(self, conformance_engine: Engine) -> None:
        """A seeded row (temperature 1) gets the same tokens alone, beside other rows and
        at another row position; another seed, or another stream, changes them (for at
        least one of a few), so the sampler is neither constant nor ignoring the stream."""
        engine = conformance_engine
        prompts = self._prompts(engine)

        def seeded(seed: int = self.SEED, stream: int = 0) -> RowSpec:
            return self._row(prompts[0], SamplingParams(temperature=1.0, seed=seed, stream=stream))

        alone = self._solo(engine, seeded())
        neighbours = [self._row(prompts[1]), self._row(prompts[2], SamplingParams(temperature=1.0, seed=self.SEED + 99))]
        assert drive(engine, [seeded(), *neighbours], self.MAX_NEW_TOKENS)[0] == alone, "first in a batch"
        assert drive(engine, [*neighbours, seeded()], self.MAX_NEW_TOKENS)[2] == alone, "last in a batch"
        assert self._solo(engine, seeded()) == alone, "a second run alone"
        assert any(self._solo(engine, seeded(seed=self.SEED + k)) != alone for k in range(1, 5)), "the seed changes nothing"
        assert any(self._solo(engine, seeded(stream=k)) != alone for k in range(1, 5)), "the stream changes nothing"

    def test_temperature_zero_is_the_argmax(self, conformance_engine: Engine) -> None:
        """Greedy (temperature 0) picks the argmax of the engine's own next-token logits;
        each prompt's logits equal, exactly, those it gets scored alone."""
        engine = conformance_engine
        if not isinstance(engine, Scorer):
            # Nothing to compare with; then the engine must not claim scoring either.
            assert Capability.SCORING not in engine.capabilities, "SCORING declared by an engine that is not a Scorer"
            pytest.skip("the engine is not a Scorer: no logits of its own to compare the greedy draw with")
        prompts = self._prompts(engine)
        logits = engine.next_token_logits(prompts)
        for prompt, row_logits in zip(prompts, logits, strict=True):
            # A prompt's logits are a function of that prompt alone, never of its company.
            assert np.array_equal(np.asarray(engine.next_token_logits([prompt])[0]), np.asarray(row_logits)), "scores depend on the other prompts"
            values = [float(v) for v in row_logits]
            best = max(range(len(values)), key=values.__getitem__)
            assert drive(engine, [self._row(prompt)], 1)[0] == [best]

    # ------------------------------------------------------------------ declarations

    def test_capabilities_have_their_protocols(self, conformance_engine: Engine, request: pytest.FixtureRequest) -> None:
        """The engine satisfies :class:`Engine`, and each declared optional capability comes
        with its protocol (EMBEDDINGS: Embedder, SCORING: Scorer, STEERING: ResidualReader),
        on the loaded engine and in the factory's declaration."""
        engine = conformance_engine
        assert isinstance(engine, Engine)
        assert isinstance(engine.capabilities, frozenset), "capabilities must be a frozenset"
        # Capability members, or names of a third party's own (strings, as plugins.md says).
        odd = [c for c in engine.capabilities if not isinstance(c, str)]
        assert not odd, f"capabilities must be Capability members or names (strings): {odd!r}"
        assert all(isinstance(t, int) for t in engine.eos_token_ids)
        factory = self._factory(request)
        declared = engine.capabilities | (factory.capabilities if factory is not None else frozenset())
        missing = [c.value for c, protocol in PROTOCOLS.items() if c in declared and not isinstance(engine, protocol)]
        assert not missing, f"capabilities declared without their protocol: {missing}"

    def test_factory_declares_what_the_engine_can_do(self, conformance_engine: Engine, request: pytest.FixtureRequest) -> None:
        """The factory's capabilities (declared before loading, so refusals made from them
        happen before any model loads) equal the loaded engine's."""
        factory = self._factory(request)
        if factory is None:
            pytest.skip("no conformance_factory fixture")
        assert isinstance(factory, EngineFactory)
        assert factory.capabilities == conformance_engine.capabilities

    # ------------------------------------------------------------------ taps

    def _tapped(self, engine: Engine, rows: list[RowSpec], steps: int) -> list[list[Any]]:
        """Each row's readouts over ``steps`` steps (rows never retired)."""
        assert isinstance(engine, Tapping)
        batch = engine.open_batch(rows)
        reads: list[list[Any]] = [[] for _ in rows]
        try:
            for _ in range(steps):
                engine.step(batch, [None] * len(rows))
                for i, readout in enumerate(engine.readouts(batch)):
                    if readout is not None:
                        reads[i].append(readout)
        finally:
            engine.close(batch)
        return reads

    def test_taps_read_each_row_as_alone(self, conformance_engine: Engine) -> None:
        """An engine with ``taps``: tapped rows beside an untapped one read, step by step,
        their prompt then one position per step, ``[n, d_model]`` float32, equal to each
        row tapped alone (to 1e-5 of the vectors' scale); the untapped row reads nothing;
        the prompt's vectors equal :meth:`ResidualReader.residuals` when the engine has it
        (whose vectors for an input are, exactly, the same read alone or beside others)."""
        engine = conformance_engine
        if Capability.TAPS not in engine.capabilities:
            pytest.skip("the engine has no taps capability")
        tap = Tap(0, "post_steering")
        prompts = self._prompts(engine)
        rows = [msgspec.structs.replace(self._row(p), taps=(tap,) if i < 2 else ()) for i, p in enumerate(prompts)]
        steps = 4
        together = self._tapped(engine, rows, steps)
        assert together[2] == [], "a row without taps read something"
        for i in range(2):
            alone = self._tapped(engine, [rows[i]], steps)[0]
            assert [r.start for r in together[i]] == [0, *range(len(prompts[i]), len(prompts[i]) + steps - 1)]
            assert [r.start for r in alone] == [r.start for r in together[i]]
            for got, want in zip(together[i], alone, strict=True):
                vectors, reference = np.asarray(got.vectors[tap]), np.asarray(want.vectors[tap])
                assert vectors.dtype == np.float32 and vectors.shape[1] == engine.info.d_model
                scale = float(np.abs(reference).max())
                assert float(np.abs(vectors - reference).max()) <= 1e-5 * scale, "a tapped row reads differently in a batch"
            if isinstance(engine, ResidualReader):
                [prompt_vectors] = engine.residuals([prompts[i]], 0)
                # Exactly what it reads beside the other prompts: a function of the input alone.
                assert np.array_equal(engine.residuals(prompts, 0)[i], prompt_vectors), "residuals depend on the other inputs"
                scale = float(np.abs(prompt_vectors).max())
                assert float(np.abs(np.asarray(together[i][0].vectors[tap]) - prompt_vectors).max()) <= 1e-5 * scale

    # ------------------------------------------------------------------ rewind

    def _rewound(
        self, engine: Engine, rows: Sequence[RowSpec], steps: int, rewinds: Mapping[int, int], biases: Mapping[int, int] | None = None
    ) -> list[list[int]]:
        """Each row's tokens after ``steps`` steps, the rows stepped together. ``rewinds[s]``:
        after step ``s`` row 0 is rewound by that many tokens (they leave its list);
        ``biases[s]``: at step ``s`` row 0 gets a bias of -1e9 against that token."""
        out: list[list[int]] = [[] for _ in rows]
        batch = engine.open_batch(list(rows))
        try:
            for step in range(steps):
                banned = (biases or {}).get(step)
                tokens = engine.step(batch, [{banned: -1e9} if banned is not None else None] + [None] * (len(rows) - 1))
                for row, token in zip(out, tokens, strict=True):
                    row.append(int(token))
                if step in rewinds:
                    cast(Rewinding, engine).rewind(batch, 0, rewinds[step])
                    del out[0][-rewinds[step] :]
        finally:
            engine.close(batch)
        return out

    def test_rewind_takes_tokens_back(self, conformance_engine: Engine) -> None:
        """An engine with ``rewind``: a greedy and a seeded row stepped ``n`` times, rewound
        by ``k`` and stepped on with the same biases draw their tokens again (``k < n`` and
        ``k == n``, back to the prompt); with a bias against the token they would draw again
        they go on like a fresh run that drew ``n - k`` tokens and then got that bias; a row
        stepped beside them keeps its own tokens; ``k`` outside ``1..n`` raises ValueError."""
        engine = conformance_engine
        if Capability.REWIND not in engine.capabilities:
            pytest.skip("the engine has no rewind capability")
        assert isinstance(engine, Rewinding)
        prompts = self._prompts(engine)
        steps, n = self.MAX_NEW_TOKENS, self.JOIN_AFTER + 2
        neighbour = self._row(prompts[1])
        for sampling in (GREEDY, SamplingParams(temperature=1.0, seed=self.SEED)):
            row = self._row(prompts[0], sampling)
            fresh = self._rewound(engine, [row, neighbour], steps + n, {})
            for k in (2, n):
                # Were the rewind ignored, the row would go on with these instead:
                assert fresh[0][n - k : n] != fresh[0][n : 2 * n - k], "choose a prompt whose tokens do not repeat"
                again = self._rewound(engine, [row, neighbour], steps + k, {n - 1: k})
                assert again[0] == fresh[0][:steps], f"rewound by {k} after {n} tokens, the row did not draw its tokens again"
                assert again[1] == fresh[1][: steps + k], "a row beside a rewound one changed"
                redirected = self._rewound(engine, [row, neighbour], steps + k, {n - 1: k}, {n: fresh[0][n - k]})
                reference = self._rewound(engine, [row, neighbour], steps, {}, {n - k: fresh[0][n - k]})
                assert reference[0] != fresh[0][:steps], "a -1e9 bias changed nothing"
                assert redirected[0] == reference[0], f"rewound by {k} then biased, the row differs from a fresh run biased there"
                assert redirected[1] == fresh[1][: steps + k], "a row beside a rewound one changed"
        batch = engine.open_batch([self._row(prompts[0])])
        try:
            with pytest.raises(ValueError):
                engine.rewind(batch, 0, 1)  # nothing drawn yet
            engine.step(batch, [None])
            engine.step(batch, [None])
            for k in (0, 3, -1):
                with pytest.raises(ValueError):
                    engine.rewind(batch, 0, k)
        finally:
            engine.close(batch)

    # ------------------------------------------------------------------ embeddings

    def test_embeddings_do_not_depend_on_the_batch(self, conformance_engine: Engine) -> None:
        """Mean-pooled embeddings of a batch of inputs equal, exactly, each input embedded
        alone (an input's vector is a function of that input only), and are finite float
        vectors of length ``d_model``."""
        engine = conformance_engine
        if not isinstance(engine, Embedder) or Capability.EMBEDDINGS not in engine.capabilities:
            # Not an embedder (or loaded without it): then it must not claim embeddings.
            assert not (Capability.EMBEDDINGS in engine.capabilities and not isinstance(engine, Embedder))
            pytest.skip("the engine has no embeddings capability")
        inputs = self._prompts(engine)
        together = engine.embed(inputs, "mean")
        assert len(together) == len(inputs)
        for ids, vector in zip(inputs, together, strict=True):
            assert len(vector) == engine.info.d_model
            assert all(isinstance(v, float) and math.isfinite(v) for v in vector)
            [alone] = engine.embed([ids], "mean")
            worst = max(abs(a - b) for a, b in zip(vector, alone, strict=True))
            assert worst == 0, f"input of {len(ids)} tokens: batched and alone differ by {worst}"
