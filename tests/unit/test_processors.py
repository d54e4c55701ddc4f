"""Stop sequences and penalties, as pure token processors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from millm_plugins.sampling.processors import Penalties, StopSequences

alphabet = st.sampled_from("abc d\n")


def _run(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    proc = StopSequences(stops)
    out = []
    for chunk in chunks:
        text, stop = proc.on_token(0, chunk)
        out.append(text)
        if stop:
            return "".join(out), True
    return "".join(out) + proc.flush(), False


def _reference(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4),
    chunks=st.lists(st.text(alphabet, max_size=5), max_size=12),
)
def test_stop_matches_reference_for_any_chunking(stops: list[str], chunks: list[str]) -> None:
    """However the text is cut into tokens, the emitted text is the text before the first
    stop sequence, and a stop is reported exactly when one occurs."""
    emitted, stopped = _run(stops, chunks)
    expected, expect_stop = _reference(stops, "".join(chunks))
    assert stopped == expect_stop
    assert emitted == expected


@given(
    stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4),
    chunks=st.lists(st.text(alphabet, max_size=5), max_size=12),
)
def test_no_emitted_prefix_ever_contains_a_stop(stops: list[str], chunks: list[str]) -> None:
    """Streaming safety: at no point has text containing a stop sequence been emitted."""
    proc = StopSequences(stops)
    emitted = ""
    for chunk in chunks:
        text, stop = proc.on_token(0, chunk)
        emitted += text
        assert not any(s in emitted for s in stops)
        if stop:
            break


def test_stop_split_across_tokens_is_held_then_dropped() -> None:
    proc = StopSequences(["END"])
    assert proc.on_token(0, "hello E") == ("hello ", False)
    assert proc.on_token(0, "N") == ("", False)
    assert proc.on_token(0, "D tail") == ("", True)


def test_empty_stop_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopSequences([""])


def test_penalties_follow_openai_formula() -> None:
    proc = Penalties(frequency=0.5, presence=0.25)
    assert proc.logit_bias() is None
    for token in (3, 3, 7):
        proc.on_token(token, "x")
    assert proc.logit_bias() == {3: -(0.5 * 2 + 0.25), 7: -(0.5 * 1 + 0.25)}
    proc.on_token(-1, "text only")  # text-only calls (flush path) are not tokens
    assert proc.logit_bias() == {3: -1.25, 7: -0.75}
