"""RowDriver with a row owner: what the processors after it see, taking tokens back, an
end of turn taken over, and the decoder's rewind (a multi-byte character split across
tokens included)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from millm_core.detokenize import Detokenizer
from millm_core.rows import RowDriver
from millm_plugins.sampling.processors import Penalties, StopSequences

# id -> bytes: 0 is EOS; 7 and 8 are the two halves of "é".
VOCAB = {0: b"", 1: b"a", 2: b"b", 3: b"<", 4: b">", 5: b" ", 7: b"\xc3", 8: b"\xa9"}


def decode(ids: Sequence[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class Owner:
    """Owns the row until it sees '>'; takes back its latest token when asked to; turns
    the first end of turn into a taken-back token."""

    def __init__(self) -> None:
        self.owning = True
        self.taking = 0
        self.seen: list[int] = []
        self.turns = 0
        self.side = ""

    def owns_row(self) -> bool:
        return self.owning

    def logit_bias(self) -> dict[int, float]:
        return {1: 1.0}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.seen.append(token_id)
        if self.owning:
            if text == ">":
                self.owning = False
                return "", False
            self.side += text
            return "", False
        return text, False

    def side_text(self) -> dict[str, str] | None:
        out, self.side = self.side, ""
        return {"reasoning_content": out} if out else None

    def take_back(self) -> int:
        out, self.taking = self.taking, 0
        return out

    def end_of_turn(self, token_id: int) -> bool:
        self.turns += 1
        return self.turns == 1

    def flush(self) -> str:
        return ""


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []
        self.rewound: list[int] = []

    def logit_bias(self) -> dict[int, float]:
        return {2: 1.0}

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self.seen.append((token_id, text))
        return text, False

    def on_rewind(self, k: int) -> None:
        self.rewound.append(k)

    def flush(self) -> str:
        return ""


def driver(*procs: object, budget: int = 50) -> RowDriver:
    return RowDriver(0, decode=decode, processors=procs, eos_token_ids=frozenset({0}), max_new_tokens=budget)  # type: ignore[arg-type]


def test_the_processors_after_an_owner_see_only_what_it_lets_go() -> None:
    owner, after, penalties = Owner(), Recorder(), Penalties(1.0, 0.0)
    row = driver(owner, after, penalties)
    assert row.bias() == {1: 1.0}  # the recorder is hidden; penalties have nothing yet
    events = [row.accept(t) for t in (1, 2, 4, 1, 2)]
    assert [e.side for e in events[:3]] == [{"reasoning_content": "a"}, {"reasoning_content": "b"}, None]
    assert "".join(e.text for e in events) == "ab"
    assert after.seen == [(1, "a"), (2, "b")]  # nothing of the owned tokens, not even their ids
    # Owner +1 on 1, recorder +1 on 2, penalties -count on every token drawn (4 included).
    assert row.bias() == {1: 1.0 - 2.0, 2: 1.0 - 2.0, 4: -1.0}


def test_taking_back_forgets_text_and_tells_processors_that_saw_the_tokens() -> None:
    before, owner, after, penalties = Recorder(), Owner(), Recorder(), Penalties(1.0, 0.0)
    row = driver(before, owner, after, penalties)
    row.accept(1)
    owner.taking = 1
    event = row.accept(7)  # half of "é": no text yet
    assert (event.rewind, before.rewound, after.rewound) == (1, [1], [])
    assert penalties.logit_bias() == {1: -1.0}  # the taken-back token no longer counts
    # The decoder forgot the half character: the next token decodes on its own.
    assert row.accept(2).side == {"reasoning_content": "b"}


def test_an_end_of_turn_an_owner_takes_over_is_taken_back_once() -> None:
    owner = Owner()
    row = driver(owner)
    row.accept(1)
    first = row.accept(0)
    assert (first.finish_reason, first.rewind, first.text) == (None, 1, "")
    second = row.accept(0)
    assert second.finish_reason == "stop"
    assert owner.seen == [1]  # an end of turn never reaches on_token


def test_no_end_of_turn_is_taken_over_on_the_budgets_last_token() -> None:
    owner = Owner()
    row = driver(owner, budget=2)
    row.accept(1)
    assert row.accept(0).finish_reason == "stop"
    assert owner.turns == 0


def test_stop_sequences_never_match_inside_an_owned_span() -> None:
    row = driver(Owner(), StopSequences(["ab"]))
    events = [row.accept(t) for t in (1, 2, 4, 1, 1, 2)]  # "ab" owned, then "aab" answered
    assert [e.finish_reason for e in events] == [None] * 5 + ["stop"]
    assert "".join(e.text for e in events) == "a"


@pytest.mark.parametrize("split", [1, 2, 3])
def test_the_decoder_rewinds_to_exactly_what_it_had_emitted(split: int) -> None:
    tokens = [1, 7, 8, 2, 1]
    detok = Detokenizer(decode, history=8)
    emitted = [detok.push(t) for t in tokens]
    detok.rewind(len(tokens) - split)
    fresh = Detokenizer(decode)
    expected = [fresh.push(t) for t in tokens[:split]]
    assert emitted[:split] == expected
    assert [detok.push(t) for t in (2, 2)] == [fresh.push(t) for t in (2, 2)]
    assert detok.flush() == fresh.flush()
    with pytest.raises(ValueError, match="at most"):
        Detokenizer(decode, history=2).rewind(1)
