"""What the structured-output plugin offers plugins built on it (the tools plugin): JSON
schema checks and limits, pattern budgets, the automata builds, constraints and their
errors. This is its public surface: import these names from here, never from its other
modules.
"""

from __future__ import annotations

from typing import Any

from .automata import automata, shutdown_automata
from .budget import pattern_problem, schema_pattern_problems
from .cache import ready_vocab, vocab_for
from .errors import ConstrainedOutputInvalid
from .lazy import LazyConstraint
from .lowering import schema_patterns
from .plugin import constraint_of
from .schema import MAX_BYTES, MAX_DEPTH, ResponseFormatUnsupported, check_schema, check_validator


def parser_config() -> Any:
    """lm-format-enforcer's parser settings for constrained rows. It imports
    lm-format-enforcer (and torch with it): call it where the model runs, never at import."""
    from .constraint import parser_config as config

    return config()


__all__ = ["ConstrainedOutputInvalid", "LazyConstraint", "MAX_BYTES", "MAX_DEPTH", "ResponseFormatUnsupported", "automata", "check_schema", "check_validator", "constraint_of", "parser_config", "pattern_problem", "ready_vocab", "schema_pattern_problems", "schema_patterns", "shutdown_automata", "vocab_for"]
