"""RowDriver: EOS, budget, processor chaining and flushing of held-back text."""

from __future__ import annotations

from millm_core.rows import RowDriver
from millm_plugins.sampling.processors import StopSequences

# A toy vocabulary: id -> text; 0 is EOS.
VOCAB = {0: "", 1: "ab", 2: "c", 3: "END", 4: "E", 5: "ND", 6: " x"}


def decode(ids) -> str:  # type: ignore[no-untyped-def]
    return "".join(VOCAB[i] for i in ids)


def drive(tokens: list[int], stops: list[str] | None = None, budget: int = 100) -> tuple[str, str | None, int]:
    procs = [StopSequences(stops)] if stops else []
    driver = RowDriver(0, decode=decode, processors=procs, eos_token_ids=frozenset({0}), max_new_tokens=budget)
    text = ""
    for tok in tokens:
        event = driver.accept(tok)
        text += event.text
        if event.finish_reason:
            return text, event.finish_reason, driver.generated
    return text, None, driver.generated


def test_eos_stops_without_text() -> None:
    assert drive([1, 2, 0, 1]) == ("abc", "stop", 3)


def test_budget_gives_length() -> None:
    assert drive([1, 2, 1, 2], budget=3) == ("abcab", "length", 3)


def test_stop_across_tokens_in_driver() -> None:
    assert drive([1, 4, 5, 6], stops=["END"]) == ("ab", "stop", 3)


def test_text_held_for_a_possible_stop_is_released_at_eos() -> None:
    # "E" might start "END"; EOS arrives instead, so the held "E" must still be emitted.
    assert drive([1, 4, 0], stops=["END"]) == ("abE", "stop", 3)


def test_text_held_for_a_possible_stop_is_released_at_budget() -> None:
    assert drive([1, 4], stops=["END"], budget=2) == ("abE", "length", 2)
