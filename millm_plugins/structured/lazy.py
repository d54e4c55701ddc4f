"""A row's output constraint, created on the model thread at the row's first step.

lm-format-enforcer (and, through it, torch) is imported only when a constrained row first
runs, so that importing the plugin stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .errors import ConstrainedOutputInvalid
from .schema import validate

if TYPE_CHECKING:
    from .constraint import JsonConstraint
    from .vocab import VocabData


class LazyConstraint:
    """A row's :class:`JsonConstraint` over the parser ``make_parser()`` builds, created on
    the model thread at the row's first step (the
    vocabulary may still be building just after start-up; the wait is the model
    thread's, never the event loop's)."""

    def __init__(
        self, vocab: Future[VocabData], make_parser: Callable[[], Any], *, validates: bool = False, schema: dict[str, Any] | None = None
    ) -> None:
        self._vocab = vocab
        self._make_parser = make_parser  # a fresh character-level parser for this row
        self._inner: JsonConstraint | None = None
        self._text = ""
        self._validates = validates  # the row's whole text is one document of ``schema``
        self._schema = schema

    @classmethod
    def json(
        cls, vocab: Future[VocabData], schema: dict[str, Any] | None, suffix: str = "", automata: Mapping[str, Any] | None = None
    ) -> LazyConstraint:
        """One JSON document of ``schema`` (None: any object), then ``suffix``; without a
        suffix the row's text is that document, validated when the row ends. ``automata``:
        the schema's pattern automata, built beforehand (see :mod:`.automata`)."""

        def make() -> Any:
            from .constraint import parser_for

            return parser_for(schema, suffix, automata)

        return cls(vocab, make, validates=not suffix, schema=schema)

    def _constraint(self) -> JsonConstraint:
        if self._inner is None:
            from .constraint import JsonConstraint

            self._inner = JsonConstraint(self._vocab.result().data, self._make_parser())
        return self._inner

    def logit_bias(self) -> None:
        return None

    def allowed_tokens(self) -> Any:
        return self._constraint().allowed_tokens()

    def on_token(self, token_id: int, text: str) -> tuple[str, bool]:
        self._text += text
        return self._constraint().on_token(token_id, text)

    def flush(self) -> str:
        return ""

    def end(self, finish_reason: str) -> None:
        """Before the row's final chunk: a constraint that failed, or a document the model
        closed that does not validate, fails the request (``finish_reason: "stop"`` must
        mean a valid document, streamed or not)."""
        if self._inner is not None and self._inner.failed:
            raise ConstrainedOutputInvalid(f"the output constraint failed: {self._inner.reason}")
        if self._validates and finish_reason == "stop":
            reason = validate(self._text, self._schema)
            if reason is not None:
                raise ConstrainedOutputInvalid(f"the document does not validate: {reason}")
