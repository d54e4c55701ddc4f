"""The per-token constraint: which tokens may come next so that a row's text stays a
prefix of one JSON document (of a schema from millm's subset), built on
lm-format-enforcer's character-level ``JsonSchemaParser`` and ``TokenEnforcer``.

lm-format-enforcer 0.11.3 crashes on, or silently loosens, several schemas of the subset,
so :func:`~.lowering.lower` first rewrites a checked schema into the dialect it handles (each rule
below names the quirk it works around). What the mask still cannot enforce is enforced by
the final :func:`~.schema.validate` alone (a complete document that fails it is a 500):

- ``minimum``/``maximum`` (the library has no numeric bounds);
- ``minLength`` or ``maxLength`` together with ``pattern`` (the library refuses the
  pair; the pattern is kept), and ``minLength`` met by a surrogate-pair escape
  (``\\ud83d\\ude00`` counts as two characters while generated, one in the document);
- ``enum``/``const`` strings holding ``"``, ``\\`` or control characters (at any depth of
  an object or array value; such a string is loosened to any string). Objects are
  written member by member, and arrays holding strings or objects as ``items`` when all
  their items are equal; any other such array is refused by :func:`~.schema.check_schema`;
- ``$ref`` with sibling keywords (the ref alone is followed), and ``anyOf`` branches whose
  keywords overlap the keywords beside the ``anyOf`` (the branch's win);
- ``additionalProperties`` beside ``properties`` is stricter, not looser: only the listed
  properties are generated. A ``pattern`` is generated as a full match (see
  :func:`~.schema.enforcer_pattern`), also stricter than the schema.

The mask works on characters the vocabulary spells whole: an ``enum``/``const`` string,
property name or pattern character that only exists as partial-character byte tokens (rare
non-ASCII with a byte-level BPE vocabulary) cannot be generated, and such a row fails
(:attr:`JsonConstraint.failed`). Free text takes any token, partial ones included.

Whitespace: the library allows 12 consecutive whitespace characters between JSON tokens,
enough for a small model to spend its budget on newlines. Here at most
:data:`MAX_CONSECUTIVE_WHITESPACE` (2) are allowed anywhere outside free-text strings:
``{"a": 1, "b": [1, 2]}`` and one newline plus a space fit, pretty-printed indentation does
not. Arrays without ``maxItems`` are not capped (the library caps them at 20 by default,
which would silently refuse valid documents).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import structlog
from lmformatenforcer import (
    CharacterLevelParser,
    CharacterLevelParserConfig,
    JsonSchemaParser,
    RegexParser,
    SequenceParser,
    StringParser,
    TokenEnforcer,
    TokenEnforcerTokenizerData,
    UnionParser,
)
from lmformatenforcer.characterlevelparser import ForceStopParser
from lmformatenforcer.consts import COMPLETE_ALPHABET, WHITESPACE_CHARACTERS
from lmformatenforcer.external.jsonschemaobject import JsonSchemaObject
from lmformatenforcer.jsonschemaparser import (
    NumberParsingState,
    ObjectParsingStage,
    ObjectParsingState,
    StringParsingState,
)

from .lowering import lower, patterns_in
from .schema import SCHEMA_PARAM, ResponseFormatUnsupported, SchemaProblem

log = structlog.get_logger("millm.structured")

MAX_CONSECUTIVE_WHITESPACE = 2


def parser_config() -> CharacterLevelParserConfig:
    """The parser settings millm uses, explicit so that the library's ``LMFE_*``
    environment variables cannot change them: printable-ASCII alphabet for strings that
    are explored character by character (free text takes any token), at most
    :data:`MAX_CONSECUTIVE_WHITESPACE` whitespace characters in a row, keys in any order,
    arrays not capped beyond their ``maxItems``."""
    return CharacterLevelParserConfig(
        alphabet=COMPLETE_ALPHABET,
        max_consecutive_whitespaces=MAX_CONSECUTIVE_WHITESPACE,
        force_json_field_order=False,
        max_json_array_length=0,
    )


def _json_parser(lowered: dict[str, Any], config: CharacterLevelParserConfig, automata: Mapping[str, Any]) -> JsonSchemaParser:
    context = JsonSchemaParser._Context()
    context.model_class = JsonSchemaObject(**lowered)
    context.alphabet_without_quotes = config.alphabet.replace('"', "")
    # The library's regex cache is a class attribute shared by every parser in the
    # process (it grows with every pattern ever seen); this parser gets its own, filled
    # now so no automaton is compiled inside a decode step. Automata built beforehand (see
    # :mod:`.automata`) are used as they are.
    context.regex_parser_cache = {}
    for pattern in patterns_in(lowered):
        try:
            context.regex_parser_cache[pattern] = RegexParser(automata.get(pattern, pattern), config)
        except Exception as exc:
            problem = SchemaProblem("", "pattern", f"pattern {pattern!r} cannot be compiled ({exc})")
            raise ResponseFormatUnsupported(
                f"the schema cannot be constrained: {problem.describe()}", param=SCHEMA_PARAM, problems=(problem,)
            ) from None
    parser = JsonSchemaParser(context, config)
    context.active_parser = parser
    return parser


def _in_string(state: Any) -> bool:
    """Whether ``state`` is a quoted string (value or key) between its quotes."""
    return (
        isinstance(state, StringParsingState) and state.require_opening_quote and state.seen_opening_quote and not state.seen_closing_quote
    )


def _free_text(state: Any) -> bool:
    """Whether ``state`` is an open string of any text (no enum, no pattern) with room left."""
    return (
        _in_string(state)
        and not state.allowed_strings
        and state.regex_parser is None
        and (state.max_length is None or len(state.parsed_string) < state.max_length)
    )


def _top_members(parser: Any) -> list[Any]:
    """The innermost open values of a ``JsonSchemaParser`` (several under a union)."""
    stack = getattr(parser, "object_stack", None)
    members, pending = [], list(stack[-1:]) if stack else []
    while pending:
        state = pending.pop(0)
        if isinstance(state, UnionParser):
            pending[:0] = state.parsers
        else:
            members.append(state)
    return members


def _is_text(character: str) -> bool:
    return len(character) == 1 and ord(character) >= 0x20 and character not in '"\\'


class _TextChars(str):
    """The allowed characters of a state inside free text: iterating it gives the parser's
    alphabet (what the token tree is explored with), but ``in`` also admits any other
    text character, as the free-text token list does (``UnionParser`` and
    ``SequenceParser`` route a character with ``in``)."""

    __slots__ = ()

    def __contains__(self, character: object) -> bool:
        return isinstance(character, str) and (str.__contains__(self, character) or _is_text(character))


class _Repaired(CharacterLevelParser):
    """Wraps a ``JsonSchemaParser`` (and, through unions, each of its successors) to close
    holes in the library's character handling:

    - an integer may take an exponent (``1e-5``) and, after ``-0``, a fraction: while the
      innermost value is an integer, ``e``, ``E`` and ``.`` are withheld; and a number
      took an exponent right after its decimal point (``0.E0``): withheld there;
    - whitespace at the start of a string's content is dropped (it reads it as whitespace
      before the value), so ``" pro o"`` passed ``maxLength: 5`` and a pattern never saw
      it: it is appended to the string here;
    - a character outside the parser's alphabet arriving in free text (a multi-byte
      character completed by its last byte token) made it pop every open value and report
      the document complete: it is appended to the string here, and unions and sequences
      route it here (see :class:`_TextChars`);
    - an object took ``}`` right after a comma (``{"a": 1,}``): withheld there;
    - an ``anyOf`` of arrays lost its items (``["a", "b"]`` was refused after the comma),
      nested ``anyOf`` objects mixed their keys, and an ``anyOf`` of strings doubled its
      escapes (a stray quote passed after an escaped one): the readings are split
      before ``[``, ``{`` or a backslash reaches them (see :meth:`_split`);
    - any other character no open value accepts now raises (the enforcer then stops the
      row and :class:`JsonConstraint` reports it) instead of ending the document."""

    def __init__(self, inner: CharacterLevelParser) -> None:
        super().__init__(getattr(inner, "_config", None))
        self.inner = inner

    def add_character(self, new_character: str) -> CharacterLevelParser:
        inner = self.inner
        members = _top_members(inner)
        if any(self._string_takes(m, new_character) for m in members):
            return _Repaired(self._append(inner, members, new_character))
        if new_character in "[{\\" and sum(new_character in m.get_allowed_characters() for m in members) > 1:
            return self._split(inner, members, new_character)
        following = inner.add_character(new_character)
        if isinstance(following, UnionParser):
            return _RepairedUnion([_Repaired(p) for p in following.parsers])
        if members and not getattr(following, "object_stack", True) and new_character not in inner.get_allowed_characters():
            raise ValueError(f"{new_character!r} is not allowed here")
        return _Repaired(following)

    @staticmethod
    def _string_takes(state: Any, character: str) -> bool:
        """Whether the open string ``state`` must take ``character`` although the library
        would not: leading whitespace it would drop, or text outside its alphabet."""
        if not _in_string(state):
            return False
        if character in WHITESPACE_CHARACTERS:
            return not state.parsed_string and character in state.get_allowed_characters()
        return _free_text(state) and _is_text(character) and character not in state.get_allowed_characters()

    @staticmethod
    def _split(inner: Any, members: list[Any], character: str) -> CharacterLevelParser:
        """``inner``'s successor after ``[``, ``{`` or ``\\`` when several open values
        could take it (an ``anyOf`` of arrays, objects or strings): one reading per value,
        each with its own stack. The library lets each array push its first item, and each
        string its escape parser, onto the one shared stack (an array's before it splits
        the readings), so every reading then holds all of them; and it does not split an
        ``anyOf`` nested in an ``anyOf`` at all, so the objects' keys land on one stack."""
        readings = []
        for state in members:
            if character in state.get_allowed_characters():
                reading = JsonSchemaParser(
                    inner.context, inner.config, [*inner.object_stack[:-1], state], inner.num_consecutive_whitespaces
                )
                reading.last_parsed_string = inner.last_parsed_string
                reading.last_non_whitespace_character = inner.last_non_whitespace_character
                reading.context.active_parser = reading
                readings.append(_Repaired(reading).add_character(character))
        return readings[0] if len(readings) == 1 else _RepairedUnion(readings)

    @classmethod
    def _append(cls, inner: Any, members: list[Any], character: str) -> CharacterLevelParser:
        """``inner``'s successor after ``character``, each open value taking it its way."""
        taken = []
        for state in members:
            if cls._string_takes(state, character):
                grown = state._clone()
                grown.parsed_string += character
                if grown.regex_parser is not None:
                    grown.regex_parser = grown.regex_parser.add_character(character)
                taken.append(grown)
            elif character in state.get_allowed_characters():
                taken.append(state.add_character(character))  # whitespace or text: pushes nothing
        whitespace = character in WHITESPACE_CHARACTERS
        top = taken[0] if len(taken) == 1 else UnionParser(taken)
        following = JsonSchemaParser(
            inner.context, inner.config, [*inner.object_stack[:-1], top], inner.num_consecutive_whitespaces + 1 if whitespace else 0
        )
        following.context.active_parser = following
        following.last_parsed_string = inner.last_parsed_string
        following.last_non_whitespace_character = inner.last_non_whitespace_character if whitespace else character
        return following

    def get_allowed_characters(self) -> str:
        allowed: str = self.inner.get_allowed_characters()
        members = _top_members(self.inner)
        if any(isinstance(p, NumberParsingState) and not p.allow_floating_point for p in members):
            allowed = allowed.replace("e", "").replace("E", "").replace(".", "")
        if any(isinstance(p, NumberParsingState) and p.parsed_string.endswith(".") for p in members):
            allowed = allowed.replace("e", "").replace("E", "")  # a fraction needs a digit first
        if len(members) == 1 and isinstance(members[0], ObjectParsingState):
            top = members[0]
            if top.current_stage == ObjectParsingStage.PARSING_KEY_OR_END and top.existing_keys:
                allowed = allowed.replace("}", "")  # after a comma: no trailing comma
        if any(_free_text(p) for p in members):
            return _TextChars(allowed)
        return allowed

    def can_end(self) -> bool:
        return bool(self.inner.can_end())

    def shortcut_key(self) -> Any:
        return self.inner.shortcut_key()

    def cache_key(self) -> Any:
        return self.inner.cache_key()


class _RepairedUnion(UnionParser):
    """A union of :class:`_Repaired` readings (an ``anyOf`` of objects or arrays) that
    keeps their free-text routing: a character goes to each reading that takes it."""

    def add_character(self, new_character: str) -> CharacterLevelParser:
        following = [p.add_character(new_character) for p in self.parsers if new_character in p.get_allowed_characters()]
        return following[0] if len(following) == 1 else _RepairedUnion(following)

    def get_allowed_characters(self) -> str:
        readings = [p.get_allowed_characters() for p in self.parsers]
        allowed = "".join(set("".join(readings)))
        return _TextChars(allowed) if any(isinstance(r, _TextChars) for r in readings) else allowed


class _Then(SequenceParser):
    """A document, then exactly a suffix (a forced tool call's closing), keeping the
    document's free-text shortcut.

    The library's ``SequenceParser`` reports no ``shortcut_key`` when it holds more than one
    parser, so inside every free-text string (an open object's keys and values) the enforcer
    explored the whole vocabulary character by character at every step: tens of seconds for
    40 tokens, where ``json_object`` takes under one. While the document cannot end (inside a
    string it never can), the suffix cannot begin either, so the document's allowed
    characters, and its shortcut, are the sequence's own."""

    def add_character(self, new_character: str) -> CharacterLevelParser:
        return _rewrap(super().add_character(new_character))

    def get_allowed_characters(self) -> str:
        if len(self.parsers) > 1 and not self.parsers[0].can_end():
            allowed: str = self.parsers[0].get_allowed_characters()  # a _TextChars keeps its routing
            return allowed
        return str(super().get_allowed_characters())

    def shortcut_key(self) -> Any:
        return self.parsers[0].shortcut_key() if self.parsers and not self.parsers[0].can_end() else super().shortcut_key()


def _rewrap(parser: CharacterLevelParser) -> CharacterLevelParser:
    """``parser`` with every plain ``SequenceParser`` it is made of (the library's
    ``SequenceParser.add_character`` builds them) made a :class:`_Then`."""
    if type(parser) is SequenceParser:
        return _Then(parser.parsers)
    if type(parser) is UnionParser:
        return UnionParser([_rewrap(p) for p in parser.parsers])
    return parser


def parser_for(schema: dict[str, Any] | None, suffix: str = "", automata: Mapping[str, Any] | None = None) -> CharacterLevelParser:
    """A fresh character-level parser for one row: one JSON document of ``schema``
    (checked by :func:`~.schema.check_schema`; ``None``: any JSON object), then exactly
    ``suffix`` when it is not empty. Parsers hold mutable state shared by their
    successors: build one per row, never share one between rows.

    ``automata`` holds the patterns' automata built beforehand, by pattern (see
    :mod:`.automata`); a pattern without one is built here. Raises
    :class:`~.schema.ResponseFormatUnsupported` for a ``pattern`` whose automaton cannot
    be built."""
    config = parser_config()
    parser: CharacterLevelParser = _Repaired(_json_parser(lower(schema), config, automata or {}))
    if suffix:
        parser = _Then([parser, StringParser(suffix)])
    return parser


def _bounded_string_open(parser: Any) -> bool:
    """Whether some reading of ``parser`` is inside a free-text string with ``maxLength``."""
    stack = [parser]
    while stack:
        current = stack.pop()
        if isinstance(current, _Repaired):
            if any(
                _in_string(m) and m.max_length is not None and not m.allowed_strings and m.regex_parser is None
                for m in _top_members(current.inner)
            ):
                return True
        elif isinstance(current, UnionParser):
            stack.extend(current.parsers)
        elif isinstance(current, SequenceParser) and current.parsers:
            stack.append(current.parsers[0])
    return False


class JsonConstraint:
    """One row's constraint, a millm token processor: before each step
    :meth:`allowed_tokens` lists the token ids that keep the generated text (never the
    prompt) a prefix of a document the parser accepts, eos ids included once the document
    may end. It never stops a row itself; the row ends when eos is drawn.

    If the enforcer fails (raises, reaches a state with no allowed token, or is handed a
    token outside the allowed set) the row is steered to an end: ``allowed_tokens`` returns
    the eos ids from then on, :attr:`failed` is set and :attr:`reason` says why, so the
    caller can report the row alone and its batch neighbours carry on."""

    def __init__(self, data: TokenEnforcerTokenizerData, parser: CharacterLevelParser) -> None:
        config = getattr(parser, "_config", None)
        self._enforcer = TokenEnforcer(data, parser)
        if config is not None:  # the enforcer installs its defaults on the root parser
            parser.config = config
        eos = data.eos_token_id if isinstance(data.eos_token_id, list) else [data.eos_token_id]
        self._eos_ids = frozenset(int(i) for i in eos)
        self._eos = np.array(sorted(self._eos_ids), dtype=np.int64)
        size = max(data.vocab_size, *self._eos_ids) + 1
        partial = np.zeros(size, dtype=bool)
        known = getattr(data, "partial_tokens", None)
        if known is not None:
            partial[: len(known)] = known[:size]
        else:
            partial[[i for i, text, _ in data.regular_tokens if "\ufffd" in text and i < size]] = True
        self._partial = partial if partial.any() else None
        # Shared by every row of this vocabulary (see _to_array); a row alone otherwise.
        self._freetext_arrays: dict[int, tuple[list[int], np.ndarray]] = getattr(data, "freetext_arrays", {})
        self._ids: list[int] = []
        self._fed = -1  # the longest prefix of _ids the enforcer has seen
        self._last: tuple[list[int], np.ndarray] | None = None
        self._ended = False
        self.failed = False
        self.reason: str | None = None

    @property
    def generated(self) -> list[int]:
        """The token ids recorded so far (eos excluded)."""
        return list(self._ids)

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole document (the parser may end here)."""
        if self.failed:
            return False
        try:
            state = self._advance()
        except Exception:
            return False
        return bool(state.parser.can_end())

    def logit_bias(self) -> None:
        return None

    def _fail(self, reason: str) -> np.ndarray:
        if not self.failed:
            self.failed, self.reason = True, reason
            log.warning("constraint_failed", reason=reason)
        return self._eos

    def allowed_tokens(self) -> np.ndarray:
        """The token ids allowed next, as a 1-D int64 array (may hold duplicates)."""
        if self.failed or self._ended:
            return self._eos
        try:
            state = self._advance()
            allowed = self._enforcer.get_allowed_tokens(self._ids).allowed_tokens
        except Exception as exc:  # a bug or a schema corner the library cannot parse
            return self._fail(f"the constraint library raised {type(exc).__name__}: {exc}")
        if isinstance(state.parser, ForceStopParser):
            return self._fail("a token outside the allowed set was applied")
        if not allowed or (len(allowed) <= len(self._eos_ids) and set(allowed) <= self._eos_ids and not state.parser.can_end()):
            return self._fail("the constraint reached a state with no allowed token")
        if self._last is not None and self._last[0] is allowed:
            return self._last[1]
        array = self._to_array(state.parser, allowed)
        if self._partial is not None and _bounded_string_open(state.parser):
            array = array[~self._partial[array]]  # see TokenizerData.partial_tokens
        self._last = (allowed, array)  # the list is kept so its id cannot be reused
        return array

    def _advance(self) -> Any:
        """The enforcer's state after every recorded token. Feeds each prefix not yet seen
        (``on_token`` may run more than once between steps) and drops the state behind
        it: the enforcer keeps one state, with its allowed-token list, per prefix, which
        would otherwise grow by up to a vocabulary of ids per step."""
        for n in range(self._fed + 1, len(self._ids) + 1):
            self._enforcer.get_allowed_tokens(self._ids[:n])
            if n > 0:
                self._enforcer.prefix_states.pop(tuple(self._ids[: n - 1]), None)
            self._fed = n
        return self._enforcer.prefix_states[tuple(self._ids)]

    def _to_array(self, parser: Any, allowed: list[int]) -> np.ndarray:
        """``allowed`` as an array. Inside a free-text string the enforcer's list is one of
        its cached free-text lists (up to a vocabulary of ids, the same list object for the
        same length bounds) followed by the few tokens that close the string; that list's
        array is converted once per vocabulary and shared, so a step converts only the tail."""
        head = self._freetext_head(parser)
        if head is None or len(allowed) < len(head) or (head and (allowed[0] != head[0] or allowed[len(head) - 1] != head[-1])):
            return np.fromiter(allowed, dtype=np.int64, count=len(allowed))
        arrays = self._freetext_arrays
        cached = arrays.get(id(head))
        if cached is None or cached[0] is not head:
            cached = (head, np.fromiter(head, dtype=np.int64, count=len(head)))
            arrays[id(head)] = cached  # the list is kept so its id cannot be reused
        tail = allowed[len(head) :]
        return np.concatenate([cached[1], np.fromiter(tail, dtype=np.int64, count=len(tail))])

    def _freetext_head(self, parser: Any) -> list[int] | None:
        """The enforcer's cached free-text list for this state (its own computation in
        ``TokenEnforcer._collect_allowed_tokens``), or ``None`` outside free text."""
        key = parser.shortcut_key()
        if not (isinstance(key, tuple) and len(key) == 4 and key[0] == "json_freetext"):
            return None
        _, cur_len, min_len, max_len = key
        cache = self._enforcer.tokenizer_tree.json_freetext_tokens
        min_remaining = min(cache.max_token_len, max(0, min_len - cur_len))
        max_allowed_len = min(cache.max_token_len, max_len - cur_len)
        head: list[int] = cache.lookup_allowed_tokens(min_remaining, max_allowed_len).allowed_tokens
        return head

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        """Record a drawn token (``-1``: text with no token, not recorded)."""
        if token_id in self._eos_ids:
            self._ended = True
        elif token_id != -1:
            self._ids.append(int(token_id))
        return text, False

    def flush(self) -> str:
        return ""
