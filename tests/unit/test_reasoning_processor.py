"""The reasoning processor at the ends of a row's tokens, driven directly with token texts:
what is reasoning when the row runs out inside a close the plugin forces, or draws its end
of turn as its very last token."""

from __future__ import annotations

from millm_plugins.reasoning.markers import ReasoningFormat
from millm_plugins.reasoning.processor import Reasoning, RowPolicy

# Token ids stand for texts here: 10-12 the close "\n", "</", "think>" (13: the blank line).
FMT = ReasoningFormat(open="<think>", close="</think>", open_ids=(1,), close_ids=(11, 12, 13), close_nl_ids=(10, 11, 12, 13), gap_ids=(13,))
TEXT = {10: "\n", 11: "</", 12: "think>", 13: "\n\n"}


def _row(budget: int | None = None) -> Reasoning:
    return Reasoning(FMT, "reasoning", RowPolicy(budget=budget, redirect=True, guard=None))


def _draw(proc: Reasoning, token: int, text: str) -> None:
    proc.on_token(token, text)


def _reasoning(proc: Reasoning) -> str:
    proc.flush()
    return (proc.side_text() or {}).get("reasoning_content", "")


def test_a_close_cut_short_leaves_none_of_itself_and_all_of_the_reasoning() -> None:
    for drawn in range(0, 3):  # none, "\n", "\n</" of the forced close
        proc = _row(budget=2)
        _draw(proc, 100, "a <")
        _draw(proc, 101, " </")  # the budget is spent: the close is forced from here
        for token in FMT.close_nl_ids[:drawn]:
            assert proc.logit_bias() == {token: 30000.0}
            _draw(proc, token, TEXT[token])
        assert _reasoning(proc) == "a < </", drawn  # the model's own "</" stays


def test_bytes_the_decoder_held_back_come_with_the_close_and_stay_reasoning() -> None:
    proc = _row(budget=1)
    _draw(proc, 100, "")  # an incomplete character: the decoder holds it
    _draw(proc, 10, "é\n")  # released with the forced newline
    assert _reasoning(proc) == "é"


def test_an_end_of_turn_as_the_last_token_ends_by_length() -> None:
    proc = _row()
    _draw(proc, 100, "thinking")
    end = proc.end("stop")  # the end of turn could not be redirected: no tokens left
    assert end is not None and end.finish_reason == "length"
    closed = _row()
    for token, text in ((100, "x"), (10, "\n"), (11, "</"), (12, "think>"), (200, "answer")):
        _draw(closed, token, text)
    assert closed.end("stop").finish_reason is None  # type: ignore[union-attr]  # answered: a stop is a stop


def test_an_opening_the_model_writes_again_is_not_reasoning() -> None:
    """A model whose prompt opened the block may write the opening itself too (SmolLM2 does
    with the think template): that marker is dropped, split over tokens or not; text that
    only begins like it stays."""
    for pieces in (["<think>", "\nhello"], ["<th", "ink>", "\n", "hello"], ["\n<think>hello"]):
        proc = _row()
        for i, piece in enumerate(pieces):
            _draw(proc, 100 + i, piece)
        assert _reasoning(proc) == "hello", pieces
    proc = _row()
    for i, piece in enumerate(["<", "th", "ought", " <think> later"]):
        _draw(proc, 100 + i, piece)
    assert _reasoning(proc) == "<thought <think> later"


def test_blanks_before_a_repeated_opening_and_a_budget_spent_while_holding() -> None:
    proc = _row()
    for i, piece in enumerate(["  ", "<think>", "hi"]):
        _draw(proc, 100 + i, piece)
    assert _reasoning(proc) == "hi"
    # The budget is spent on a token that may still begin an opening: the close is forced anyway.
    spent = _row(budget=1)
    _draw(spent, 100, "<")  # held: it may begin "<think>"
    assert spent.logit_bias() == {FMT.close_nl_ids[0]: 30000.0}
    assert _reasoning(spent) == "<"  # the row ends: what was held is reasoning after all
