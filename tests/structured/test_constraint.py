"""The JSON constraint on a real tokenizer (the tiny test model's byte-level BPE): random
walks through the allowed tokens always end in a document that validates; the repairs
to lm-format-enforcer's parser; failures end the row instead of raising; the on-disk
vocabulary cache."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmformatenforcer import CharacterLevelParser, LMFormatEnforcerException, StringParser

from millm_plugins.structured.constraint import MAX_CONSECUTIVE_WHITESPACE, JsonConstraint, lower, parser_for
from millm_plugins.structured.schema import check_schema, validate
from millm_plugins.structured.vocab import (
    VocabData,
    build_regular_tokens,
    decoder_for,
    fingerprint,
    make_tokenizer_data,
    tokenizer_data,
)

from .test_schema_subset import enforced_schemas, subset_schemas

MAX_STEPS = 400


class TokenizerEngine:
    """The engine surface the constraint reads (``encode``/``decode``/``info.vocab_size``/
    ``eos_token_ids``) over a transformers tokenizer, with the transformers engine's calls."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = SimpleNamespace(vocab_size=vocab_size or len(tokenizer))
        self.eos_token_ids = frozenset([tokenizer.eos_token_id])

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


@pytest.fixture(scope="module")
def tiny() -> TokenizerEngine:
    from transformers import AutoTokenizer

    from millm_engines.transformers.testing import tiny_model_dir

    return TokenizerEngine(AutoTokenizer.from_pretrained(tiny_model_dir()))


@pytest.fixture(scope="module")
def vocab(tiny: TokenizerEngine) -> VocabData:
    return tokenizer_data(tiny, None)


def _texts(vocab: VocabData) -> dict[int, str]:
    return {token_id: text for token_id, text, _ in vocab.regular_tokens}


def walk(
    vocab: VocabData, eos: frozenset[int], schema: dict[str, Any] | None, rnd: random.Random, suffix: str = ""
) -> tuple[list[int], bool, JsonConstraint]:
    """Draws allowed tokens until eos or MAX_STEPS: eos when allowed half the time, else a
    token that closes something (a quote, bracket or comma) 30% of the time, else any
    allowed token. Returns (ids without eos, whether eos ended it, the constraint)."""
    texts = _texts(vocab)
    constraint = JsonConstraint(vocab.data, parser_for(schema, suffix))
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        allowed = constraint.allowed_tokens()
        assert isinstance(allowed, np.ndarray) and allowed.dtype == np.int64 and allowed.ndim == 1
        choices = sorted(set(allowed.tolist()))  # the enforcer's order depends on str hashing
        ending = [t for t in choices if t in eos]
        if ending and rnd.random() < 0.5:
            constraint.on_token(ending[0], "")
            return ids, True, constraint
        closing = [t for t in choices if t in texts and any(c in texts[t] for c in '"]},')]
        token = rnd.choice(closing if closing and rnd.random() < 0.3 else choices)
        if token in eos:
            constraint.on_token(token, "")
            return ids, True, constraint
        text, stop = constraint.on_token(token, "x")
        assert (text, stop) == ("x", False)
        ids.append(token)
    return ids, False, constraint


# ---------------------------------------------------------------- random walks


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=enforced_schemas(), rnd=st.randoms(use_true_random=False))
def test_random_walks_end_in_a_document_that_validates(
    tiny: TokenizerEngine, vocab: VocabData, schema: dict[str, Any], rnd: random.Random
) -> None:
    check_schema(schema)
    ids, ended, constraint = walk(vocab, tiny.eos_token_ids, schema, rnd)
    assert not constraint.failed, (constraint.reason, tiny.decode(ids), json.dumps(schema))
    if ended:
        text = tiny.decode(ids)
        assert validate(text, schema) is None, (text, lower(schema))


def _without_bounds(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_bounds(v) for k, v in node.items() if k not in ("minimum", "maximum")}
    if isinstance(node, list):
        return [_without_bounds(v) for v in node]
    return node


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=subset_schemas(), rnd=st.randoms(use_true_random=False))
def test_every_schema_of_the_subset_yields_json(
    tiny: TokenizerEngine, vocab: VocabData, schema: dict[str, Any], rnd: random.Random
) -> None:
    """The whole subset, including what only the final validation enforces: the constraint
    never fails and never lets a row end on text that is not JSON."""
    ids, ended, constraint = walk(vocab, tiny.eos_token_ids, schema, rnd)
    assert not constraint.failed, (constraint.reason, tiny.decode(ids), json.dumps(schema))
    if ended:
        json.loads(tiny.decode(ids))


def test_numeric_bounds_are_left_to_validation(tiny: TokenizerEngine, vocab: VocabData) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["n"]}
    assert lower(schema)["properties"]["n"] == {"type": "integer"}
    verdicts = set()
    for seed in range(40):
        ids, ended, constraint = walk(vocab, tiny.eos_token_ids, schema, random.Random(seed))
        if ended:
            text = tiny.decode(ids)
            assert validate(text, _without_bounds(schema)) is None
            verdicts.add(validate(text, schema) is None)
    assert verdicts == {True, False}  # the mask alone lets out-of-range numbers through


def test_json_object_mode_yields_an_object(tiny: TokenizerEngine, vocab: VocabData) -> None:
    ended_count = 0
    for seed in range(30):
        ids, ended, constraint = walk(vocab, tiny.eos_token_ids, None, random.Random(seed))
        assert not constraint.failed
        if ended:
            ended_count += 1
            assert validate(tiny.decode(ids), None) is None
            assert isinstance(json.loads(tiny.decode(ids)), dict)
    assert ended_count >= 20


def test_a_suffix_follows_the_document(tiny: TokenizerEngine, vocab: VocabData) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    suffix = "\n<end>"
    ended_count = 0
    for seed in range(20):
        ids, ended, constraint = walk(vocab, tiny.eos_token_ids, schema, random.Random(seed), suffix=suffix)
        assert not constraint.failed
        if ended:
            ended_count += 1
            text = tiny.decode(ids)
            assert text.endswith(suffix) and validate(text[: -len(suffix)], schema) is None
    assert ended_count >= 10


# ---------------------------------------------------------------- the parser, character by character


def feeds(schema: dict[str, Any] | None, text: str) -> bool:
    """Whether the parser takes ``text`` character by character and may end after it."""
    parser: CharacterLevelParser = parser_for(schema)
    for character in text:
        if character not in parser.get_allowed_characters():
            return False
        parser = parser.add_character(character)
    return bool(parser.can_end())


NESTED_ANY_OF = {  # each branch lowers to an anyOf of its own
    "anyOf": [
        {
            "type": "object",
            "properties": {"e": {"type": "integer"}, "s": {"type": "string"}},
            "anyOf": [{"required": ["e"]}, {"required": ["s"]}],
        },
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
    ]
}
OBJECT_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("schema", "text", "accepted"),
    [
        (OBJECT_AB, '{"a": 1}', True),
        (OBJECT_AB, '{"a": 1,}', False),  # the library took a trailing comma
        (None, '{"a": 1, "b": [2]}', True),
        (None, '{"a": 1,}', False),
        (None, "[1]", False),  # json_object mode: an object only
        ({"type": "integer"}, "12", True),
        ({"type": "integer"}, "1e5", False),  # the library let integers take exponents
        ({"type": "integer"}, "-0.5", False),  # ... and a fraction after -0
        ({"type": "number"}, "-0.5e3", True),
        ({"type": "string", "maxLength": 5}, '" pro "', True),
        ({"type": "string", "maxLength": 5}, '" pro o"', False),  # leading whitespace was not counted
        ({"type": "string", "pattern": "^[a-z]+$"}, '"ab"', True),
        ({"type": "string", "pattern": "^[a-z]+$"}, '" ab"', False),  # ... nor seen by the pattern
        ({"type": "string", "pattern": "[0-9]{2}"}, '"42"', True),
        ({"type": "string", "pattern": "^[a-z]{2}-\\d{2}$"}, '"ab12"', False),
        ({"type": "string", "maxLength": 1}, '"\\u0041"', True),  # an escape is one character
        ({"type": "string", "maxLength": 0}, '""', True),
        ({"type": "string", "maxLength": 0}, '"a"', False),  # the free-text shortcut read 0 as no limit
        ({"enum": [True, 1, None, [1, 2]]}, "true", True),
        ({"enum": [True, 1, None, [1, 2]]}, "True", False),  # the library wrote Python's str(True)
        ({"enum": [True, 1, None, [1, 2]]}, "[1,2]", True),
        ({"enum": [True, 1, None, [1, 2]]}, "false", False),
        ({"const": 5}, "5", True),  # a numeric const crashed the library
        ({"const": 5}, "6", False),
        ({"const": "hi"}, '"hi"', True),
        ({"enum": [{"x": 1}, [1, 2]]}, '{"x": 1}', True),  # objects are written member by member
        ({"enum": [{"x": 1}, [1, 2]]}, "{}", False),  # the object was loosened to any object
        ({"enum": [{"x": 1}, [1, 2]]}, '{"x": 2}', False),
        ({"enum": [{"x": 1}, [1, 2]]}, '{"x": 1, "y": 1}', False),
        ({"const": {"x": {"y": ["b", "b"]}, "z": None}}, '{"z": null, "x": {"y": ["b", "b"]}}', True),  # any key order
        ({"const": {"x": {"y": ["b", "b"]}, "z": None}}, '{"x": {"y": ["b"]}, "z": null}', False),
        ({"const": {"x": {"y": ["b", "b"]}, "z": None}}, '{"x": {"y": ["b", "b"]}}', False),
        ({"enum": [{"x": 1}, {"x": 2, "y": "q"}]}, '{"x": 2, "y": "q"}', True),
        ({"enum": [{"x": 1}, {"x": 2, "y": "q"}]}, '{"x": 1, "y": "q"}', False),
        ({"const": ["a", "a"]}, '["a", "a"]', True),
        ({"const": ["a", "a"]}, '["a"]', False),
        ({"type": "string", "enum": ["a", 1, "b"]}, "1", False),  # enum filtered by its type
        ({"type": ["string", "null"], "maxLength": 2}, '"abc"', False),  # a type list dropped maxLength
        ({"type": ["string", "null"], "maxLength": 2}, "null", True),
        ({"properties": {"a": {"type": "null"}}}, "7", True),  # no type: any type (the library crashed)
        ({"properties": {"a": {"type": "null"}}}, '{"a": null}', True),
        ({"type": "object", "additionalProperties": True}, '{"k": [1]}', True),  # crashed the library
        ({"type": "object", "additionalProperties": False}, '{"k": 1}', False),  # read as "any key"
        ({"type": "object", "additionalProperties": False}, "{}", True),
        ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["z"]}, '{"z": 1}', True),
        ({"type": "array", "maxItems": 0}, "[]", True),
        ({"type": "array", "maxItems": 0}, "[1]", False),  # the library allowed one item
        ({"type": "array", "items": {"type": "integer"}}, "[" + ",".join(["1"] * 30) + "]", True),  # not capped at 20
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            "{}",
            False,
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            '{"b": 2}',
            True,
        ),
        (
            {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                        "required": ["next"],
                    }
                },
                "$ref": "#/$defs/n",
            },
            '{"next": {"next": {"next": null}}}',
            True,
        ),
        ({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "integer"}}]}, '["a", "b"]', True),
        ({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "integer"}}]}, "[1, 2]", True),
        ({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "integer"}}]}, '[1, "a"]', False),
        (NESTED_ANY_OF, '{"a": "x"}', True),  # nested anyOf objects kept their keys apart
        (NESTED_ANY_OF, '{"e": 1}', True),
        (NESTED_ANY_OF, '{"a"a', False),
        ({"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 9}]}, '" \\""', True),  # escapes in two readings
        ({"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 9}]}, '" \\"""', False),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}}, "definitions": {"x": {"type": "boolean"}}},
            '{"a": false}',
            True,
        ),
        ({"const": [{"a": 1}, {"a": 1}]}, '[{"a": 1}, {"a": 1}]', True),
        ({"const": [["x", "x"], ["x", "x"]]}, '[["x", "x"], ["x", "x"]]', True),
        ({"type": "number"}, "0.E0", False),  # a fraction needs its digit before an exponent (hypothesis found it)
        ({"type": "number"}, "0.5E0", True),
        ({"type": "number"}, "-1.e5", False),
    ],
)
def test_the_parser_takes_exactly_the_schema(schema: dict[str, Any] | None, text: str, accepted: bool) -> None:
    if schema is not None:
        check_schema(schema)
    assert feeds(schema, text) is accepted
    if accepted and schema is not None:
        assert validate(text, schema) is None


def test_a_suffix_keeps_the_free_text_shortcut() -> None:
    """A forced tool call is a document then its closing: inside a free-text string the
    sequence gives the document's free-text shortcut, as the document alone does (without it
    the enforcer explored the vocabulary character by character at every step: a forced call
    with an open object took tens of seconds where json_object took under one)."""
    alone: CharacterLevelParser = parser_for({"type": "object"})
    suffixed: CharacterLevelParser = parser_for({"type": "object"}, "}\n</tool_call>")
    for character in '{"ab':
        alone, suffixed = alone.add_character(character), suffixed.add_character(character)
        assert suffixed.shortcut_key() == alone.shortcut_key()
        assert set(suffixed.get_allowed_characters()) == set(alone.get_allowed_characters())
    assert alone.shortcut_key() == ("json_freetext", 2, 0, sys.maxsize)
    for character in '": 1}':
        suffixed = suffixed.add_character(character)
    assert set(suffixed.get_allowed_characters()) - set(" \t\r\n") == {"}"} and not suffixed.can_end()  # then the suffix


def test_a_built_automaton_has_no_state_a_match_cannot_leave() -> None:
    """lm-format-enforcer offers every transition of an automaton's state as allowed; a
    transition into a state from which no match can be completed (interegular leaves them in
    a lookahead's automaton) let a row leave the pattern and write anything after it. The
    build process drops them, and refuses a pattern that no string matches."""
    from lmformatenforcer import RegexParser

    from millm_plugins.structured.automata import _context
    from millm_plugins.structured.constraint import parser_config
    from millm_plugins.structured.fsmbuild import Builder

    builder = Builder()
    try:
        parser = RegexParser(_context(builder.build("(?:(?!abc)[a-c]{3})", 10.0)), parser_config())
        for character in "ab":
            parser = parser.add_character(character)
        assert sorted(parser.get_allowed_characters()) == ["a", "b"]  # "c" led to a dead state, then to anything
        with pytest.raises(ValueError, match="no string matches"):
            builder.build("(?:x[^\\s\\S])", 10.0)
    finally:
        builder.close()


def test_whitespace_runs_are_bounded() -> None:
    assert MAX_CONSECUTIVE_WHITESPACE == 2
    assert feeds({"type": "object"}, '{\n "a": [1, 2]\n}')
    assert not feeds({"type": "object"}, '{\n   "a": 1}')
    assert not feeds({"type": "integer"}, "   1")


S_OBJECT = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
S_EITHER = {"anyOf": [S_OBJECT, {"type": "object", "properties": {"s": {"type": "string"}, "t": {"type": "null"}}, "required": ["s"]}]}


@pytest.mark.parametrize("suffix", ["", "\n<end>"])
@pytest.mark.parametrize("schema", [S_OBJECT, S_EITHER], ids=["object", "anyOf"])
def test_a_free_text_character_outside_the_alphabet_stays_in_the_string(schema: dict[str, Any], suffix: str) -> None:
    # The free-text token list lets any token in; a character the alphabet lacks (é here)
    # made the library pop every open value and call the document complete, and unions
    # and sequences refused to route it.
    parser: Any = parser_for(schema, suffix)
    for character in '{"s": "caf':
        parser = parser.add_character(character)
    allowed = parser.get_allowed_characters()
    assert "é" not in set(allowed)  # the token tree is explored with the alphabet only
    if not suffix:
        assert "é" in allowed  # but the character is routed into the string
    parser = parser.add_character("é")
    assert not parser.can_end()
    for character in '"}' + suffix:
        assert character in parser.get_allowed_characters()
        parser = parser.add_character(character)
    assert parser.can_end()


def test_a_character_no_value_takes_raises_instead_of_ending_the_document() -> None:
    parser: Any = parser_for({"type": "object", "properties": {"n": {"type": "integer"}}})
    for character in '{"n": 1':
        parser = parser.add_character(character)
    with pytest.raises(ValueError, match="not allowed"):
        parser.add_character("x")


# ---------------------------------------------------------------- the processor


def _drive(constraint: JsonConstraint, ids: list[int]) -> None:
    for token in ids:
        assert token in set(constraint.allowed_tokens().tolist())
        constraint.on_token(token, "")


def test_the_processor_contract(tiny: TokenizerEngine, vocab: VocabData) -> None:
    constraint = JsonConstraint(vocab.data, parser_for({"type": "object"}))
    assert constraint.logit_bias() is None and constraint.flush() == ""
    first = constraint.allowed_tokens()
    assert constraint.allowed_tokens() is first  # the same state converts once
    assert tiny.tokenizer.eos_token_id not in set(first.tolist())
    constraint.on_token(-1, "forced text")  # text without a token: not recorded
    assert constraint.generated == []
    ids = tiny.encode('{"k": [1, "two"]}', add_special_tokens=False)
    _drive(constraint, ids)
    assert constraint.complete and tiny.tokenizer.eos_token_id in set(constraint.allowed_tokens().tolist())
    assert constraint.generated == ids
    assert len(constraint._enforcer.prefix_states) == 1  # one state kept, not one per step


def test_tokens_recorded_without_a_step_between_are_all_applied(tiny: TokenizerEngine, vocab: VocabData) -> None:
    constraint = JsonConstraint(vocab.data, parser_for({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}))
    for token in tiny.encode('{"k": 12', add_special_tokens=False):
        constraint.on_token(token, "")
    allowed = set(constraint.allowed_tokens().tolist())
    assert not constraint.failed
    assert tiny.encode("}", add_special_tokens=False)[0] in allowed
    assert tiny.encode('"', add_special_tokens=False)[0] not in allowed


def test_strings_never_take_control_characters(vocab: VocabData, tiny: TokenizerEngine) -> None:
    texts = _texts(vocab)
    control = {t for t, text in texts.items() if any(ord(c) < 0x20 for c in text)}
    assert control  # the vocabulary has tabs and newlines
    constraint = JsonConstraint(vocab.data, parser_for({"type": "string"}))
    outside = set(constraint.allowed_tokens().tolist())
    assert outside & control  # whitespace before the value is fine
    _drive(constraint, tiny.encode('"a', add_special_tokens=False))
    inside = set(constraint.allowed_tokens().tolist())
    # a control character before the closing quote would be inside the string
    assert inside and not {t for t in inside & control if any(ord(c) < 0x20 for c in texts[t].split('"')[0])}


def test_partial_characters_are_withheld_only_in_strings_with_a_max_length(vocab: VocabData, tiny: TokenizerEngine) -> None:
    partial = {t for t, text in _texts(vocab).items() if "\ufffd" in text}
    assert partial
    for schema, expect_partial in (({"type": "string"}, True), ({"type": "string", "maxLength": 8}, False)):
        constraint = JsonConstraint(vocab.data, parser_for(schema))
        _drive(constraint, tiny.encode('"a', add_special_tokens=False))
        assert bool(set(constraint.allowed_tokens().tolist()) & partial) is expect_partial


class _Raises(CharacterLevelParser):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def add_character(self, new_character: str) -> CharacterLevelParser:
        return self

    def get_allowed_characters(self) -> str:
        raise self.error

    def can_end(self) -> bool:
        return False


@pytest.mark.parametrize(
    "parser",
    [
        pytest.param(_Raises(LMFormatEnforcerException("refused")), id="library-exception"),
        pytest.param(_Raises(RuntimeError("bug")), id="other-exception"),
        pytest.param(StringParser("\ufffe"), id="no-allowed-token"),
    ],
)
def test_a_failing_enforcer_ends_the_row(vocab: VocabData, tiny: TokenizerEngine, parser: CharacterLevelParser) -> None:
    constraint = JsonConstraint(vocab.data, parser)
    assert constraint.allowed_tokens().tolist() == [tiny.tokenizer.eos_token_id]
    assert constraint.failed and constraint.reason


def test_an_enum_string_no_token_spells_ends_the_row(vocab: VocabData, tiny: TokenizerEngine) -> None:
    # U+0080 exists in this byte-level vocabulary only as two partial-character tokens,
    # which the enforcer's token tree cannot match against an enum's characters.
    assert not any("\u0080" in text for text in _texts(vocab).values())
    constraint = JsonConstraint(vocab.data, parser_for({"enum": ["\u0080"]}))
    _drive(constraint, tiny.encode('"', add_special_tokens=False))
    assert constraint.allowed_tokens().tolist() == [tiny.tokenizer.eos_token_id]
    assert constraint.failed and "no allowed token" in (constraint.reason or "")


def test_a_token_outside_the_allowed_set_ends_the_row(vocab: VocabData, tiny: TokenizerEngine) -> None:
    constraint = JsonConstraint(vocab.data, parser_for({"type": "integer"}))
    assert not constraint.failed
    constraint.on_token(tiny.encode("x", add_special_tokens=False)[0], "x")
    assert constraint.allowed_tokens().tolist() == [tiny.tokenizer.eos_token_id]
    assert constraint.failed and "outside the allowed set" in (constraint.reason or "")


# ---------------------------------------------------------------- the vocabulary


def test_regular_tokens(tiny: TokenizerEngine, vocab: VocabData) -> None:
    tokenizer = tiny.tokenizer
    ids = {t for t, _, _ in vocab.regular_tokens}
    assert not ids & set(tokenizer.all_special_ids) and tokenizer.eos_token_id not in ids
    assert all(text for _, text, _ in vocab.regular_tokens)
    skipped = set(range(len(tokenizer))) - ids
    assert 3 <= len(skipped) <= 8 and all(tiny.decode([i]) == "" for i in skipped)
    sample = ' {"the": [1.5, null]} café'
    texts = _texts(vocab)
    assert "".join(texts[t] for t in tiny.encode(sample, add_special_tokens=False)) == sample

    # ids past the tokenizer's vocabulary (a padded embedding) are skipped, raising or not
    def decode(token_ids: list[int]) -> str:
        if max(token_ids) >= len(tokenizer):
            raise IndexError(max(token_ids))
        return tiny.decode(token_ids)

    def encode(text: str) -> list[int]:
        return tiny.encode(text, add_special_tokens=False)

    padded = build_regular_tokens(decode, encode, len(tokenizer) + 64, tiny.eos_token_ids)
    assert padded == vocab.regular_tokens


def test_word_starts_are_read_after_a_zero() -> None:
    # A sentencepiece-like decoder drops the leading space of a text's first word.
    pieces = {0: "0", 1: " a", 2: "b", 3: ""}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).lstrip(" ")

    regular = build_regular_tokens(decode, lambda text: [0], 4, eos=[3])
    assert regular == [(0, "0", False), (1, " a", True), (2, "b", False)]
    assert decoder_for(lambda ids: "ab\ufffd\ufffd")([1]) == "ab"
    data = make_tokenizer_data(regular, decode, [3], 4)
    assert data.eos_token_id == [3] and not data.partial_tokens.any()


def test_the_disk_cache_is_reused_and_keyed_by_the_vocabulary(tiny: TokenizerEngine, tmp_path: Path) -> None:
    first = tokenizer_data(tiny, tmp_path)
    second = tokenizer_data(tiny, tmp_path)
    assert (first.cached, second.cached) == (False, True)
    assert second.regular_tokens == first.regular_tokens
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("vocab-") and files[0].endswith(".json")  # no temp file left

    from millm_engines.transformers.testing import build_tokenizer

    other = TokenizerEngine(build_tokenizer(vocab_size=512))
    third = tokenizer_data(other, tmp_path)
    assert not third.cached and third.regular_tokens != first.regular_tokens
    assert len(list(tmp_path.iterdir())) == 2
    assert fingerprint(other.decode, lambda t: other.encode(t, add_special_tokens=False), 512, [4]) != fingerprint(
        tiny.decode, lambda t: tiny.encode(t, add_special_tokens=False), 512, [4]
    )
    same_words_other_eos = TokenizerEngine(tiny.tokenizer)
    same_words_other_eos.eos_token_ids = frozenset([0])
    assert not tokenizer_data(same_words_other_eos, tmp_path).cached


def test_a_damaged_cache_file_is_rebuilt(tiny: TokenizerEngine, tmp_path: Path) -> None:
    built = tokenizer_data(tiny, tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_text('{"version": 1, "tokens": [[1, "a"')
    again = tokenizer_data(tiny, tmp_path)
    assert not again.cached and again.regular_tokens == built.regular_tokens
    assert tokenizer_data(tiny, tmp_path).cached


def test_an_unwritable_cache_directory_only_costs_time(tiny: TokenizerEngine, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    vocab = tokenizer_data(tiny, blocked / "cache")
    assert not vocab.cached and vocab.regular_tokens


def test_the_engine_itself_gives_the_same_vocabulary(millm_tiny_model: Any, vocab: VocabData) -> None:
    assert tokenizer_data(millm_tiny_model.engine, None).regular_tokens == vocab.regular_tokens


# ---------------------------------------------------------------- SmolLM2 (when converted)


def _smollm2_dir() -> str:
    """The default model's converted checkpoint (converted from the installed package on
    first use, offline, as ``make serve`` does)."""
    from millm_core.config import cache_root, load_settings
    from millm_plugins.smollm2.convert import converted_dir

    return converted_dir(cache_root(load_settings()))[0]  # MILLM_CACHE_DIR as make serve reads it


@pytest.mark.e2e
def test_smollm2_walks_validate(tmp_path: Path) -> None:
    directory = _smollm2_dir()
    from transformers import AutoTokenizer

    with open(os.path.join(directory, "config.json")) as fh:
        vocab_size = int(json.load(fh)["vocab_size"])
    engine = TokenizerEngine(AutoTokenizer.from_pretrained(directory), vocab_size)
    vocab = tokenizer_data(engine, tmp_path)
    assert len(vocab.regular_tokens) > 49_000
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "label": {"enum": ["humor", "not_humor"]},
        },
        "required": ["name", "age", "tags", "label"],
        "additionalProperties": False,
    }
    ended = 0
    for seed in range(6):
        ids, done, constraint = walk(vocab, engine.eos_token_ids, schema, random.Random(seed))
        assert not constraint.failed, constraint.reason
        if done:
            ended += 1
            assert validate(engine.decode(ids), schema) is None
    assert ended >= 3
