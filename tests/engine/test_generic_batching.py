"""Continuous batching on the generic HF forward (issue #15): a model without the lean decode
step — here a tiny Qwen2, biased q/k/v projections, plain ``DynamicCache`` layers — lets
requests join a running batch, and a greedy row's tokens are its solo tokens (float32)
whatever joins or leaves beside it. A model whose cache cannot be merged (a sliding-window
layer) runs one request at a time and says so. In bfloat16 every sampled logit is compared
bit for bit with the row's solo run. References: HF ``generate`` for solo greedy
text, single-row runs for rows in a batch, the scheduler's step counter for sharing."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import pytest
import torch

import millm_engines.transformers.engine as engine_module
from millm_core.api import Joinable, RowSpec, SamplingParams, ServedModel, Tap
from millm_core.config import load_settings
from millm_core.engine import ModelLocation, backend_of
from millm_engines.transformers.generic import join_refusal, layout_refusal
from millm_engines.transformers.loader import load_engine
from millm_engines.transformers.rows import install, possible
from millm_engines.transformers.sampler import sample
from millm_engines.transformers.testing import tiny_model_dir

from ..http.helpers import scheduler_stats
from .test_steering_rows import delta
from .test_taps import check_row
from .test_taps import run as run_tapped

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=77)
STEPS = 16
TEXTS = ["The capital of France is Paris, and the capital of Spain is", "hi", "import json\nimport os\n", "def f(x):", "Once upon a time"]


def _load(path: str, name: str, dtype: str = "float32") -> Any:
    return load_engine(ModelLocation(path=path, served_name=name), load_settings({"dtype": dtype}, environ={}))


@pytest.fixture(scope="session")
def qwen2_dir() -> str:
    return tiny_model_dir(architecture="qwen2")


@pytest.fixture(scope="session")
def sliding_dir() -> str:
    return tiny_model_dir(architecture="qwen2", sliding_window=64)


@pytest.fixture(scope="session")
def qwen2(qwen2_dir: str) -> Any:
    return _load(qwen2_dir, "tiny-qwen2")


@pytest.fixture(scope="session")
def sliding(sliding_dir: str) -> Any:
    return _load(sliding_dir, "tiny-sliding")


def spec(engine: Any, text: str, sampling: SamplingParams = GREEDY, **extra: Any) -> RowSpec:
    return RowSpec(prompt_ids=tuple(engine.encode(text, add_special_tokens=True)), sampling=sampling, **extra)


def drive(
    engine: Any,
    rows: Sequence[RowSpec],
    steps: int = STEPS,
    joins: Mapping[int, Sequence[RowSpec]] | None = None,
    rewinds: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    budget: Mapping[int, int] | None = None,
    orders: list[list[int]] | None = None,
    eager: bool = False,
    join_rewinds: Mapping[int, Sequence[tuple[int, int]]] | None = None,
) -> dict[int, list[int]]:
    """Step ``rows`` (ids 0..) as the scheduler does: ``joins[k]`` (one request's rows, the
    next ids) join before step k, and with ``eager`` draw their first token at once
    (``first_tokens``) when k > 0; a row is retired (``retain``) once it has drawn
    ``budget.get(id, steps)`` tokens; after step k, ``rewinds[k]`` takes back ``(id, n)``,
    and ``join_rewinds[k]`` likewise right after the first tokens drawn at join k.
    Returns each row's tokens; ``orders`` gets each draw's row ids, in batch order."""
    batch = engine.open_batch(rows)
    live = list(range(len(rows)))
    out: dict[int, list[int]] = {i: [] for i in live}

    def drawn(ids: list[int], tokens: list[int]) -> None:
        nonlocal live
        if orders is not None:
            orders.append(ids)
        for i, token in zip(ids, tokens, strict=True):
            out[i].append(token)
        keep = [p for p, i in enumerate(live) if len(out[i]) < (budget or {}).get(i, steps)]
        if len(keep) < len(live) and keep:
            engine.retain(batch, keep)
        live = [live[p] for p in keep]

    k = 0
    try:
        while live:
            for_step = (joins or {}).get(k, ())
            if for_step:
                assert engine.can_join(for_step)
                engine.join(batch, for_step)
                new = list(range(len(out), len(out) + len(for_step)))
                for i in new:
                    live.append(i)
                    out[i] = []
                if eager and k > 0:
                    drawn(new, engine.first_tokens(batch, [None] * len(new)))
                    for i, n in (join_rewinds or {}).get(k, ()):
                        engine.rewind(batch, live.index(i), n)
                        del out[i][-n:]
            drawn(list(live), engine.step(batch, [None] * len(live)))
            for i, n in (rewinds or {}).get(k, ()):
                engine.rewind(batch, live.index(i), n)
                del out[i][-n:]
            k += 1
    finally:
        engine.close(batch)
    return out


def solo(engine: Any, row: RowSpec, steps: int = STEPS) -> list[int]:
    return drive(engine, [row], steps)[0]


# ------------------------------------------------------------------ the decision


def test_a_plain_cache_model_joins_and_says_so(qwen2: Any) -> None:
    assert qwen2.model.config.model_type == "qwen2" and qwen2.fast is None  # the generic HF forward
    assert qwen2.join_refusal is None and qwen2.batches_requests
    assert isinstance(qwen2, Joinable) and qwen2.can_join([spec(qwen2, "hi")])
    assert not qwen2.can_join([spec(qwen2, "hi")] * (qwen2.max_rows + 1))
    assert qwen2.batch_invariant and backend_of(qwen2) == "batched"


def test_a_sliding_window_model_runs_alone_and_says_so(sliding: Any) -> None:
    assert sliding.fast is None
    assert sliding.join_refusal is not None and "DynamicSlidingWindowLayer" in sliding.join_refusal
    assert not sliding.batches_requests and not sliding.can_join([spec(sliding, "hi")])
    assert backend_of(sliding) == "serial"
    batch = sliding.open_batch([spec(sliding, "hi")])
    try:
        sliding.step(batch, [None])
        with pytest.raises(ValueError, match="cannot join"):
            sliding.join(batch, [spec(sliding, "import json")])
        assert len(sliding.step(batch, [None])) == 1  # the running batch is untouched
    finally:
        sliding.close(batch)


def test_prefix_reuse_is_on_where_rows_are_prefilled_alone(qwen2: Any, sliding: Any) -> None:
    """The prefix cache (on by default) stays with a model whose rows join batches and is
    dropped, with the reason logged, for a serial model (its rows prefill padded together)."""
    assert qwen2.prefix is not None and qwen2.prefix_refusal is None
    assert sliding.prefix is None and sliding.prefix_refusal is not None and "cannot join" in sliding.prefix_refusal


def test_a_plain_cache_model_resumes_prompts_exactly(qwen2: Any, qwen2_dir: str) -> None:
    """Tiny Qwen2 on the generic forward: a prompt sharing two whole chunks with an earlier
    one resumes them, and its tokens and first logits are those of an engine without the
    cache."""
    from millm_engines.transformers.settings import PREFIX_CACHE_MB

    from .test_prefix_cache import row, same, solo, system

    off = load_engine(
        ModelLocation(path=qwen2_dir, served_name="tiny-qwen2-no-prefix"),
        load_settings({"prefix_cache_mb": 0}, environ={}, plugin_settings=[PREFIX_CACHE_MB]),
    )
    assert off.prefix is None
    qwen2.prefix.clear()
    head = system(qwen2, 300)
    first, second = head + tuple(qwen2.encode("\n# one", add_special_tokens=False)), head + tuple(qwen2.encode("\n# two", add_special_tokens=False))
    cold, warm = solo(qwen2, row(first)), solo(qwen2, row(second))
    assert (cold["resumed"], warm["resumed"]) == (0, 256)
    assert same(cold, solo(off, row(first))) and same(warm, solo(off, row(second)))


def test_a_serial_models_request_of_several_rows_runs_together(sliding: Any) -> None:
    """Rows of one request on a model whose cache cannot be merged (``n`` > 1, or
    conversations of different lengths) prefill together in one padded pass: identical
    rows are the solo row, and a longer row beside a shorter one keeps its solo tokens."""
    row, short = spec(sliding, TEXTS[0]), spec(sliding, TEXTS[1])
    alone = solo(sliding, row, 6)
    assert drive(sliding, [row, row], steps=6) == {0: alone, 1: alone}
    got = drive(sliding, [row, short], steps=6)
    assert got[0] == alone and len(got[1]) == 6


def test_rows_attention_is_possible_only_where_a_model_can_switch_to_it() -> None:
    from transformers import FalconConfig, Qwen2Config

    assert possible(Qwen2Config(num_hidden_layers=2).to_dict())
    assert not possible({**Qwen2Config(num_hidden_layers=2).to_dict(), "attn_implementation": "eager"})
    assert not possible({**Qwen2Config(num_hidden_layers=2).to_dict(), "attn_logit_softcapping": 50.0})
    assert not possible(FalconConfig().to_dict())  # SDPA, but not through AttentionInterface


def test_the_decision_refuses_every_layout_it_cannot_merge() -> None:
    from transformers import AutoModelForCausalLM, MambaConfig, MistralConfig, Qwen2Config, RwkvConfig, T5Config

    assert layout_refusal(Qwen2Config(num_hidden_layers=2)) is None
    assert "DynamicSlidingWindowLayer" in str(layout_refusal(MistralConfig(num_hidden_layers=2, sliding_window=64)))
    assert "LinearAttentionLayer" in str(layout_refusal(MambaConfig(num_hidden_layers=2)))  # recurrent/conv state
    assert "encoder-decoder" in str(layout_refusal(T5Config()))
    # A recurrent model whose config looks plain: the load-time forward finds no key/value columns.
    rwkv = AutoModelForCausalLM.from_config(
        RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)
    )
    assert layout_refusal(rwkv.config) is None and join_refusal(rwkv) is not None


# ------------------------------------------------------------------ joined rows are exact (float32)


def test_a_solo_row_matches_hf_generate(qwen2: Any) -> None:
    row = spec(qwen2, TEXTS[0])
    with torch.no_grad():
        ref = qwen2.model.generate(torch.tensor([row.prompt_ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert solo(qwen2, row) == ref[0, len(row.prompt_ids) :].tolist()


@pytest.mark.parametrize("first,joiner", [(0, 1), (1, 0)], ids=["short-joins-long", "long-joins-short"])
def test_a_row_joining_mid_decode_and_the_running_row_keep_their_solo_tokens(qwen2: Any, first: int, joiner: int) -> None:
    a, b = spec(qwen2, TEXTS[first]), spec(qwen2, TEXTS[joiner])
    assert len(a.prompt_ids) != len(b.prompt_ids)
    got = drive(qwen2, [a], joins={4: [b]})
    assert got == {0: solo(qwen2, a), 1: solo(qwen2, b)}


def test_several_joins_and_retirements_keep_every_row_exact(qwen2: Any) -> None:
    rows = [spec(qwen2, t) for t in TEXTS]
    pair = [spec(qwen2, "The weather today"), spec(qwen2, "1, 2, 3, 4, 5, 6, 7, 8,", SEEDED)]  # one request, two lengths
    budget = {0: 5, 1: STEPS, 2: 9, 3: STEPS, 4: 3, 5: STEPS, 6: 12}  # row 0, the longest prompt, leaves first
    order = [*rows[:2], rows[2], *pair, rows[3], rows[4]]  # ids 0, 1, 2, 3-4 (the pair), 5, 6
    expected = {i: solo(qwen2, r, budget.get(i, STEPS)) for i, r in enumerate(order)}
    for eager in (False, True):  # joined rows' first tokens drawn with the next step, or at once
        got = drive(qwen2, rows[:2], joins={2: [rows[2]], 3: pair, 6: [rows[3]], 7: [rows[4]]}, budget=budget, eager=eager)
        assert got == expected, f"eager={eager}"


def test_identical_rows_joining_at_different_steps_get_identical_tokens(qwen2: Any) -> None:
    row = spec(qwen2, TEXTS[2])
    got = drive(qwen2, [row], joins={k: [row] for k in range(1, 6)})
    assert all(tokens == solo(qwen2, row) for tokens in got.values())


def test_steered_and_tapped_rows_join_exactly(qwen2: Any) -> None:
    steered = spec(qwen2, TEXTS[3], deltas={1: delta(qwen2, 5)})
    assert solo(qwen2, steered) != solo(qwen2, spec(qwen2, TEXTS[3]))  # the delta changes the text
    got = drive(qwen2, [spec(qwen2, TEXTS[4])], joins={3: [steered]})
    assert got[1] == solo(qwen2, steered)
    first = spec(qwen2, TEXTS[4], taps=(Tap(1, "post_steering"),))
    joiner = spec(qwen2, TEXTS[0], deltas={1: delta(qwen2, 6)}, taps=(Tap(0, "post_steering"), Tap(1, "pre_steering")))
    rec = run_tapped(qwen2, [first], steps=9, joins={2: [spec(qwen2, "hi"), joiner]})
    check_row(qwen2, rec, 0, first)
    check_row(qwen2, rec, 2, joiner)
    assert rec.reads[1] == [] and rec.tokens[2] == solo(qwen2, joiner, len(rec.tokens[2]))


def test_rewinds_of_joined_and_running_rows_stay_exact(qwen2: Any) -> None:
    """A joined row taken back partway, a running row taken back to its prompt: each goes on
    as if the tokens had never been drawn (greedy: it draws them again)."""
    a, b = spec(qwen2, TEXTS[0]), spec(qwen2, TEXTS[2])
    expected = {0: solo(qwen2, a), 1: solo(qwen2, b)}
    assert drive(qwen2, [a], joins={2: [b]}, rewinds={4: [(0, 5)], 6: [(1, 3)]}) == expected
    # Drawn at join: the joined row taken back to its prompt right after its first token
    # (before any step), and to its prompt again two steps later; the running row partway.
    got = drive(qwen2, [a], joins={2: [b]}, join_rewinds={2: [(1, 1)]}, rewinds={3: [(1, 2)], 6: [(0, 4)]}, eager=True)
    assert got == expected


@pytest.fixture(scope="session")
def qwen2_bf16(qwen2_dir: str) -> Any:
    return _load(qwen2_dir, "tiny-qwen2-bf16", "bfloat16")


def sampled_logits(engine: Any, monkeypatch: pytest.MonkeyPatch, rows: Sequence[RowSpec], **how: Any) -> dict[int, list[torch.Tensor]]:
    """:func:`drive` ``rows``, recording per row id the logits each of its draws was
    sampled from (the engine's own sampling call, observed on the way through)."""
    seen: list[torch.Tensor] = []

    def observed(logits: torch.Tensor, *args: Any) -> list[int]:
        seen.append(logits.detach().clone())
        return sample(logits, *args)

    monkeypatch.setattr(engine_module, "sample", observed)
    orders: list[list[int]] = []
    tokens = drive(engine, rows, orders=orders, **how)
    monkeypatch.undo()
    out: dict[int, list[torch.Tensor]] = {i: [] for i in tokens}
    for logits, order in zip(seen, orders, strict=True):
        for position, i in enumerate(order):
            out[i].append(logits[position])
    # A rewound row's taken-back draws are gone from its tokens: keep the draws it kept.
    return {i: [logits for logits in out[i]][-len(tokens[i]) :] if tokens[i] else [] for i in out}


@pytest.mark.parametrize("eager", [False, True], ids=["drawn-with-the-step", "drawn-at-join"])
def test_bfloat16_rows_keep_their_solo_logits_bit_for_bit(qwen2_bf16: Any, monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """In bfloat16, rows of different lengths — one request's pair, rows joining a running
    batch (their first token drawn with the next step, or at once), retirements — are
    sampled from exactly the logits they get alone: every row attends over its own cache
    columns (millm_engines.transformers.rows), and is prefilled on its own."""
    engine = qwen2_bf16
    assert engine.fast is None and engine.rows_refusal is None and engine.batch_invariant
    assert backend_of(engine) == "batched"
    rows = [spec(engine, t) for t in TEXTS]
    pair = [spec(engine, "The weather today"), spec(engine, "1, 2, 3, 4, 5, 6, 7, 8,", SEEDED)]  # one request, two lengths
    budget = {0: 5, 2: 9, 4: 3, 6: 12}
    joins = {2: [rows[2]], 3: pair, 6: [rows[3]], 7: [rows[4]]}
    got = sampled_logits(engine, monkeypatch, rows[:2], joins=joins, budget=budget, eager=eager)
    order = [*rows[:2], rows[2], *pair, rows[3], rows[4]]
    for i, row in enumerate(order):
        alone = sampled_logits(engine, monkeypatch, [row], steps=budget.get(i, STEPS))[0]
        assert len(got[i]) == len(alone) and all(torch.equal(a, b) for a, b in zip(got[i], alone, strict=True)), f"row {i}"


def test_without_rows_attention_a_padded_bfloat16_row_drifts(qwen2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the attention function exists: with transformers' own SDPA over the padded,
    masked cache, a short row beside a longer one is sampled from other logits than alone
    (so the test above can fail)."""
    engine = _load(qwen2_dir, "tiny-qwen2-bf16-sdpa", "bfloat16")
    engine.model.set_attn_implementation("sdpa")
    short, long = spec(engine, TEXTS[3]), spec(engine, TEXTS[0])  # 6 and 26 tokens: 0.1 apart within 12 steps
    got = sampled_logits(engine, monkeypatch, [short, long], steps=12)
    alone = sampled_logits(engine, monkeypatch, [short], steps=12)[0]
    assert not all(torch.equal(a, b) for a, b in zip(got[0], alone, strict=True))


def test_a_model_not_attending_with_sdpa_keeps_its_attention_and_says_so(qwen2_dir: str, make_server: Any) -> None:
    """Eager attention (soft-capping, sinks) is not switched; such a model in bfloat16 joins
    batches but reports them as not invariant."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.bfloat16, attn_implementation="eager")
    reason = install(model)
    assert reason is not None and "eager" in reason and model.config._attn_implementation == "eager"
    engine = _load(qwen2_dir, "tiny-qwen2-bf16-eager", "bfloat16")
    engine.model.set_attn_implementation("eager")
    engine.rows_refusal = install(engine.model)
    assert engine.batches_requests and not engine.batch_invariant
    assert backend_of(engine) == "batched;invariant=?0"
    got = drive(engine, [spec(engine, TEXTS[0])], steps=6, joins={2: [spec(engine, TEXTS[1])]})
    assert [len(t) for t in got.values()] == [6, 6]
    with make_server(models=[ServedModel(info=engine.info, engine=engine)]) as srv:  # its only model batches, not invariantly
        report = httpx.get(srv.base_url + "/api/health/inference").json()
    assert report["models"] == {"tiny-qwen2-bf16-eager": "batched;invariant=?0"} and report["backend"] == "batched"


# ------------------------------------------------------------------ over HTTP


def _complete(base_url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def _at_once(base_url: str, model: str, prompts: list[str]) -> tuple[list[str], dict[str, int]]:
    """The texts of ``prompts`` sent together, and the scheduler's steps and tokens for them."""
    before = scheduler_stats(base_url)
    texts = [""] * len(prompts)

    def one(i: int) -> None:
        texts[i] = str(_complete(base_url, model, prompts[i]).json()["choices"][0]["text"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    after = scheduler_stats(base_url)
    return texts, {key: after[key] - before[key] for key in ("steps", "generated_tokens")}


def test_concurrent_requests_on_a_non_llama_model_share_steps_and_keep_their_text(make_server: Any, qwen2: Any, sliding: Any) -> None:
    models = [ServedModel(info=e.info, engine=e) for e in (qwen2, sliding)]
    prompts = [f"Item {i}: the sea" for i in range(3)] + ["import json"]
    with make_server(models=models) as srv:
        report = httpx.get(srv.base_url + "/api/health/inference").json()
        assert report["models"] == {"tiny-qwen2": "batched", "tiny-sliding": "serial"} and report["backend"] == "batched"
        assert _complete(srv.base_url, "tiny-qwen2", "hi").headers["x-millm-backend"] == "batched"
        assert _complete(srv.base_url, "tiny-sliding", "hi").headers["x-millm-backend"] == "serial"

        alone = [str(_complete(srv.base_url, "tiny-qwen2", p).json()["choices"][0]["text"]) for p in prompts]
        texts, counts = _at_once(srv.base_url, "tiny-qwen2", prompts)
        assert texts == alone
        assert counts["steps"] < counts["generated_tokens"]  # rows of different requests shared steps

        alone = [str(_complete(srv.base_url, "tiny-sliding", p).json()["choices"][0]["text"]) for p in prompts[:3]]
        texts, counts = _at_once(srv.base_url, "tiny-sliding", prompts[:3])
        assert texts == alone
        assert counts["steps"] == counts["generated_tokens"]  # one request at a time
