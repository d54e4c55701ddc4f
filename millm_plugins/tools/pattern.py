"""A forced call's arguments written in a non-JSON syntax (pythonic), constrained by a
regular expression with lm-format-enforcer's regex parser."""

from __future__ import annotations

from typing import Any


def pattern_parser(pattern: str, suffix: str, automaton: Any = None) -> Any:
    """A fresh parser for one row: text matching ``pattern``, then exactly ``suffix``
    (lm-format-enforcer is imported here, on the model thread, not with the plugin).
    ``automaton``: ``pattern``'s, built beforehand (see :mod:`millm_plugins.structured.automata`);
    None builds it here."""
    from lmformatenforcer import RegexParser
    from lmformatenforcer.characterlevelparser import SequenceParser, StringParser

    from millm_plugins.structured.public import parser_config

    parser: Any = RegexParser(automaton if automaton is not None else pattern, parser_config())
    if suffix:
        parser = SequenceParser([parser, StringParser(suffix)])
    return parser
