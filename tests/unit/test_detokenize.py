"""Incremental detokenisation equals decoding everything at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from millm_core.detokenize import Detokenizer


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(tiny_engine, data) -> None:  # type: ignore[no-untyped-def]
    vocab = tiny_engine.info.vocab_size
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=vocab - 1), max_size=40))
    detok = Detokenizer(tiny_engine.decode)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tiny_engine.decode(ids)


def test_multibyte_characters_are_not_split(tiny_engine) -> None:  # type: ignore[no-untyped-def]
    # Byte-level BPE splits these characters over several tokens; no delta may carry a
    # replacement character for a character that is later completed.
    ids = tiny_engine.encode("café 東京 🙂 naïve", add_special_tokens=False)
    detok = Detokenizer(tiny_engine.decode)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "café 東京 🙂 naïve"
