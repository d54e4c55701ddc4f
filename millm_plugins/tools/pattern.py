"""A forced call's arguments written in a non-JSON syntax (pythonic), constrained by a
regular expression with lm-format-enforcer's regex parser."""

from __future__ import annotations

from typing import Any


def pattern_parser(pattern: str, suffix: str) -> Any:
    """A fresh parser for one row: text matching ``pattern``, then exactly ``suffix``
    (lm-format-enforcer is imported here, on the model thread, not with the plugin)."""
    from lmformatenforcer import RegexParser
    from lmformatenforcer.characterlevelparser import SequenceParser, StringParser

    parser: Any = RegexParser(pattern)
    if suffix:
        parser = SequenceParser([parser, StringParser(suffix)])
    return parser
